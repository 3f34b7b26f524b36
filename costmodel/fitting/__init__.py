"""Fitting specs to measurements: host micro-benchmarks (`calibrate`), a spec fitted to a measured trace (`trace_fit`,
the one entry point; `roofline_fit`, the roofline fitter), the F&B model checked against runs (`measured_pair`).

May import: the rooms of costmodel listed in costmodel/__init__.py before it (never costmodel.local).
"""
