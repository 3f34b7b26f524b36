"""mHC math: the pure-PyTorch reference, fused Triton kernels with the same signatures, and the layer module.

`import kernels` never imports triton: kernels.fused (Triton) is loaded on first use by kernels.dispatch.
"""
from . import diagnostics, dispatch, reference
from .config import MHCConfig
from .module import Coefficients, MHCSublayer, StreamExpand, contract, expand

__all__ = ["MHCConfig", "MHCSublayer", "StreamExpand", "Coefficients", "expand", "contract", "reference",
           "dispatch", "diagnostics"]
