"""mHC math: the pure-PyTorch reference, fused Triton kernels with the same signatures, and the layer modules
(mHC and its relatives in module.py, single-pass mHC in single_pass.py, xHC in xhc.py).

`import kernels` imports neither torch nor triton: the names below load their module on first use (PEP 562), so
`configs` (which needs only `config` and `residual_spec`) and the cost model's CLI stay torch-free; kernels.fused
(Triton) is loaded on first use by kernels.dispatch.

Modules: `residual_spec` (the variants and their spelling: the one home), `config` (MHCConfig), `reference`,
`sinkhorn`, `eager` and `sinkhorn_node` (the CPU path without Triton), `triton_project`, `triton_coeffs` and
`triton_apply` (the Triton kernels), `launch` (tiles, splits, precision), `fused`, `dispatch`, `parity`, `module`,
`single_pass`, `xhc`, `diagnostics`.
"""
from __future__ import annotations

import importlib

_NAMES = {"MHCConfig": "config", "MHCSublayer": "module", "StreamExpand": "module", "Coefficients": "module",
          "expand": "module", "contract": "module", "SinglePassSublayer": "single_pass", "XHCSublayer": "xhc"}
_MODULES = {"reference", "dispatch", "diagnostics", "single_pass", "xhc"}

__all__ = ["MHCConfig", "MHCSublayer", "StreamExpand", "Coefficients", "expand", "contract", "reference",
           "dispatch", "diagnostics", "single_pass", "xhc", "SinglePassSublayer", "XHCSublayer"]


def __getattr__(name: str):
    if name in _NAMES:
        value = getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
    elif name in _MODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value
