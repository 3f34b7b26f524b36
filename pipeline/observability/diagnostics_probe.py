"""What a rank hands the stream-collapse diagnostics (pipeline.observability.diagnostics_log) while a logged step runs.

Shape letters: T tokens of a micro-batch, N streams, C hidden.

`StepProbe` sits on `StageEnv.diagnostics` for one logged step. `pipeline.runtime.stage.Stage` calls `sublayer` with the
state entering each sub-layer and the coefficients the sub-layer just computed, and `stage_end` with the state
leaving the stage; the probe keeps the first micro-batch each local stage runs in that step (the collector's
rule) and turns the coefficients into the variant's view (read [T, N], write [T, N], res [T, N, N]):
mHC/HC/mHC-lite through `kernels.diagnostics.mhc_view`, xHC and single-pass mHC through their module's
`diagnostic_view` (single-pass reads with the carried coefficient of the previous sub-layer).
"""
from __future__ import annotations

import torch

from kernels import diagnostics


def module_view(module, coeffs, a=None):
    """The (read, write, res) view of one sub-layer's coefficients."""
    if module.config.variant == "mhc-sp":
        return module.diagnostic_view(coeffs, a)
    if module.config.variant == "xhc":
        return module.diagnostic_view(coeffs)
    return diagnostics.mhc_view(coeffs)


def first_microbatches(actions) -> dict[int, int]:
    """stage -> the first micro-batch whose forward this rank runs for it in a step (F or the F half of FB)."""
    first: dict[int, int] = {}
    for a in actions:
        if a.kind.value in ("F", "FB") and a.stage not in first:
            first[a.stage] = a.mb
    return first


class StepProbe:
    def __init__(self, log, step: int, first_mb: dict[int, int]):
        self.log, self.step, self.first_mb = log, step, first_mb

    def _wanted(self, stage: int, mb: int) -> bool:
        return self.log.wants(self.step, mb, self.first_mb.get(stage, mb))

    def sublayer(self, stage: int, mb: int, layer: int, module, x: torch.Tensor, coeffs, a=None) -> None:
        if not self._wanted(stage, mb):
            return
        with torch.no_grad():
            view = module_view(module, coeffs, a)
            self.log.sublayer(self.step, stage, layer, x.detach(), view)

    def stage_end(self, stage: int, mb: int, layer: int, x: torch.Tensor) -> None:
        if self._wanted(stage, mb):
            with torch.no_grad():
                self.log.stage_end(self.step, stage, layer, x.detach())
