"""Cost model (see docs/costmodel.md), in two rooms.

The analytic core: hardware specs (hardware.py) and the runtime-profile data a `local` spec may carry
(runtime_profile.py); per-op work (ops.py, mhc_cost.py), communication (comm.py), overlap inside an action
(overlap.py), memory (memory.py); per-action pricing (pricing.py) and `predict()` (predict.py) with its report
(report.py); host micro-benchmarks (calibrate.py) and fitting a spec to a measured trace (trace_fit.py, the one
entry point; roofline_fit.py, the roofline fitter). The `mhcpipe predict` and `mhcpipe tune` commands live in the
app layer (mhcpipe/).

`local/`: the emulation of this runtime on a CPU host (a runtime profile calibrated for one config, ranks
sharing the host's cores). It plugs into the core through pricing.ProfilePricing and trace_fit.TraceFitter;
the core never imports it.

Also: `pricing_options` (the modelling switches), `fb_stage` (the overlapped F&B stage), `step_anatomy` (what a step
is made of), `data_parallel` (gradient sync and ranks on nodes), `explain` and `honest` (`predict --explain`),
`sensitivity` (`--sensitivity`), `charts` (their pictures), `measured_pair` (the F&B model checked against runs).
"""
