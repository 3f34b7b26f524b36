"""How k concurrent ranks share this host's CPU cores: cores(k) for costmodel.shared_cores.

measure_core_sharing(cfg, k_max) spawns k_max single-thread processes that each build one Transformer block of
cfg's shape (the runtime's own code) and, for k = 1 .. k_max in turn, let k of them run forward + backward rounds
for `seconds` while the rest wait. cores(k) = the k processes' summed rounds per second / one process's rate
alone. On a dedicated host with c cores this is about min(k, c); on a shared VM it is what the VM gives, and it
can fall beyond c: k > c processes time-slicing c cores refill their caches after every switch.
"""
from __future__ import annotations

import multiprocessing as mp
import statistics
import time


def _worker(index: int, cfg_dict: dict, plan: list[int], seconds: float, start, results) -> None:
    import torch

    from pipeline.config import parse_config
    from pipeline.model import build_block
    from pipeline.weight_grad import WeightGradStore

    torch.set_num_threads(1)
    cfg = parse_config(cfg_dict).with_residual("residual", 1)
    T, C = cfg.parallel.tokens_per_microbatch, cfg.model.hidden
    block = build_block(cfg.model, cfg.parallel.seq_len, 0, cfg.train.seed, WeightGradStore())
    x = torch.randn(T, 1, C)
    g = torch.randn(T, 1, C)

    def one_round() -> None:
        y = x.detach().requires_grad_(True)
        for _, sub in block.sublayers():
            y = sub(y)
        torch.autograd.backward(y, g)
        block.zero_grad(set_to_none=True)

    for _ in range(3):
        one_round()
    for phase, k in enumerate(plan):
        start.wait()
        if index < k:
            rounds, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                one_round()
                rounds += 1
            results.put((phase, index, rounds / (time.perf_counter() - t0)))
        start.wait()


def measure_core_sharing(cfg, k_max: int, seconds: float = 0.6, cycles: int = 3,
                         timeout_s: float = 120.0) -> list[float]:
    """[cores(1), ..., cores(k_max)] for cfg's block on this host (see the module docstring). The sweep
    k = 1 .. k_max runs `cycles` times, each closed by a solo phase; a cycle's cores(k) is its rate at k over the
    mean of the solo rates at both of its ends, and the result is the median over cycles (shared VMs drift and
    stall, so single phases are noisy)."""
    if k_max < 1 or cycles < 1:
        raise ValueError(f"k_max and cycles must be >= 1, got k_max={k_max}, cycles={cycles}")
    sweep = list(range(1, k_max + 1))
    plan = [1] + sweep * cycles + [1]  # the first phase only warms the machine up
    ctx = mp.get_context("spawn")
    start = ctx.Barrier(k_max, timeout=timeout_s)
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(i, cfg.model_dump(), plan, seconds, start, results), daemon=True)
             for i in range(k_max)]
    for p in procs:
        p.start()
    rates: dict[int, float] = {}
    try:
        for _ in range(sum(plan)):
            phase, _, r = results.get(timeout=timeout_s)
            rates[phase] = rates.get(phase, 0.0) + r
    except Exception as err:  # noqa: BLE001 - queue.Empty or a dead worker
        raise RuntimeError(f"core-sharing measurement did not finish within {timeout_s:g} s: "
                           f"{type(err).__name__}") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    per_k: dict[int, list[float]] = {k: [] for k in sweep}
    for c in range(cycles):
        first = 1 + c * k_max  # phase of this cycle's solo; the next solo closes it
        solo = 0.5 * (rates[first] + rates[first + k_max])
        for k in sweep:
            per_k[k].append(rates[first + k - 1] / solo)
    return [statistics.median(per_k[k]) for k in sweep]
