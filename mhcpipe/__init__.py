"""The app layer: the `mhcpipe` command line and the demo. It sits above every package; nothing imports it.

Modules: `cli` (the `mhcpipe` command; `__main__` runs it) and one per subcommand: `schedule_cli`, `predict_cli`,
`tune_cli`, `calibrate_cli`, `run_cli`, `trace_cli`, `convert_cli`, `analysis_cli`, `comm_cli`, `layout_cli`,
`diagnose_cli`, `checkpoint_cli`, `check_split_cli`, the `demo`; `user` is what a user's model script imports.
"""
