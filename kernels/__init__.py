"""mHC math: the pure-PyTorch reference, fused Triton kernels with the same signatures, and the layer modules
(mHC and its relatives in module.py, single-pass mHC in single_pass.py, xHC in xhc.py).

`import kernels` never imports triton: kernels.fused (Triton) is loaded on first use by kernels.dispatch.

Modules: `residual_spec` (the variants and their spelling: the one home), `config` (MHCConfig), `reference`,
`sinkhorn`, `eager` and `sinkhorn_node` (the CPU path without Triton), `triton_project`, `triton_coeffs` and
`triton_apply` (the Triton kernels), `launch` (tiles, splits, precision), `fused`, `dispatch`, `parity`, `module`,
`single_pass`, `xhc`, `diagnostics`.
"""
from . import diagnostics, dispatch, reference
from .config import MHCConfig
from .module import Coefficients, MHCSublayer, StreamExpand, contract, expand
from . import single_pass, xhc
from .single_pass import SinglePassSublayer
from .xhc import XHCSublayer

__all__ = ["MHCConfig", "MHCSublayer", "StreamExpand", "Coefficients", "expand", "contract", "reference",
           "dispatch", "diagnostics", "single_pass", "xhc", "SinglePassSublayer", "XHCSublayer"]
