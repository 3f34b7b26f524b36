"""The app layer: the `mhcpipe` command line and the demo. It sits above every package; nothing imports it."""
