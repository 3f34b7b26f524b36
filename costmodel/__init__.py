"""Analytic cost model: hardware specs, per-op pricing and `predict()` (see ../shared/docs/costmodel.md)."""
