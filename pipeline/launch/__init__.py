"""Starting runs: the flags shared by `mhcpipe run` and the torchrun entry (run_args), rank processes on one host
for tests and benchmarks (local), and the host micro-benchmarks of the runtime the `local` cost model is
calibrated from (host_measurements), and whether the ranks of a node share a GPU (gpu_sharing).

May import: everything in pipeline (the top layer below the torchrun entry, pipeline/__main__.py).

Also: `user_config` (a user's builder -> model and config), `check_split` (split against unsplit).
"""
