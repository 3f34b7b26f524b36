"""Cost model (see docs/costmodel.md), by role, in rooms that import only the rooms listed before them:

`physics/` what things cost in isolation (hardware specs, per-op work, the residual variants' kernels,
communication, memory); `pricing/` per-action prices of a layout (the Pricer and its options, the overlapped F&B
pair, data parallelism); `simulation/` the priced schedule as it runs (the F&B stage, a step's anatomy); `answers/`
what users ask (`predict` and its report, `explain`, `honest`, `sensitivity`, `tune`, `charts`); `fitting/` specs
fitted to measurements (host micro-benchmarks, a spec fitted to a trace, the F&B model against runs).

`local/`: the emulation of this runtime on a CPU host (a runtime profile calibrated for one config, ranks
sharing the host's cores). It plugs into the core through pricing.pricer.ProfilePricing and
fitting.trace_fit.TraceFitter; the core never imports it. The `mhcpipe predict` and `mhcpipe tune` commands live
in the app layer (mhcpipe/).
"""
