"""`local` emulation of this runtime on a CPU host: the calibration of a runtime profile for one config
(calibration.py, runtime_fit.py, core_sharing.py) and the pricing from it on ranks sharing the host's cores
(host_pricing.py, shared_cores.py). It plugs into the analytic core through two interfaces the core defines
and never imports this package for: costmodel.pricing.pricer.ProfilePricing (HostPricing) and
costmodel.fitting.trace_fit.TraceFitter (RuntimeProfileFit)."""
