"""Runtime calibration of `local` (costmodel.local: the runtime-profile fit and the pricing from it) on synthetic
traces, and the runtime's stage timings it is built from (pipeline.launch.host_measurements)."""
import dataclasses

import pytest

from costmodel.physics.hardware import BUILTIN
from costmodel.local.host_pricing import HostPricing
from costmodel.local.runtime_fit import RuntimeProfileFit, baseline_action_stats, scale_residual
from costmodel.physics.mhc_cost import ResidualSpec
from costmodel.answers.predict import predict as predict_roofline
from costmodel.physics.runtime_profile import RESIDUAL_PIECES, RuntimeProfile, runtime_key
from costmodel.fitting.trace_fit import fit_trace
from configs import load_config
from pipeline.launch.host_measurements import time_stage_pieces
from traces.trace import Trace

KNOWN = {"F": 1000.0, "I": 700.0, "W": 200.0, "B": 900.0}
WRAP = {"fwd": 300.0, "bwd": 500.0, "w": 40.0, "b": 570.0, "rc": 50.0, "expand_fwd": 10.0, "expand_bwd": 20.0,
        "contract_fwd": 5.0, "contract_bwd": 6.0}


def predict(*args, **kw):
    """predict() with the `local` runtime profile priced by costmodel.local (what `mhcpipe predict` plugs in)."""
    return predict_roofline(*args, profile_pricing=HostPricing(), **kw)


def fit_runtime_profile(trace, cfg, stage_us, cores, hw):
    """The runtime profile fitted through the one fitting entry point."""
    return fit_trace(trace, cfg, hw, RuntimeProfileFit(stage_us, cores)).hardware.runtime


def _profile(cfg, action_us, cores=(64.0,)):
    return RuntimeProfile(key=runtime_key(cfg), action_us=action_us, residual_us={"mhc:4": WRAP},
                          cores_by_concurrency=list(cores))


def _hw(cfg, action_us, cores=(64.0,)):
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
    bench = {"block": dict(KNOWN), "residual": {"mhc:4": WRAP}}
    hw = BUILTIN["h100"].model_copy(update={"name": "local"})
    prof = fit_runtime_profile(trace, tiny, bench, [64.0], hw)  # the "run" had a core per rank
    for key, v in table.items():
        assert prof.action_us[key] == pytest.approx(v, rel=1e-6), key
    # the "bench" priced one block at the table's middle-stage cost: the code ran in the pipeline as benchmarked
    assert prof.meta["insitu_over_bench"] == pytest.approx({k: 1.0 for k in ("F", "I", "W", "B", "all")})
    assert prof.residual_us["mhc:4"] == pytest.approx(WRAP)
    means, medians, used = baseline_action_stats(trace)
    assert used == 2  # the first step is dropped
    # replay: the fitted profile simulates the measured step (alpha takes up the rest)
    pred = predict(tiny, hw.model_copy(update={"runtime": prof}), ladder=False)
    assert pred.baseline.makespan == pytest.approx(prof.meta["baseline_makespan_us"], rel=1e-2)


def test_residual_extra_follows_the_in_pipeline_speed_of_its_kind(tiny):
    """In the pipeline the baseline's blocks ran their forwards at 1.5x and their backwards at 0.8x their
    micro-benchmark: the residual's micro-benchmarked extra of the same kind is scaled the same way."""
    trace = _measured(tiny, _table(tiny))
    factor = {"F": 1.5, "I": 0.8, "W": 0.8, "B": 0.8}
    bench_block = {k: v / factor[k] for k, v in KNOWN.items()}
    prof = fit_runtime_profile(trace, tiny, {"block": bench_block, "residual": {"mhc:4": WRAP}}, [64.0],
                               BUILTIN["h100"].model_copy(update={"name": "local"}))
    got = prof.meta["insitu_over_bench"]
    assert {k: got[k] for k in factor} == pytest.approx(factor)
    # the weight-gradient piece stays as micro-benchmarked (scale_residual's docstring: measured better)
    want = {p: v * (1.0 if p == "w" else factor["F"] if p.endswith("fwd") else factor["I"]) for p, v in WRAP.items()}
    want["b"] = WRAP["b"] * (WRAP["bwd"] * factor["I"] + WRAP["w"] * 1.0) / (WRAP["bwd"] + WRAP["w"])
    assert prof.residual_us["mhc:4"] == pytest.approx(want)
    assert prof.meta["residual_bench_us"]["mhc:4"] == WRAP


def test_full_backward_piece_takes_the_factors_of_its_input_and_weight_gradient_parts():
    """The residual's B piece is its I piece plus its W piece: it is scaled by their factors (W's is 1: the W piece
    stays as micro-benchmarked), weighted by those pieces, not by the baseline B's factor (which weights the
    block's own weight gradients)."""
    pieces = {**WRAP, "bwd": 90.0, "w": 10.0, "b": 100.0}
    factors = {"F": 1.0, "I": 1.2, "W": 2.0, "B": 1.6, "all": 1.3}
    got = scale_residual(pieces, factors)
    assert got["b"] == pytest.approx(100.0 * (90 * 1.2 + 10 * 1.0) / 100)
    assert got["bwd"] == pytest.approx(90 * 1.2) and got["w"] == pytest.approx(10.0)
    assert scale_residual({**pieces, "bwd": 0.0, "w": 0.0}, factors)["b"] == pytest.approx(100 * 1.6)


def _run_of(cfg, table, cores, alpha):
    """(truth hardware, its prediction, a 3-step 'measured' baseline trace of it) for known work and latency."""
    truth = _hw(cfg, table, cores=cores)
    truth = truth.model_copy(update={"runtime": truth.runtime.model_copy(update={"p2p_latency_us": alpha})})
    pred = predict(cfg, truth, ladder=False)
    tr = pred.baseline.trace
    span = pred.baseline.makespan * 1.2
    trace = Trace([dataclasses.replace(s, start=s.start + k * span) for k in range(3) for s in tr.spans],
                  {"source": "measured", "schedule": tr.meta["schedule"], "residual": {"variant": "residual", "n": 1}})
    return truth, pred, trace


def test_fit_recovers_the_p2p_latency(tiny):
    cores = [64.0]  # a run without sharing
    _, _, trace = _run_of(tiny, _table(tiny), cores, 800.0)
    bench = {"block": dict(KNOWN), "residual": {}}
    prof = fit_runtime_profile(trace, tiny, bench, cores, BUILTIN["h100"].model_copy(update={"name": "local"}))
    assert prof.p2p_latency_us == pytest.approx(800.0, rel=0.05)
    # read off the trace directly: a waiting consumer starts one message (alpha + bytes / bandwidth) after its
    # producer ends (no executor gap in this profile)
    lat = prof.meta["message_latency_us"]
    assert lat["n"] > 0 and lat["median"] == pytest.approx(800.0, rel=0.05)


def test_fit_undoes_the_sharing_in_the_measured_durations(tiny):
    """A run on 2 cores for 4 ranks: every measured duration contains sharing. Taking the medians as work would
    count the sharing twice (simulation on top); the fit recovers the work and the latency that produced it."""
    table = _table(tiny)
    cores = [1.0, 1.8, 1.7, 1.6]
    truth, pred, trace = _run_of(tiny, table, cores, 600.0)
    _, medians, _ = baseline_action_stats(trace)
    assert max(medians[k] / v for k, v in table.items()) > 1.3  # the measured medians are stretched
    prof = fit_runtime_profile(trace, tiny, {"block": dict(KNOWN), "residual": {"mhc:4": WRAP}}, cores,
                               BUILTIN["h100"].model_copy(update={"name": "local"}))
    errs = sorted(abs(prof.action_us[k] / v - 1) for k, v in table.items())
    assert errs[len(errs) // 2] < 0.05 and errs[-1] < 0.25, errs
    assert prof.p2p_latency_us == pytest.approx(600.0, rel=0.25)
    refit = predict(tiny, truth.model_copy(update={"runtime": prof}), ladder=False)
    assert refit.baseline.makespan == pytest.approx(pred.baseline.makespan, rel=0.01)


def test_fit_ignores_stalls_in_the_mean(tiny):
    table = _table(tiny)
    trace = _measured(tiny, table, steps=4)
    key = "F/s3"
    hit = [i for i, s in enumerate(trace.spans) if s.kind == "F" and s.stage == 3]
    trace.spans[hit[-1]] = dataclasses.replace(trace.spans[hit[-1]], duration=100 * table[key])
    means, medians, _ = baseline_action_stats(trace)
    assert medians[key] == pytest.approx(table[key])
    assert means[key] == pytest.approx(table[key])  # one 100x stall is not contention


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
    assert all(w[st] - wb[st] == pytest.approx(subs * WRAP["w"]) for st in w)  # no stack-end pieces in W
    b = {s.stage: s.duration for s in pred.mhc.trace.spans if s.kind == "B"}
    bb = {s.stage: s.duration for s in pred.baseline.trace.spans if s.kind == "B"}
    assert b and all(b[st] - bb[st] == pytest.approx(subs * WRAP["b"] + (WRAP["contract_bwd"] if st == 7 else 0.0)
                                                     + (WRAP["expand_bwd"] if st == 0 else 0.0)) for st in b)
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


def test_shared_cores_slow_the_run_that_computes_more(tiny):
    table = _table(tiny)
    free = predict(tiny, _hw(tiny, table), ResidualSpec("mhc", 4, fused=False), ladder=False)
    shared = predict(tiny, _hw(tiny, table, cores=(1.0, 1.0)), ResidualSpec("mhc", 4, fused=False), ladder=False)
    assert shared.baseline.makespan > free.baseline.makespan
    assert shared.mhc.makespan / free.mhc.makespan > shared.baseline.makespan / free.baseline.makespan
    # one core: the ranks' compute cannot overlap, so the step is at least the summed work (the free run's busy
    # time, where every rank runs at full speed; an F&B span may also hold a wait between its halves)
    work = sum(free.mhc.busy.values())
    assert shared.mhc.makespan >= work - 1e-6


def test_never_calibrates_on_an_mhc_trace(tiny):
    trace = _measured(tiny, _table(tiny), residual={"variant": "mhc", "n": 4})
    with pytest.raises(ValueError, match="baseline"):
        fit_runtime_profile(trace, tiny, {"block": dict(KNOWN), "residual": {}}, [1.0, 2.0],
                            BUILTIN["h100"].model_copy(update={"name": "local"}))


def test_profile_of_another_shape_falls_back_to_roofline(tiny):
    other = load_config("tiny", {"parallel": {"seq_len": 64}})
    pred = predict(other, _hw(tiny, _table(tiny)), ladder=False)
    assert pred.summary["pricing"] == "roofline"


def test_a_profile_is_never_priced_without_its_pricing(tiny):
    """The analytic core does not know how to price a runtime profile: a spec that carries one for this config
    and no ProfilePricing is refused, not silently priced by the roofline."""
    with pytest.raises(ValueError, match="profile_pricing=costmodel.local.host_pricing.HostPricing"):
        predict_roofline(tiny, _hw(tiny, _table(tiny)), ladder=False)


def test_missing_variant_names_the_fix(tiny):
    with pytest.raises(ValueError, match="calibrate_local_for"):
        predict(tiny, _hw(tiny, _table(tiny)), ResidualSpec("hc", 4), ladder=False)


def test_profile_from_an_older_calibration_names_the_fix(tiny):
    old = {k: v for k, v in WRAP.items() if k not in ("w", "b")}
    with pytest.raises(ValueError, match=r"residual_us\['mhc:4'\] lacks w, b.*recalibrate"):
        RuntimeProfile(key=runtime_key(tiny), action_us={"F/s0": 1.0}, residual_us={"mhc:4": old},
                       cores_by_concurrency=[1.0])


def test_time_stage_pieces_quick(tiny):
    out = time_stage_pieces(tiny, [("mhc", 4)], rounds=3, warmup=1)
    assert set(out["block"]) == {"F", "I", "W", "B"} and all(v > 0 for v in out["block"].values())
    extra = out["residual"]["mhc:4"]
    assert set(extra) == set(RESIDUAL_PIECES)  # every piece a runtime profile needs, nothing else
    # mHC's wrapper (coefficients, Sinkhorn, pre, post+res) costs more than the plain residual's add, both ways
    assert extra["fwd"] > 0 and extra["bwd"] > 0 and extra["b"] > 0


def test_work_is_the_typical_duration_not_the_tail_of_lost_time_slices(tiny):
    """In one of three steady steps every F/s3 lost time slices (1.8x, not a stall): the simulation makes ranks lose
    slices itself, so the work stays the typical (median) duration; the mean would count the loss twice."""
    table = _table(tiny)
    trace = _measured(tiny, table, steps=4)
    key = "F/s3"
    hit = [i for i, s in enumerate(trace.spans) if s.kind == "F" and s.stage == 3]
    for i in hit[-len(hit) // 4:]:  # the last step's
        trace.spans[i] = dataclasses.replace(trace.spans[i], duration=1.8 * trace.spans[i].duration)
    means, _, _ = baseline_action_stats(trace)
    assert means[key] > 1.2 * table[key]
    prof = fit_runtime_profile(trace, tiny, {"block": dict(KNOWN), "residual": {}}, [64.0],
                               BUILTIN["h100"].model_copy(update={"name": "local"}))
    assert prof.action_us[key] == pytest.approx(table[key], rel=1e-6)
