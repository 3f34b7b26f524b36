"""The mhc-pipe runtime (torchrun entry, executor, model, P2P) and the `mhcpipe` command line."""
