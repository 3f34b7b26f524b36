"""F&B pair issue orders (`predict --fb-order`): the runtime's (forward first, weight gradients last) and DeepSeek-V3
Fig. 4's (backward first, weight gradients in place); both price the same kernels, neither beats the bound of a
pair whose communication is fully hidden."""
from __future__ import annotations

import pytest

from configs import load_config
from costmodel.answers.predict import predict
from costmodel.physics.hardware import get_hardware
from costmodel.pricing.fb_overlap import TimedOp, _issue_order
from costmodel.pricing.options import Options

H800 = get_hardware("h800")


def test_the_orders_issue_the_halves_as_named():
    f = [TimedOp("f.attn", "model", "compute", 1.0), TimedOp("f.dispatch", "a2a", "comm", 1.0),
         TimedOp("f.mlp", "model", "compute", 1.0)]
    b = [TimedOp("b.combine", "a2a", "comm", 1.0), TimedOp("b.mlp", "model", "compute", 1.0),
         TimedOp("b.mlp.w", "model", "compute", 1.0, deferrable=True, switch=True),
         TimedOp("b.attn", "model", "compute", 1.0)]
    chains = [f, b]
    ops = f + b
    names = [ops[i].name for i in _issue_order(chains, pair=True)]
    assert names == ["f.attn", "f.dispatch", "b.combine", "f.mlp", "b.mlp", "b.attn", "b.mlp.w"]
    names = [ops[i].name for i in _issue_order(chains, pair=False, b_first=True)]
    assert names == ["b.combine", "f.attn", "f.dispatch", "b.mlp", "b.mlp.w", "f.mlp", "b.attn"]


@pytest.mark.parametrize("preset", ["deepseek-v3", "paper-27b"])
def test_both_orders_price_the_same_work_above_the_hidden_bound(preset):
    cfg = load_config(preset)
    out = {}
    for order in ("runtime", "deepseek"):
        pred = predict(cfg, H800, options=Options(fb_order=order), ladder=False)
        pairs = [r for k, r in pred.pricers["baseline"].results.items() if k[0] == "FB"]
        out[order] = (pred.summary, sorted((k, round(v, 6)) for r in pairs for k, v in r.group_time.items()))
        assert pred.summary["fb_order"] == order
        for r in pairs:
            assert r.makespan >= max(r.compute_busy, r.comm_busy) * (1 - 1e-12)
    assert out["runtime"][1] == out["deepseek"][1]  # the same kernels, only their order differs
    rt, ds = (out[o][0]["fb_pair_us"]["baseline"] for o in ("runtime", "deepseek"))
    if preset == "deepseek-v3":  # V3's pairs are all-to-all bound: Fig. 4's order hides most of it
        assert ds["exposed_comm"] < 0.5 * rt["exposed_comm"] and ds["priced"] < rt["priced"]


def test_a_bad_order_is_refused_in_one_line():
    with pytest.raises(ValueError, match="fb_order 'fig4': choose one of runtime, deepseek"):
        Options(fb_order="fig4")
