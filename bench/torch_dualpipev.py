"""Speed peer and oracle: the project's model under PyTorch's own `torch.distributed.pipelining.ScheduleDualPipeV`.

    .venv/bin/python bench/torch_dualpipev.py [--config tiny] [--steps 30] [--warmup 3] [--launches 3] [--ranks R]
                                              [--out bench/results/torch_dualpipev.json]

`torch_dualpipev_worker(rank, world, cfg_dict, steps, want_grads)` (for `pipeline.launch.local.launch`) builds this
rank's two DualPipeV stages (r and 2P-1-r) from the project's builders and seeds, so every parameter equals the
single-process model's (`pipeline.single_process`), wraps them in `PipelineStage` and trains with `ScheduleDualPipeV`
on the same batches (`make_batch`), loss and AdamW (`make_optimizer`).

Loss and gradient scale: the last stage's module returns logits (`head.logits`) and the schedule's loss_fn is
`cross_entropy(logits.float(), labels, reduction="sum") / total_tokens`, i.e. `Head.forward`: each micro-batch's
loss is already its share of the step's token mean, so the schedule must not average again -> `scale_grads=False`
(torch 2.13 otherwise divides every grad by n_microbatches in REDUCE_GRAD). The step loss is the sum of the
per-micro-batch losses (`losses=` list of `step`).

Shapes: every stage gets explicit example `input_args`/`output_args` (static metadata, no shape-inference
forward/backward). Non-first inputs and non-last outputs must have requires_grad=True in the examples: in static
mode the receive buffers take requires_grad from them, and with False no input-grad would flow back.

Caveat of torch's I/W split (BACKWARD_INPUT then BACKWARD_WEIGHT, used by part of DualPipeV's cool-down): the
project's layers are custom autograd Functions (DeferLinear, RMSNorm, mHC kernels) whose backward returns dX and
dW together. torch's I pass runs each such node in full (dW discarded) and its W pass re-runs the node from the
saved grad_outputs, so those micro-batches pay the node's whole backward twice (tiny, P=4: 80-88 linear backward
calls per rank and step for 64-72 forwards). Gradients stay exact; torch's step time carries that extra work.

Timing (as `pipeline.runtime.train.RankRuntime.step`): zero_grad; t0; schedule.step; loss all-reduce; AdamW step; t1;
then max over ranks of t1 - t0, outside the timed region. The CLI (`ab_worker`) runs torch's schedule and the
project's runtime (`RankRuntime`, recording off) in one process group, one step of each in turn with the order
reversed every step, so both see the same machine state, under the same garbage-collection policy
(`pipeline.runtime.train.manual_gc`); for n = 1 (residual) and n = 4 (mHC) it reports the median step times, the median
of ours / torch per step pair (and its quartiles) and whether the losses agree (1e-5 relative, fp32). It also
reports each framework's CPU time per step (process time of every thread, gloo's included, summed over the
ranks): with more ranks than cores the step is bound by it, so it says how much work each one does.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from configs import load_config, parse_config, stage_blocks
from pipeline.data import make_batch
from pipeline.launch.local import launch
from pipeline.model import activation_dtype, build_block, build_embedding, build_head, make_optimizer
from pipeline.runtime.gc_control import manual_gc

LOSS_TOL = 1e-5


class StageModule(nn.Module):
    """One DualPipeV stage: [embedding] -> its blocks -> [head logits]. Attribute names (embed, blocks.<b>, head)
    are the single-process model's, so `named_parameters` match `pipeline.single_process.SingleProcessModel`."""

    def __init__(self, cfg, stage: int, num_stages: int):
        super().__init__()
        mc, seed = cfg.model, cfg.train.seed
        self.embed = build_embedding(mc, seed, activation_dtype(cfg.train.dtype)) if stage == 0 else None
        self.blocks = nn.ModuleDict({str(b): build_block(mc, cfg.parallel.seq_len, b, seed)  # store=None: full bwd
                                     for b in stage_blocks(mc.num_blocks, num_stages)[stage]})
        self.head = build_head(mc, seed) if stage == num_stages - 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)  # ids [T] -> [T, n, C]
        for block in self.blocks.values():
            x = block.mlp(block.attn(x))
        return self.head.logits(x) if self.head is not None else x  # [T, V] or [T, n, C]


def _examples(cfg, stage: int, num_stages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Example (input, output) of a stage for static PipelineStage metadata (shape, stride, dtype, requires_grad)."""
    t, n, c = cfg.parallel.tokens_per_microbatch, cfg.model.residual.n, cfg.model.hidden
    dt = activation_dtype(cfg.train.dtype)
    x = torch.empty(t, n, c, dtype=dt, requires_grad=True)
    inp = torch.empty(t, dtype=torch.int64) if stage == 0 else x
    out = torch.empty(t, cfg.model.vocab_size, dtype=dt, requires_grad=True) if stage == num_stages - 1 else x
    return inp, out


class TorchPeer:
    """This rank's half of the model under torch's ScheduleDualPipeV, stepped one optimizer step at a time."""

    def __init__(self, cfg, rank: int, world: int, group):
        from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV

        if cfg.parallel.ranks != world or cfg.parallel.data_parallel != 1:
            raise ValueError(f"one pipeline of parallel.ranks={cfg.parallel.ranks} ranks (no data parallelism) "
                             f"expected, but {world} ranks were launched")
        self.cfg, self.rank = cfg, rank
        num_stages, m = 2 * world, cfg.parallel.microbatches
        total_tokens = cfg.parallel.tokens_per_microbatch * m
        device = torch.device("cpu")
        local = (rank, num_stages - 1 - rank)  # V placement: the same as generate_stage_to_rank_mapping(style="v")
        modules = [StageModule(cfg, s, num_stages) for s in local]
        if activation_dtype(cfg.train.dtype) == torch.float64:  # fp64 runs keep fp64 parameters too
            modules = [mod.double() for mod in modules]
        stages = []
        for s, mod in zip(local, modules):
            inp, out = _examples(cfg, s, num_stages)
            stages.append(PipelineStage(mod, s, num_stages, device, input_args=inp, output_args=out, group=group))

        def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # = Head.forward
            acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
            return torch.nn.functional.cross_entropy(logits.to(acc), labels, reduction="sum") / total_tokens

        self.schedule = ScheduleDualPipeV(stages, n_microbatches=m, loss_fn=loss_fn, scale_grads=False)
        self.params = {k: p for mod in modules for k, p in mod.named_parameters()}
        self.optimizer = make_optimizer(self.params.values(), cfg.train)

    def step(self, step: int, want_grads: bool = False) -> dict:
        """One step, timed as pipeline.runtime.train.RankRuntime.step: zero_grad; t0; schedule, loss all-reduce, AdamW;
        t1; max over ranks outside the timed region."""
        import torch.distributed as dist

        batch = make_batch(self.cfg, step)
        self.optimizer.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = torch.zeros((), dtype=torch.float64)
        if self.rank == 0:  # holds stage 0 (inputs) and stage 2P-1 (targets, losses)
            mb_losses: list[torch.Tensor] = []
            self.schedule.step(batch.inputs.reshape(-1), target=batch.labels.reshape(-1), losses=mb_losses,
                               return_outputs=False)
            loss = torch.stack([x.detach() for x in mb_losses]).double().sum()
        else:
            self.schedule.step(return_outputs=False)
        dist.all_reduce(loss)
        grads = None
        if want_grads:  # before the optimizer step (tests, not timing)
            grads = {k: p.grad.detach().clone() for k, p in self.params.items() if p.grad is not None}
        self.optimizer.step()
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return {"step": step, "loss": float(loss), "step_time_s": float(elapsed), "grads": grads}


def torch_dualpipev_worker(rank: int, world: int, cfg_dict: dict, steps: int, want_grads: bool = False) -> dict:
    """Train `steps` steps with torch's ScheduleDualPipeV; returns {"stats": [{"loss", "step_time_s"}], "grads"}."""
    import torch.distributed as dist

    cfg = parse_config(cfg_dict)
    peer = TorchPeer(cfg, rank, world, dist.group.WORLD)
    dist.barrier()
    hist, grads = [], None
    with manual_gc(cfg.train.gc_interval) as collect:  # the GC policy the project's runtime runs under
        for step in range(steps):
            st = peer.step(step, want_grads and step == 0)
            grads = st.pop("grads") if step == 0 else grads
            st.pop("grads", None)
            hist.append(st)
            collect(step)
    return {"stats": hist, "grads": grads}


def ab_worker(rank: int, world: int, cfg_dict: dict, steps: int) -> dict:
    """torch's ScheduleDualPipeV and the project's runtime in one process group, one step of each in turn (order
    reversed every step), so both see the same machine state; the same model, data, loss and optimizer."""
    import torch.distributed as dist

    from pipeline.runtime.train import RankRuntime, make_groups

    cfg = parse_config(cfg_dict)
    peer = TorchPeer(cfg, rank, world, dist.group.WORLD)
    ours = RankRuntime(cfg, rank, torch.device("cpu"), groups=make_groups(cfg, rank, world, torch.device("cpu")),
                       record=False)
    hist: dict[str, list[dict]] = {"torch": [], "ours": []}
    with manual_gc(cfg.train.gc_interval) as collect:
        ours.align_clocks()
        for k in range(steps):
            for kind in (("torch", "ours") if k % 2 == 0 else ("ours", "torch")):
                cpu0 = time.process_time()
                if kind == "torch":
                    st = peer.step(k)
                    row = {"loss": st["loss"], "step_time_s": st["step_time_s"]}
                else:
                    st = ours.step(k)
                    row = {"loss": st.loss, "step_time_s": st.step_time_s}
                # CPU time of the whole step (every thread: gloo's included), summed over the ranks
                cpu = torch.tensor([time.process_time() - cpu0], dtype=torch.float64)
                dist.all_reduce(cpu)
                hist[kind].append({**row, "cpu_s": float(cpu)})
            collect(k)
    return hist


# ------------------------------------------------------------------------------------------------ benchmark
def _variant(base: dict, n: int, steps: int) -> dict:
    cfg = json.loads(json.dumps(base))
    cfg["model"]["residual"] = {"variant": "mhc" if n > 1 else "residual", "n": n}
    cfg["parallel"]["schedule"] = "dualpipev"
    cfg["train"]["steps"] = steps
    return cfg


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--steps", type=int, default=30, help="steps of each per launch (the first --warmup not timed)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--launches", type=int, default=3, help="launches per n (each alternates the two step by step)")
    ap.add_argument("--ranks", type=int, default=None,
                    help="pipeline ranks (default: the config's); e.g. 2 to give each rank a core of a 2-core host")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "torch_dualpipev.json")
    args = ap.parse_args(argv)
    if args.steps <= args.warmup:
        ap.error("--steps must exceed --warmup")
    base = load_config(args.config).model_dump()
    if args.ranks is not None:
        if args.ranks < 1:
            ap.error(f"--ranks {args.ranks}: pass at least 1")
        if base["model"]["num_blocks"] % (2 * args.ranks):
            ap.error(f"--ranks {args.ranks}: DualPipeV needs 2 x ranks stages that split the config's "
                     f"{base['model']['num_blocks']} blocks evenly")
        base["parallel"]["ranks"] = args.ranks
    rows = []
    for n in (1, 4):
        cfg = _variant(base, n, args.steps)
        launches = []
        for k in range(args.launches):
            res = launch(ab_worker, base["parallel"]["ranks"], (cfg, args.steps), timeout_s=1800)
            bad = [(r.rank, r.exitcode, r.error) for r in res if r.exitcode != 0 or r.error]
            if bad:
                raise RuntimeError(f"launch failed: {bad}")
            launches.append(res[0].value)
            med = {kind: statistics.median(s["step_time_s"] for s in res[0].value[kind][args.warmup:])
                   for kind in ("torch", "ours")}
            print(f"n={n} launch {k}: torch {med['torch'] * 1e3:.1f} ms, ours {med['ours'] * 1e3:.1f} ms, "
                  f"ratio {med['ours'] / med['torch']:.3f}", flush=True)
        timed = {kind: [s["step_time_s"] for h in launches for s in h[kind][args.warmup:]]
                 for kind in ("torch", "ours")}
        # per step pair: ours / torch of the same step index (they ran back to back)
        pairs = [o["step_time_s"] / t["step_time_s"] for h in launches
                 for t, o in zip(h["torch"][args.warmup:], h["ours"][args.warmup:])]
        t_torch, t_ours = statistics.median(timed["torch"]), statistics.median(timed["ours"])
        cpu = {kind: statistics.median(s["cpu_s"] for h in launches for s in h[kind][args.warmup:])
               for kind in ("torch", "ours")}
        losses = {kind: [s["loss"] for s in launches[0][kind]] for kind in ("torch", "ours")}
        err = max(abs(a - b) / abs(b) for a, b in zip(losses["torch"], losses["ours"]))
        q = statistics.quantiles(pairs, n=4)
        rows.append({"n": n, "variant": cfg["model"]["residual"]["variant"], "torch_step_s": t_torch,
                     "ours_step_s": t_ours, "ratio_ours_over_torch": t_ours / t_torch,
                     "pair_ratio_median": statistics.median(pairs), "pair_ratio_quartiles": [q[0], q[2]],
                     "torch_cpu_s": cpu["torch"], "ours_cpu_s": cpu["ours"], "cpu_ratio": cpu["ours"] / cpu["torch"],
                     "timed_steps": len(pairs), "launches": launches,
                     "loss_max_rel_err": err, "losses_equal": err <= LOSS_TOL})
    print(f"\n{'n':>2} {'torch ms':>9} {'ours ms':>9} {'ours/torch':>11} {'pair ratio (IQR)':>20} "
          f"{'CPU ms torch/ours':>18} {'CPU ratio':>10} {'loss rel err':>13}")
    for r in rows:
        iqr = f"{r['pair_ratio_median']:.3f} ({r['pair_ratio_quartiles'][0]:.2f}-{r['pair_ratio_quartiles'][1]:.2f})"
        cpu = f"{r['torch_cpu_s'] * 1e3:.0f}/{r['ours_cpu_s'] * 1e3:.0f}"
        print(f"{r['n']:>2} {r['torch_step_s'] * 1e3:>9.1f} {r['ours_step_s'] * 1e3:>9.1f} "
              f"{r['ratio_ours_over_torch']:>11.3f} {iqr:>20} {cpu:>18} {r['cpu_ratio']:>10.3f} "
              f"{r['loss_max_rel_err']:>13.2e}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    par = base["parallel"]
    args.out.write_text(json.dumps({
        "config": args.config, "schedule": "dualpipev", "ranks": par["ranks"], "microbatches": par["microbatches"],
        "tokens_per_step": par["microbatch_size"] * par["seq_len"] * par["microbatches"],
        "steps": args.steps, "warmup": args.warmup, "launches": args.launches, "loss_tol": LOSS_TOL,
        "step_time": "slowest rank's step; both frameworks in one job, one step of each in turn; medians over the "
                     "timed steps of every launch, and the median of ours/torch per step pair",
        "cpu": "CPU time of a step (process time, every thread) summed over the ranks, median over the timed steps",
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "cpus": os.cpu_count()},
        "results": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0 if all(r["losses_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
