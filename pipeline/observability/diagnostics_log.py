"""Stream-collapse diagnostics collected during training (`--diagnostics-every K`), one JSON file per rank.

Shape letters: T tokens of one micro-batch, N streams (n for HC/mHC, 16 for xHC), C hidden.

What is logged (mhc.md §3, LSS arXiv 2606.03483; mHC §5.4): on step 0, on every K-th step and on the run's last
step, for the first micro-batch a stage sees in that step, every sub-layer's `kernels.diagnostics.layer_stats`
(per-stream RMS of the entering state, read/write shares, distance of H_res from the identity, single-layer
Amax gains, token-mean H_res) and, per stage, the per-token composite of the stage's residual path
P_stage[t] = H_res,last[t] @ ... @ H_res,first[t] (fp64, layers multiplied in the order they arrive, which is
depth order within a stage), closed by `stage_end` with its forward (max abs row sum) and backward (max abs
column sum) Amax gains, max and mean over tokens, plus the RMS of the state leaving the stage.

The runtime calls `wants_step(step)` to decide whether a step is logged at all, then per stage
`wants(step, mb, first_mb)` for the micro-batch, then `sublayer(...)` for each
sub-layer's forward and `stage_end(...)` with the stage's output; `final_step(last)` once the last step is known,
and `save(trace_dir)` at the end. A sub-layer seen twice for one (step, stage) — recompute re-runs the forward
of a stage's mHC kernels — is recorded once (the first call wins). Calls may come from the two threads of an
overlapped F&B pair, hence the lock.

File `diagnostics_rank{rank}.json`: {"schema": SCHEMA, "rank", "every", "final_step", "steps": [{"step",
"layers": [layer_stats + {"layer", "stage"}, sorted by layer], "stages": [{"stage", "first_layer", "last_layer",
"layers", "tokens", "gain_fwd_max", "gain_fwd_mean", "gain_bwd_max", "gain_bwd_mean", "exit"}]}]}; "exit" is
{"layer" (the next sub-layer index), "stream_rms", "imbalance"} or null if `stage_end` was not called.
`pipeline.observability.diagnose` reads and merges these files.
"""
from __future__ import annotations

import json
import threading
from pathlib import Path

import torch

from kernels.diagnostics import View, amax_gain, imbalance_ratio, layer_stats, stream_imbalance
from pipeline.observability.diagnose import FILE_PATTERN, SCHEMA


def diagnostics_path(trace_dir: Path, rank: int) -> Path:
    return Path(trace_dir) / FILE_PATTERN.format(rank=rank)


class _StageAcc:
    """The running per-token composite of one (step, stage) and the sub-layers it has seen."""

    def __init__(self) -> None:
        self.p: torch.Tensor | None = None  # [T, N, N] fp64
        self.layers: list[int] = []
        self.exit: dict | None = None
        self.closed: dict | None = None  # the gains, once stage_end ran

    def gains(self) -> dict:
        if self.p is None:
            return {"first_layer": None, "last_layer": None, "layers": 0, "tokens": 0, "gain_fwd_max": None,
                    "gain_fwd_mean": None, "gain_bwd_max": None, "gain_bwd_mean": None}
        g = amax_gain(self.p)
        return {"first_layer": self.layers[0], "last_layer": self.layers[-1], "layers": len(self.layers),
                "tokens": int(self.p.shape[0]),
                "gain_fwd_max": float(g.forward.max()), "gain_fwd_mean": float(g.forward.mean()),
                "gain_bwd_max": float(g.backward.max()), "gain_bwd_mean": float(g.backward.mean())}


class DiagnosticsLog:
    """Collects the diagnostics of one rank (see the module docstring)."""

    def __init__(self, every: int, rank: int):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"--diagnostics-every must be an integer >= 1 (log every K-th step), got {every!r}")
        self.every = every
        self.rank = int(rank)
        self._final: int | None = None
        self._layers: dict[int, dict[int, dict]] = {}  # step -> layer -> stats
        self._stages: dict[int, dict[int, _StageAcc]] = {}  # step -> stage -> accumulator
        self._lock = threading.Lock()

    def final_step(self, step: int) -> None:
        """Declare the run's last step, so that it is logged whatever `every` is."""
        self._final = int(step)

    def wants_step(self, step: int) -> bool:
        """True for a logged step: step 0, every `every`-th, and the one given to `final_step`."""
        return step % self.every == 0 or step == self._final

    def wants(self, step: int, mb: int, first_mb: int) -> bool:
        """True for the first micro-batch a stage sees in a logged step (step 0, every K-th, the final one)."""
        return mb == first_mb and self.wants_step(step)

    def sublayer(self, step: int, stage: int, layer: int, x: torch.Tensor, view: View) -> None:
        """Record sub-layer `layer` (global index) of `stage`: x [T, N, C] is the state entering it."""
        with torch.no_grad(), self._lock:
            seen = self._layers.setdefault(step, {})
            acc = self._stages.setdefault(step, {}).setdefault(stage, _StageAcc())
            if layer in seen:
                return  # a recompute re-running the forward: the first call wins
            if acc.closed is not None or (acc.layers and layer < acc.layers[-1]):
                raise ValueError(f"diagnostics: sub-layer {layer} of stage {stage} at step {step} arrived after "
                                 f"layer {acc.layers[-1] if acc.layers else '?'} or after stage_end; sub-layers "
                                 "of a stage must be logged in depth order before stage_end")
            stats = layer_stats(x, view)
            res = view.res.detach().to(torch.float64)
            if acc.p is not None and acc.p.shape != res.shape:
                raise ValueError(f"diagnostics: sub-layer {layer} of stage {stage} has H_res {tuple(res.shape)}, "
                                 f"earlier sub-layers of the stage {tuple(acc.p.shape)}: log one micro-batch "
                                 "per stage and step")
            acc.p = res.clone() if acc.p is None else res @ acc.p
            acc.layers.append(layer)
            seen[layer] = {"layer": int(layer), "stage": int(stage), **stats}

    def stage_end(self, step: int, stage: int, layer: int, x: torch.Tensor) -> None:
        """State x [T, N, C] leaving `stage` (depth `layer` = the next sub-layer index); closes its composite."""
        with torch.no_grad(), self._lock:
            acc = self._stages.setdefault(step, {}).setdefault(stage, _StageAcc())
            if acc.closed is not None:
                return  # a second call for the same (step, stage): keep the first
            st = stream_imbalance(x)
            acc.exit = {"layer": int(layer), "stream_rms": st.norms.tolist(), "imbalance": imbalance_ratio(st.norms)}
            acc.closed = acc.gains()
            acc.p = None  # the gains are all we keep; free the [T, N, N] buffer

    def record(self) -> dict:
        """Everything logged so far (stages not closed by stage_end get their composite so far, exit null)."""
        with self._lock:
            steps = []
            for step in sorted(set(self._layers) | set(self._stages)):
                layers = [self._layers.get(step, {})[k] for k in sorted(self._layers.get(step, {}))]
                stages = []
                for s, acc in sorted(self._stages.get(step, {}).items()):
                    stages.append({"stage": int(s), **(acc.closed if acc.closed is not None else acc.gains()),
                                   "exit": acc.exit})
                steps.append({"step": int(step), "layers": layers, "stages": stages})
            return {"schema": SCHEMA, "rank": self.rank, "every": self.every, "final_step": self._final,
                    "steps": steps}

    def save(self, trace_dir: Path) -> Path:
        path = diagnostics_path(trace_dir, self.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.record(), indent=1))
        return path
