"""Runtime calibration of `local` (costmodel.runtime_profile.calibrate_local_for pieces) on synthetic traces."""
import dataclasses

import pytest

from costmodel.runtime_profile import (baseline_action_stats, bench_runtime_pieces, fit_runtime_profile,
                                       runtime_key)
from costmodel.hardware import BUILTIN, RuntimeProfile
from costmodel.mhc_cost import ResidualSpec
from costmodel.predict import predict
from pipeline.config import load_config
from traces.trace import Trace

KNOWN = {"F": 1000.0, "I": 700.0, "W": 200.0, "B": 900.0}
WRAP = {"fwd": 300.0, "bwd": 500.0, "rc": 50.0, "expand_fwd": 10.0, "expand_bwd": 20.0, "contract_fwd": 5.0,
        "contract_bwd": 6.0}


def _profile(cfg, action_us, cores=64.0):
    return RuntimeProfile(key=runtime_key(cfg), action_us=action_us, residual_us={"mhc:4": WRAP},
                          effective_cores=cores, stretch_base=1.0, concurrency_base=1.0)


def _hw(cfg, action_us, cores=64.0):
    return BUILTIN["h100"].model_copy(update={"name": "local", "runtime": _profile(cfg, action_us, cores)})


def _table(cfg):
    """Known intrinsic costs per action key: per-block cost, +50% on the stages with the embedding or head."""
    pred = predict(cfg, _hw(cfg, {f"{k}/s0": v for k, v in KNOWN.items()}), ladder=False)
    table = {}
    for s in pred.baseline.trace.spans:
        if s.kind in KNOWN:
            table[f"{s.kind}/s{s.stage}"] = KNOWN[s.kind] * (1.5 if s.stage in (0, 7) else 1.0)
        elif s.kind == "FB":
            table[f"FB/s{s.stage}+s{s.partner[0]}"] = 1800.0
    return table


def _measured(cfg, table, steps=3, residual=None):
    """A 'measured' multi-step baseline trace: the simulated one repeated, with n=1 metadata."""
    pred = predict(cfg, _hw(cfg, table), ladder=False)
    tr = pred.baseline.trace
    span = pred.baseline.makespan * 1.2
    spans = [dataclasses.replace(s, start=s.start + k * span) for k in range(steps) for s in tr.spans]
    meta = {"source": "measured", "schedule": tr.meta["schedule"],
            "residual": residual or {"variant": "residual", "n": 1}}
    return Trace(spans, meta)


@pytest.fixture(scope="module")
def tiny():
    return load_config("tiny")


def test_fit_recovers_known_action_costs(tiny):
    table = _table(tiny)
    trace = _measured(tiny, table)
    bench = {"block": dict(KNOWN), "residual": {"mhc:4": WRAP}}  # micro-benchmark = measured: no contention
    prof = fit_runtime_profile(trace, tiny, bench, host_cores=64)
    assert prof.stretch_base == pytest.approx(1.0)
    for key, v in table.items():
        assert prof.action_us[key] == pytest.approx(v, rel=1e-6), key
    med, k, used = baseline_action_stats(trace)
    assert used == 2  # the first step is dropped


def test_contention_is_divided_out(tiny):
    table = _table(tiny)
    trace = _measured(tiny, {k: 2 * v for k, v in table.items()})  # the run was twice as slow as the bench
    bench = {"block": dict(KNOWN), "residual": {}}
    prof = fit_runtime_profile(trace, tiny, bench, host_cores=2)
    assert prof.stretch_base == pytest.approx(2.0)
    assert prof.effective_cores == pytest.approx(prof.concurrency_base / 2.0)
    for key, v in table.items():
        assert prof.action_us[key] == pytest.approx(v, rel=1e-6), key


def test_mhc_adds_wrapper_cost_per_sublayer(tiny):
    table = _table(tiny)
    pred = predict(tiny, _hw(tiny, table), ResidualSpec("mhc", 4, fused=False), ladder=False)
    ops = pred.summary["op_us"]
    subs = 2  # tiny on DualPipeV/4 ranks: one block per stage
    fwd = {s.stage: s.duration for s in pred.mhc.trace.spans if s.kind == "F"}
    base = {s.stage: s.duration for s in pred.baseline.trace.spans if s.kind == "F"}
    assert fwd[3] - base[3] == pytest.approx(subs * WRAP["fwd"])
    assert fwd[0] - base[0] == pytest.approx(subs * WRAP["fwd"] + WRAP["expand_fwd"])
    assert fwd[7] - base[7] == pytest.approx(subs * WRAP["fwd"] + WRAP["contract_fwd"])
    bwd = {s.stage: s.duration for s in pred.mhc.trace.spans if s.kind == "I"}
    bbase = {s.stage: s.duration for s in pred.baseline.trace.spans if s.kind == "I"}
    st = next(iter(set(bwd) - {0, 7}))
    assert bwd[st] - bbase[st] == pytest.approx(subs * WRAP["bwd"])  # recompute is off in tiny
    w = {s.stage: s.duration for s in pred.mhc.trace.spans if s.kind == "W"}
    wb = {s.stage: s.duration for s in pred.baseline.trace.spans if s.kind == "W"}
    assert w == pytest.approx(wb)  # W holds only the Linears' weight-grads: mHC adds nothing there
    assert ops["mhc"]["F"] > ops["baseline"]["F"]
    assert pred.summary["pricing"].startswith("runtime profile")


def test_recompute_adds_rebuild_cost(tiny):
    cfg = load_config("tiny", {"recompute": {"mode": "block", "block_size": 2}})
    table = _table(tiny)
    on = predict(cfg, _hw(cfg, table), ResidualSpec("mhc", 4, fused=False), ladder=False)
    off = predict(tiny, _hw(tiny, table), ResidualSpec("mhc", 4, fused=False), ladder=False)
    i_on = {s.stage: s.duration for s in on.mhc.trace.spans if s.kind == "I"}
    i_off = {s.stage: s.duration for s in off.mhc.trace.spans if s.kind == "I"}
    assert i_on[3] - i_off[3] == pytest.approx(2 * WRAP["rc"])


def test_contention_stretches_the_heavier_run(tiny):
    table = _table(tiny)
    pred = predict(tiny, _hw(tiny, table, cores=0.5), ResidualSpec("mhc", 4, fused=False), ladder=False)
    pb, pm = pred.pricers["baseline"], pred.pricers["mhc"]
    assert pb.slowdown >= 1.0 and pm.slowdown >= pb.slowdown


def test_never_calibrates_on_an_mhc_trace(tiny):
    trace = _measured(tiny, _table(tiny), residual={"variant": "mhc", "n": 4})
    with pytest.raises(ValueError, match="baseline"):
        fit_runtime_profile(trace, tiny, {"block": dict(KNOWN), "residual": {}}, host_cores=2)


def test_profile_of_another_shape_falls_back_to_roofline(tiny):
    other = load_config("tiny", {"parallel": {"seq_len": 64}})
    pred = predict(other, _hw(tiny, _table(tiny)), ladder=False)
    assert pred.summary["pricing"] == "roofline"


def test_missing_variant_names_the_fix(tiny):
    with pytest.raises(ValueError, match="calibrate_local_for"):
        predict(tiny, _hw(tiny, _table(tiny)), ResidualSpec("hc", 4), ladder=False)


def test_bench_runtime_pieces_quick(tiny):
    out = bench_runtime_pieces(tiny, [("mhc", 4)], rounds=2, warmup=1)
    assert all(v > 0 for v in out["block"].values())
    assert out["residual"]["mhc:4"]["fwd"] > 0 and out["residual"]["mhc:4"]["bwd"] > 0
