"""Every schedule on 2 and 4 gloo ranks equals the single-process model: loss and every parameter gradient
after one step (relative error <= 1e-5, fp32), and the losses of three AdamW steps; n in {1, 4}, recompute
off and on (recompute must not change a single bit of the gradients)."""
from __future__ import annotations

import pytest

from _pipeline_helpers import check_ok, merged_grads, rel_err, tiny_config
from pipeline.config import parse_config
from pipeline.local import launch, variants_worker
from pipeline.reference import reference_run

TOL = 1e-5
GRID = [(kind, p) for p in (2, 4) for kind in ("1f1b", "zb1p", "dualpipe", "dualpipev")]


def _variants(kind: str, p: int) -> list[dict]:
    out = [tiny_config(kind, p, n=n, recompute=rc)
           for n in (1, 4) for rc in ({"mode": "off"}, {"mode": "block", "block_size": 3})]
    if p == 2:  # MoE and Eq. 20 block size on the cheaper launches
        out.append(tiny_config(kind, p, n=4, moe=True, recompute={"mode": "auto"}))
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind,p", GRID, ids=[f"{k}-P{p}" for k, p in GRID])
def test_schedule_matches_single_process(kind, p):
    variants = _variants(kind, p)
    results = launch(variants_worker, p, (variants, True), timeout_s=200)
    check_ok(results)
    by_key = {}
    for vi, v in enumerate(variants):
        cfg = parse_config(v)
        want_losses, want_grads, _ = reference_run(cfg, steps=cfg.train.steps)
        got = merged_grads(results, vi)
        assert set(got) == set(want_grads), f"parameters differ: {sorted(set(got) ^ set(want_grads))[:5]}"
        for name, g in want_grads.items():
            err = rel_err(got[name], g)
            assert err <= TOL, f"{kind} P={p} variant {vi}: grad {name} rel err {err:.2e}"
        losses = [s["loss"] for s in results[0].value[vi]["stats"]]
        assert len(losses) == 3
        for step, (a, b) in enumerate(zip(losses, want_losses)):
            assert abs(a - b) <= TOL * abs(b), f"{kind} P={p} variant {vi}: step {step} loss {a} vs {b}"
        by_key[(v["model"]["residual"]["n"], v["recompute"]["mode"], "moe" in v["model"])] = got
    for n in (1, 4):  # recompute is exact: same bits as without it
        off, on = by_key[(n, "off", False)], by_key[(n, "block", False)]
        diff = [k for k in off if not off[k].equal(on[k])]
        assert not diff, f"recompute changed gradients of {diff[:3]}"
