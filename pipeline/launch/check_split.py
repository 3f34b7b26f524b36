"""check-split: a user's model split into pipeline stages must compute what the unsplit model computes.

For every schedule and pp x dp layout asked, one step of the model runs on CPU ranks (gloo, float64) through the
real runtime, every stage reporting what crosses its boundaries (pipeline.runtime.user_stage: the state it
received and sent, its loss, the gradients it received and sent) and every parameter's gradient; the unsplit
model (pipeline.user_reference) runs the same batch micro-batch by micro-batch in this process. The first
difference, in the order data flows (forward boundaries by block, the losses, backward boundaries from the last
block down, then the parameters in model order), is named with its stage, rank, blocks and micro-batch; or the
case is `ok` with the worst relative error (Frobenius norm of the difference / the unsplit tensor's) of all
compared tensors.

Tolerance: relative 1e-9 by default. The unsplit model runs the same kernels on the same micro-batch shapes with
one thread, as every rank does, so a correct split differs only where sums run in another order (gradients
accumulated over micro-batches, DualPipe's copies all-reduced): ~1e-16..1e-15 measured on the examples, also where
a library computes parts in float32 whatever the input (hyper-connections' width connection). A boundary bug
differs by more, often by O(1), but not always: streams expanded again on a later stage change its input by only
~4e-8 at initialisation (the copies are still nearly equal) and some gradients by O(1).

`dtype` 'bfloat16' (the user model's bf16 run: pipeline.user_model.amp) compares with the unsplit model in bf16:
the same bf16 kernels on the same micro-batches, so only the fp32 gradient sums differ in order (8.6e-7 measured
on the plain Transformer example); default rtol 1e-3 (BF16_RTOL) leaves room for another CPU's kernels, well under
what a boundary bug in bf16 changes. `recompute` 'auto' reruns each stage's blocks in its backward
(pipeline.runtime.user_stage.recompute_units): the same numbers as without.

All cases of one world size run in one launch (`launcher`: pipeline.launch.local.launch, or the tests' rank pool);
`worker` is what each rank runs (tests wrap `split_worker` to inject a bug into a rank and watch the check fail).
"""
from __future__ import annotations

from pathlib import Path

from dataclasses import dataclass

import torch

from pipeline.user_model import ContractError

DEFAULT_RTOL = 1e-9
BF16_RTOL = 1e-3  # --dtype bfloat16: see the module docstring


class NoRunnableCase(ValueError):
    """No case of the request fits the model: check-split exits 2 with this one line."""


@dataclass
class CaseResult:
    schedule: str
    pp: int
    dp: int
    ok: bool
    message: str  # the first difference, or a rank's error
    worst: float  # worst relative error over every compared tensor (ok cases)
    loss: float | None = None
    skipped: bool = False  # the model cannot run this case (message: why); neither agreement nor failure

    def line(self) -> str:
        where = f"{self.schedule:<10} pp{self.pp} x dp{self.dp}"
        if self.skipped:
            return f"{where}  skipped: {self.message}"
        if self.ok:
            return f"{where}  ok    worst relative error {self.worst:.1e}  (loss {self.loss:.6f})"
        return f"{where}  FAIL  {self.message}"


def case_problem(cfg, model) -> str | None:
    """Why the model cannot run this case's layout (one short line), or None: each case is validated under its own
    schedule and layout, e.g. a 6-block model cannot fill DualPipeV's 2P = 8 stages on 4 ranks."""
    from pipeline.launch.user_config import user_config

    stages = cfg.parallel.num_stages
    if len(model.blocks) < stages:
        return f"{len(model.blocks)} blocks cannot fill {stages} stages"
    try:
        user_config(cfg, model)
    except ValueError as err:
        return str(err).split(": ", 1)[-1]
    return None


def case_config(base, schedule: str, pp: int, dp: int, rules: str = "nccl", p2p_timeout_s: float | None = None,
                emulate_cuda: bool = False, dtype: str = "float64", recompute: str = "off"):
    """The check's config of one case: `dtype` (float64 by default; bfloat16: the user model's bf16 run) on CPU,
    one step, the layout and schedule asked; P2P under NCCL's rules by default (the strict transport: a posting
    order NCCL would hang on or mismatch fails with every rank's queue heads), or `rules` 'backend' (plain gloo: a
    mismatched order then shows as wrong numbers); `emulate_cuda`: on the runtime's CUDA path under the emulated
    device (docs/cuda_program.md); `recompute`: 'off' or 'auto' (each stage's blocks recomputed as one unit)."""
    from configs import parse_config

    data = base.model_dump()
    data["parallel"].update(schedule=schedule, ranks=pp, data_parallel=dp, expert_parallel=1)
    data["train"].update(dtype=dtype, device="cpu", steps=1, comm_rules=rules, emulate_cuda=emulate_cuda)
    if p2p_timeout_s is not None:
        data["train"]["timeout_s"] = p2p_timeout_s
    data["recompute"] = {"mode": recompute}
    return parse_config(data, f"{schedule} pp{pp} x dp{dp}")


def split_worker(rank: int, world: int, spec: str, residual: str | None, cfg_dicts: list[dict],
                 program_dirs: list[str | None] | None = None) -> list[dict]:
    """One rank of every case: build the model, run one step with the boundary probe, return what it saw; an
    emulated-CUDA case writes its program into its folder of `program_dirs`."""
    from configs import parse_config
    from pipeline.launch.user_config import build_model, load_builder, user_config
    from pipeline.partition import global_microbatch
    from pipeline.runtime.train import RankRuntime, make_groups

    builder = load_builder(spec)
    out = []
    for i, d in enumerate(cfg_dicts):
        cfg = parse_config(d)
        model = build_model(builder, cfg.train.seed, residual, cfg.parallel.seq_len)
        cfg = user_config(cfg, model)
        seen: list[tuple[str, int, int, torch.Tensor]] = []
        groups = make_groups(cfg, rank, world, torch.device("cpu"))
        rt = RankRuntime(cfg, rank, torch.device("cpu"), groups=groups, record=False, model=model,
                         probe=lambda what, stage, mb, t: seen.append((what, stage, mb, _clone(t))))
        stats = rt.step(0)
        specs = {sp.stage: sp for sp in rt.plan.stages}
        records = [(what, stage, global_microbatch(rt.plan, specs[stage].pipeline, mb), t)
                   for what, stage, mb, t in seen]
        stages = {sp.stage: (sp.blocks.start, sp.blocks.stop - 1, sp.rank) for sp in rt.plan.stages}
        out.append({"records": records, "grads": rt.grads(), "stages": stages, "loss": stats.loss,
                    "rank": rank, "pp_rank": groups.pp_rank, "dp_rank": groups.dp_rank})
        rt.close(program_dir=Path(program_dirs[i]) if program_dirs and program_dirs[i] else None)
    return out


def _clone(t):
    return tuple(v.clone() for v in t) if type(t) is tuple else t.clone()


def _worst_part(got, want, names: list[str]) -> tuple[float, str]:
    """(the largest relative error over a state's parts, which part: '' for a single tensor)."""
    if type(want) is not tuple:
        return _rel(got, want), ""
    if type(got) is not tuple or len(got) != len(want):
        return float("inf"), f" (it has {len(got) if type(got) is tuple else 1} parts, the unsplit state {len(want)})"
    errs = [_rel(g, w) for g, w in zip(got, want)]
    k = max(range(len(errs)), key=errs.__getitem__)
    return errs[k], f" (part {names[k]!r})" if k < len(names) else f" (part {k})"


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.shape != want.shape:
        return float("inf")
    diff = torch.linalg.vector_norm((got.to(torch.float64) - want.to(torch.float64)).reshape(-1))
    scale = torch.linalg.vector_norm(want.to(torch.float64).reshape(-1))
    return float(diff / scale) if scale > 0 else float(diff)


def compare(ref, ranks: list[dict], num_blocks: int, rtol: float,
            part_names: list[str] | None = None) -> tuple[str | None, float]:
    """(the first difference as one line, or None; the worst relative error) of one case. `part_names`: the
    parts of a state of several tensors (UserModel.state_parts), which a difference names."""
    names = part_names or []
    stages: dict[int, tuple[int, int, int]] = {}
    for r in ranks:
        stages.update(r["stages"])
    dp_of = {r["rank"]: r["dp_rank"] for r in ranks}

    def where(stage: int, g: int, rank: int) -> str:
        first, last, _ = stages[stage]
        blocks = f"block {first}" if first == last else f"blocks {first}-{last}"
        rep = f", replica {dp_of[rank]}" if len(set(dp_of.values())) > 1 else ""
        return f"stage {stage} (rank {rank}{rep}, {blocks}) micro-batch {g}"

    checks = []  # (order key, description, got, want)
    for r in ranks:
        for what, stage, g, t in r["records"]:
            first, last, _ = stages[stage]
            here = where(stage, g, r["rank"])
            if what == "in":
                checks.append(((0, first - 1, 1, g), f"{here}: the state it received differs from the unsplit "
                               f"model's state after {_after(first - 1)}", t, ref.states[g, first - 1]))
            elif what == "out":
                checks.append(((0, last, 0, g), f"{here}: the state it sends differs from the unsplit model's "
                               f"state after block {last}", t, ref.states[g, last]))
            elif what == "loss":
                checks.append(((1, 0, 0, g), f"{here}: its loss differs from the unsplit model's", t, ref.losses[g]))
            elif what == "grad_in":
                checks.append(((2, -(first - 1), 0, g), f"{here}: the gradient it sends back differs from the "
                               f"unsplit model's gradient of the state after {_after(first - 1)}", t,
                               ref.state_grads[g, first - 1]))
            elif what == "grad_out":
                checks.append(((2, -last, 1, g), f"{here}: the gradient it received differs from the unsplit "
                               f"model's gradient of the state after block {last}", t, ref.state_grads[g, last]))
    losses = {g for r in ranks for what, _, g, _ in r["records"] if what == "loss"}
    missing = sorted(set(ref.losses) - losses)
    worst, first_bad = 0.0, None
    for _, text, got, want in sorted(checks, key=lambda c: c[0]):
        err, part = _worst_part(got, want, names)
        if err > rtol and first_bad is None:
            shape = "" if type(got) is tuple or got.shape == want.shape else \
                f" (shape {list(got.shape)}, unsplit {list(want.shape)})"
            first_bad = f"{text}{part} (relative error {err:.2e}){shape}"
        worst = max(worst, err)
    if first_bad is None and missing:
        first_bad = f"micro-batch {missing[0]} never reached the head (no loss on any rank)"
    for name in ref.order:
        holders = [r for r in ranks if name in r["grads"]]
        want = ref.grads.get(name)
        if want is None:
            continue
        if not holders:
            if first_bad is None:
                first_bad = f"parameter {name}: no rank holds a gradient for it"
            continue
        err = max(_rel(r["grads"][name], want) for r in holders)
        if err > rtol and first_bad is None:
            stage = _stage_of(name, stages, num_blocks)
            first_bad = f"parameter {name} ({stage}): its gradient differs from the unsplit model's " \
                        f"(relative error {err:.2e})"
        worst = max(worst, err)
    return first_bad, worst


def _after(b: int) -> str:
    return "the stream entry (embedding, expand)" if b < 0 else f"block {b}"


def _stage_of(name: str, stages: dict, num_blocks: int) -> str:
    if name.startswith("blocks."):
        b = int(name.split(".")[1])
    elif name.startswith("head."):
        b = num_blocks - 1
    else:
        b = 0
    held = sorted(s for s, (first, last, _) in stages.items() if first <= b <= last)
    return f"stage {' and '.join(map(str, held))}" if held else "no stage"


def run_cases(spec: str, base, cases: list[tuple[str, int, int]], *, residual: str | None = None,
              rtol: float = DEFAULT_RTOL, rules: str = "nccl", launcher=None, worker=split_worker,
              timeout_s: float = 600.0, p2p_timeout_s: float | None = None, log=None,
              emulate_cuda: bool = False, dtype: str = "float64", recompute: str = "off") -> list[CaseResult]:
    """Every (schedule, pp, dp) case against the unsplit model; one launch per world size. `timeout_s`: the
    launch's deadline; `p2p_timeout_s`: every wait inside a step (train.timeout_s; default the config's).
    `emulate_cuda`: each case also runs the CUDA path under the emulated device, and its programs are replayed
    under CUDA's and NCCL's rules (a case whose replay is not ok fails with the replay's first lines)."""
    import tempfile
    from pipeline.launch.user_config import build_model, load_builder, user_config
    from pipeline.user_reference import unsplit_run

    if launcher is None:
        from pipeline.launch.local import launch as launcher
    builder = load_builder(spec)
    cfgs = {case: case_config(base, *case, rules=rules, p2p_timeout_s=p2p_timeout_s, emulate_cuda=emulate_cuda,
                              dtype=dtype, recompute=recompute) for case in cases}
    scratch = tempfile.TemporaryDirectory(prefix="check-split-cuda-") if emulate_cuda else None
    dirs = {case: str(Path(scratch.name) / "-".join(map(str, case))) if scratch else None for case in cases}
    model = build_model(builder, base.train.seed, residual, base.parallel.seq_len)
    fits = [c for c in cases if case_problem(cfgs[c], model) is None]
    if not fits:
        why = "; ".join(f"{s} pp{pp} x dp{dp}: {case_problem(cfgs[(s, pp, dp)], model)}" for s, pp, dp in cases)
        raise NoRunnableCase(f"no case can run this model ({why})")
    ref_cfg = user_config(cfgs[fits[0]], model)
    model.chunks(max(1, min(pp for _, pp, _ in fits)))  # a split the model cannot take: one line, before launching
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every rank runs (pipeline.launch.local): the same kernels, the same sums
    try:
        model.dry_run(ref_cfg.parallel.seq_len)  # the contract, phases included, in one line
        ref = unsplit_run(model, ref_cfg)
    except ContractError:
        raise
    except Exception as err:  # noqa: BLE001 - the user's code: one line
        raise ValueError(f"the unsplit model failed: {type(err).__name__}: {err}") from None
    finally:
        torch.set_num_threads(threads)
    results: list[CaseResult] = []
    skipped = {case: why for case in cases if (why := case_problem(cfgs[case], model)) is not None}
    for (s, pp, dp), why in skipped.items():
        res = CaseResult(s, pp, dp, False, why, float("nan"), skipped=True)
        results.append(res)
        if log is not None:
            log(res.line())
    runnable = [c for c in cases if c not in skipped]
    for world in sorted({pp * dp for _, pp, dp in runnable}):
        group = [c for c in runnable if c[1] * c[2] == world]
        args = (spec, residual, [cfgs[c].model_dump() for c in group]) + ((
            [dirs[c] for c in group],) if emulate_cuda else ())
        got = launcher(worker, world, args, timeout_s=timeout_s)
        failed = [r for r in got if r.exitcode != 0 or r.error]
        if failed:
            r = failed[0]
            msg = r.error or f"rank {r.rank} exited with {r.exitcode} (killed at the deadline: {timeout_s:.0f} s)"
            results.extend(CaseResult(s, pp, dp, False, f"rank {r.rank}: {msg.splitlines()[0]}", float("nan"))
                           for s, pp, dp in group)
            continue
        for i, (s, pp, dp) in enumerate(group):
            ranks = [r.value[i] for r in got]
            bad, worst = compare(ref, ranks, len(model.blocks), rtol,
                                 [name for name, _, _ in model.state_parts(torch.float32)])
            if bad is None and emulate_cuda:
                bad = _cuda_replay(dirs[(s, pp, dp)])
            res = CaseResult(s, pp, dp, bad is None, bad or "", worst, ranks[0]["loss"])
            results.append(res)
            if log is not None:
                log(res.line())
    if scratch is not None:
        scratch.cleanup()
    return results


def _cuda_replay(folder: str) -> str | None:
    """None when the case's CUDA programs replay ok, else the replay's verdict in one line."""
    from traces.analysis.cuda_replay import replay_programs
    from traces.formats.cuda_program import load_programs

    res = replay_programs(load_programs(Path(folder)))
    if res.ok:
        return None
    first = (res.cycle or res.problems or [""])[0]
    return f"CUDA replay: {res.summary()}; {first}"
