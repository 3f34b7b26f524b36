"""Read, merge, summarise and draw the stream-collapse diagnostics of training runs (`mhcpipe diagnose`).

Shape letters: N streams, L sub-layers (depth).

Input: the `diagnostics_rank*.json` files `pipeline.observability.diagnostics_log.DiagnosticsLog` writes into a run's
trace dir (one variant, e.g. runs/x/mhc_4/), or a parent dir holding several such variant dirs. Per run and logged step:

- Ranks are merged per sub-layer: each rank logs the layers of the stages it holds. A layer recorded twice
  (DualPipe holds two copies of a stage, on two ranks, fed different micro-batches) is taken once, from the
  lowest rank; likewise a stage's composite.
- Depth profile of the stream RMS imbalance: the state entering each sub-layer, plus the state leaving the last
  stage (its `exit`, at depth L).
- Model composite over depth: P_l = M_l @ ... @ M_0 with M_l the token-mean H_res of sub-layer l (`res_mean`),
  in fp64, and its forward (max abs row sum) / backward (max abs column sum) Amax gains after each layer (mHC §5.4,
  Fig. 7). It is the composite of the means, not the mean of the per-token composites: the per-token ones exist
  only within a stage (the stage composites, as recorded), because each stage logs its own micro-batch.
- Layers missing from the indices 0..max (a rank's file absent) are listed; the model composite then skips them.

`summary(run)` condenses the first and last logged step to the numbers that show collapse (see `_step_summary`);
`draw(runs, path)` writes one PNG: imbalance, composite gain and max read/write share over depth at the last
logged step, and imbalance / composite gain over the logged steps.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# The file format pipeline.observability.diagnostics_log writes (the runtime imports these; traces never imports the
# runtime).
SCHEMA = "mhcpipe.diagnostics/1"
FILE_PATTERN = "diagnostics_rank{rank}.json"
HINT = "was the run started with --diagnostics-every K?"
_FILE_RE = re.compile(r"^diagnostics_rank(\d+)\.json$")


@dataclass
class StepDiag:
    """One logged step of one run, ranks merged."""

    step: int
    layers: list[dict]  # layer_stats + layer, stage; sorted by layer, one per layer
    stages: list[dict]  # stage composites as recorded, sorted by stage
    missing_layers: list[int]
    depth_imbalance: list[tuple[int, float]]  # (depth, imbalance of the state entering that sub-layer / leaving)
    gain_fwd: list[float]  # model composite after each layer in `layers`
    gain_bwd: list[float]


@dataclass
class Run:
    label: str
    path: Path
    ranks: list[int]
    streams: int
    steps: list[StepDiag] = field(default_factory=list)  # sorted by step


def _rank_files(d: Path) -> list[tuple[int, Path]]:
    out = [(int(m.group(1)), p) for p in d.iterdir() if p.is_file() and (m := _FILE_RE.match(p.name))]
    return sorted(out)


def run_dirs_of(path: Path) -> list[Path]:
    """`path` itself if it holds diagnostics files, else its children (sorted) that do."""
    if not path.exists():
        raise ValueError(f"RUN_DIR {path} does not exist")
    if not path.is_dir():
        raise ValueError(f"RUN_DIR {path} is not a directory (pass the run's trace dir)")
    if _rank_files(path):
        return [path]
    kids = [c for c in sorted(path.iterdir()) if c.is_dir() and _rank_files(c)]
    if not kids:
        raise ValueError(f"RUN_DIR {path} has no diagnostics_rank*.json (nor has any dir in it): {HINT}")
    return kids


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not readable as JSON ({str(err).splitlines()[0]})") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        got = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{path}: schema {got!r}, expected {SCHEMA!r} (a file written by DiagnosticsLog)")
    if not isinstance(data.get("steps"), list):
        raise ValueError(f"{path}: field 'steps' must be a list")
    return data


def _merge_run(label: str, d: Path) -> Run:
    layers: dict[int, dict[int, dict]] = {}  # step -> layer -> stats (lowest rank first)
    stages: dict[int, dict[int, dict]] = {}
    ranks = []
    for rank, f in _rank_files(d):
        data = _read(f)
        ranks.append(rank)
        try:
            for st in data["steps"]:
                step = int(st["step"])
                for lay in st["layers"]:
                    layers.setdefault(step, {}).setdefault(int(lay["layer"]), lay)
                for sg in st["stages"]:
                    have = stages.setdefault(step, {})
                    s = int(sg["stage"])
                    # Take one copy; prefer a closed one (with its exit) over one whose stage_end never ran.
                    if s not in have or (have[s].get("exit") is None and sg.get("exit") is not None):
                        have[s] = sg
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{f}: malformed diagnostics entry ({type(err).__name__}: {err})") from None
    streams = {len(lay["stream_rms"]) for per in layers.values() for lay in per.values()}
    if len(streams) > 1:
        raise ValueError(f"{d}: sub-layers with different stream counts {sorted(streams)}; one variant per run dir")
    run = Run(label=label, path=d, ranks=ranks, streams=streams.pop() if streams else 0)
    for step in sorted(set(layers) | set(stages)):
        run.steps.append(_step(step, layers.get(step, {}), stages.get(step, {})))
    return run


def _step(step: int, by_layer: dict[int, dict], by_stage: dict[int, dict]) -> StepDiag:
    ls = [by_layer[k] for k in sorted(by_layer)]
    sg = [by_stage[k] for k in sorted(by_stage)]
    top = max([*by_layer, *(s["exit"]["layer"] - 1 for s in sg if s.get("exit"))], default=-1)
    missing = sorted(set(range(top + 1)) - set(by_layer))
    depth = {lay["layer"]: float(lay["imbalance"]) for lay in ls}
    for s in sg:  # the state leaving a stage, where no sub-layer reports it (the stack output)
        if s.get("exit") is not None:
            depth.setdefault(int(s["exit"]["layer"]), float(s["exit"]["imbalance"]))
    fwd, bwd = [], []
    if ls:
        p = np.eye(len(ls[0]["res_mean"]), dtype=np.float64)
        for lay in ls:
            p = np.asarray(lay["res_mean"], dtype=np.float64) @ p
            a = np.abs(p)  # Amax gains as in kernels.diagnostics.amax_gain: max abs row / column sum
            fwd.append(float(a.sum(axis=1).max()))
            bwd.append(float(a.sum(axis=0).max()))
    return StepDiag(step=step, layers=ls, stages=sg, missing_layers=missing,
                    depth_imbalance=sorted(depth.items()), gain_fwd=fwd, gain_bwd=bwd)


def load(run_dirs: list[str | Path], labels: list[str] | None = None) -> list[Run]:
    """Runs of `run_dirs` (variant dirs, or parents of variant dirs), labelled by dir name or by `labels`."""
    dirs = [d for p in run_dirs for d in run_dirs_of(Path(p))]
    if labels:
        if len(labels) != len(dirs):
            raise ValueError(f"--label given {len(labels)} times for {len(dirs)} runs "
                             f"({', '.join(d.name for d in dirs)}); give one per run or none")
        names = list(labels)
    else:
        names = [d.name for d in dirs]
    runs = [_merge_run(n, d) for n, d in zip(names, dirs)]
    for r in runs:
        if not r.steps:
            raise ValueError(f"{r.path}: diagnostics files hold no logged step ({HINT})")
    return runs


def _step_summary(sd: StepDiag) -> dict:
    ls = sd.layers
    deep = ls[len(ls) // 2:]  # the deepest half (the middle layer goes with it when L is odd)
    stage_f = [s["gain_fwd_max"] for s in sd.stages if s.get("gain_fwd_max") is not None]
    stage_b = [s["gain_bwd_max"] for s in sd.stages if s.get("gain_bwd_max") is not None]

    def ext(key: str, f) -> float:
        return f(v for lay in ls for v in lay[key]) if ls else math.nan

    return {
        "step": sd.step,
        "imbalance_max": max((v for _, v in sd.depth_imbalance), default=math.nan),
        "imbalance_out": sd.depth_imbalance[-1][1] if sd.depth_imbalance else math.nan,  # deepest recorded state
        "read_share_max": ext("read_share", max), "read_share_min": ext("read_share", min),
        "write_share_max": ext("write_share", max), "write_share_min": ext("write_share", min),
        "res_identity_dist_deep": sum(lay["res_identity_dist"] for lay in deep) / len(deep) if deep else math.nan,
        "gain_fwd": sd.gain_fwd[-1] if sd.gain_fwd else math.nan,
        "gain_bwd": sd.gain_bwd[-1] if sd.gain_bwd else math.nan,
        "stage_gain_fwd_max": max(stage_f, default=math.nan),
        "stage_gain_bwd_max": max(stage_b, default=math.nan),
    }


def summary(run: Run) -> dict:
    """The collapse numbers at the last logged step ("last") and at the first ("first"), for a trend."""
    last = run.steps[-1]
    return {"label": run.label, "path": str(run.path), "ranks": run.ranks, "streams": run.streams,
            "layers": len(last.layers), "steps_logged": [s.step for s in run.steps],
            "missing_layers": last.missing_layers,
            "first": _step_summary(run.steps[0]), "last": _step_summary(last)}


def draw(runs: list[Run], path: str | Path) -> Path:
    """One PNG, four panels; each run one colour (see the module docstring). Returns the path written."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    from traces.drawing.png import plt, save_png  # matplotlib (Agg) only when a picture is asked for

    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    (a_imb, a_gain), (a_share, a_step) = axes
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(runs):
        c = colours[i % len(colours)]
        sd = run.steps[-1]
        depth = [d for d, _ in sd.depth_imbalance]
        a_imb.plot(depth, [v for _, v in sd.depth_imbalance], "-o", ms=3, color=c, label=run.label)
        after = [lay["layer"] + 1 for lay in sd.layers]  # the composite after layer l describes depth l + 1
        a_gain.plot(after, sd.gain_fwd, "-", color=c, label=f"{run.label} fwd")
        a_gain.plot(after, sd.gain_bwd, "--", color=c, label=f"{run.label} bwd")
        ends = [(s["last_layer"] + 1, s["gain_bwd_max"]) for s in sd.stages if s.get("gain_bwd_max") is not None]
        if ends:
            a_gain.plot(*zip(*ends), "x", color=c, ms=7, label=f"{run.label} stage bwd")
        at = [lay["layer"] for lay in sd.layers]
        # read and write often coincide (at 1/N for uniform streams): write wide and hollow-marked underneath,
        # read thin and dotted-marked on top, so both stay visible
        a_share.plot(at, [max(lay["write_share"]) for lay in sd.layers], "--", color=c, lw=2.4, alpha=0.45,
                     marker="s", ms=6, mfc="none", zorder=2, label=f"{run.label} write")
        a_share.plot(at, [max(lay["read_share"]) for lay in sd.layers], "-", color=c, lw=1.0, marker="o", ms=2.5,
                     zorder=3, label=f"{run.label} read")
        if run.streams:
            a_share.axhline(1.0 / run.streams, color=c, lw=0.8, ls=":")
        steps = [s.step for s in run.steps]
        a_step.plot(steps, [max((v for _, v in s.depth_imbalance), default=math.nan) for s in run.steps], "-o",
                    ms=3, color=c, label=f"{run.label} max imbalance")
        a_step.plot(steps, [s.gain_bwd[-1] if s.gain_bwd else math.nan for s in run.steps], "--s", ms=3, color=c,
                    label=f"{run.label} composite bwd gain")
    last = ", ".join(f"{r.label}: step {r.steps[-1].step}" for r in runs)
    fig.suptitle(f"stream-collapse diagnostics; depth panels at the last logged step ({last})", fontsize=10)
    a_imb.set(title="stream RMS imbalance (max/min) over depth", xlabel="depth (sub-layer entered)",
              ylabel="max / min stream RMS", yscale="log")
    a_gain.set(title="composite Amax gain of token-mean H_res\n(fwd solid, bwd dashed; x: stage composite, token max)",
               xlabel="depth (after sub-layer)", ylabel="gain", yscale="log")
    a_share.set(title="largest share of one stream\nread (thin, dots), write (wide, squares); dotted: uniform 1/N",
                xlabel="sub-layer", ylabel="share", ylim=(0, 1.05))
    a_step.set(title="over logged steps\nmax imbalance (solid), model composite bwd gain (dashed)", xlabel="step",
               ylabel="value", yscale="log")
    plain = FuncFormatter(lambda v, _: f"{v:g}")  # 1.05, not 1.05 x 10^0: gains and ratios sit near 1
    for ax in (a_imb, a_gain, a_step):
        ax.yaxis.set_major_formatter(plain)
        lo, hi = ax.get_ylim()
        # Within a decade only minor ticks carry labels; over 2-3 decades label 2 and 5 x 10^k; beyond, none.
        keep = (lambda v: True) if hi < 10 * lo else (lambda v: round(v / 10 ** math.floor(math.log10(v))) in (2, 5))
        many = hi >= 1000 * lo
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _, k=keep, m=many: "" if m or not k(v) else f"{v:g}"))
    a_step.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in axes.flat:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    return save_png(fig, path)
