"""The F&B pair as it runs: DualPipe's program order on three streams, SMs and HBM shared by co-running kernels,
the communication SM carve-out, outputs released inside the pair, and P2P semantics in the schedule engine."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from configs import load_config
from costmodel.physics.hardware import get_hardware
from costmodel.pricing.fb_overlap import TimedOp, overlap
from costmodel.answers.predict import predict
from costmodel.pricing.options import Options
from schedules import build
from schedules.engine import run_engine
from schedules.ir import Kind
from schedules.lowering import lower_comms


def _op(name, stream, d, sm, hbm, preemptible=True):
    return TimedOp(name, "model", stream, d, (), preemptible, sm, hbm)


@settings(max_examples=200, deadline=None)
@given(d1=st.floats(0.1, 100), d2=st.floats(0.1, 100), sm1=st.floats(0, 1), sm2=st.floats(0, 1),
       hbm1=st.floats(0, 1), hbm2=st.floats(0, 1), yields=st.booleans())
def test_corunning_is_between_the_longer_kernel_and_back_to_back(d1, d2, sm1, sm2, hbm1, hbm2, yields):
    """A kernel on the compute stream and one on the hp stream, independent: together they take at least as
    long as the longer one and at most as long as both back to back, whatever their demands."""
    a, b = _op("gemm", "compute", d1, sm1, hbm1, yields), _op("post", "hp", d2, sm2, hbm2)
    both = overlap([[a], [b]], "streams").makespan
    assert max(d1, d2) * (1 - 1e-9) <= both <= (d1 + d2) * (1 + 1e-9)
    assert overlap([[a], [b]], "streams", corun=False).makespan == pytest.approx(d1 + d2)


def test_memory_bound_kernel_next_to_a_gemm_that_yields_costs_only_the_sms_it_takes():
    """GEMM (all SMs, little bandwidth) and an hp copy (35% of the SMs, 90% of the bandwidth) of 10 units: the
    copy, arriving at t=5, runs at full rate and the GEMM at 65% meanwhile: 100 + 0.35 * 10. A GEMM that never
    yields keeps the SMs it holds: the copy waits for it (110); one that starts after the copy gets the rest."""
    gemm = _op("gemm", "compute", 100, 1.0, 0.05)
    copy = _op("post", "hp", 10, 0.35, 0.9)
    assert overlap([[gemm], [copy]], "streams", lags=(0, 5)).makespan == pytest.approx(103.5)
    hold = _op("gemm", "compute", 100, 1.0, 0.05, preemptible=False)
    assert overlap([[hold], [copy]], "streams", lags=(0, 5)).makespan == pytest.approx(110)
    assert overlap([[hold], [copy]], "streams", lags=(5, 0)).makespan == pytest.approx(5 + 100 + 0.35 * 5)


def test_the_comm_carve_out_stretches_compute_by_sms_over_the_rest():
    """DeepSeek-V3's 20 of 132 SMs: a compute-bound kernel under an all-to-all takes 132/112 as long."""
    a2a = TimedOp("dispatch", "a2a", "comm", 1000.0, ())
    gemm = _op("gemm", "compute", 100, 1.0, 0.0)
    res = overlap([[a2a], [gemm]], "streams", comm_share=20 / 132)
    gemm_row = [r for r in res.timeline if r[1] == "gemm"][0]
    assert gemm_row[4] - gemm_row[3] == pytest.approx(100 * 132 / 112)
    assert overlap([[a2a], [gemm]], "streams", comm_share=20 / 132, sigma=0.1).timeline[1][4] > gemm_row[4]


def test_pair_follows_program_order_and_hides_one_halfs_all_to_all_under_the_other():
    """Forward [attn, dispatch | experts, combine | post] against backward [mlp, dispatch.bwd | attn]: the turn
    passes after every all-to-all, so each half's all-to-all runs while the other half computes, and the
    forward's output is released at its post kernel, before the pair ends."""
    f = [TimedOp("f.attn", "model", "compute", 10), TimedOp("f.dispatch", "a2a", "comm", 8),
         TimedOp("f.experts", "model", "compute", 10), TimedOp("f.combine", "a2a", "comm", 8),
         TimedOp("f.post", "mhc", "hp", 2, output=True)]
    b = [TimedOp("b.mlp", "model", "compute", 10), TimedOp("b.dispatch", "a2a", "comm", 8),
         TimedOp("b.attn", "model", "compute", 30, output=True)]
    res = overlap([f, b], "streams")
    when = {name: (s, e) for _, name, _, s, e in res.timeline}
    order = sorted((s, name) for name, (s, e) in when.items() if not name.endswith(("dispatch", "combine")))
    assert [name for _, name in order] == ["f.attn", "b.mlp", "f.experts", "b.attn", "f.post"]
    for comm, other in (("f.dispatch", "b.mlp"), ("b.dispatch", "f.experts")):
        lo, hi = max(when[comm][0], when[other][0]), min(when[comm][1], when[other][1])
        assert hi > lo, f"{comm} does not overlap {other}: {when}"
    assert res.release[0] < res.makespan and res.release[0] == when["f.post"][1]
    serial = overlap([f, b], "serial")
    assert res.makespan < serial.makespan and res.exposed_comm < serial.exposed_comm


def test_deferred_weight_grads_are_issued_after_both_halves():
    """As the runtime issues them on CUDA (pipeline/runtime/overlap.py: the host never waits there, so no gap is seen):
    the backward's W kernels go to the end of the compute stream's queue, after the input gradient (output) and
    after the forward half's kernels, whatever the timing; wfill="program" keeps each W where its backward made
    it (DeepSeek-V3 Fig. 4), where here it fills the dispatch wait."""
    f = [TimedOp("f.a", "model", "compute", 5), TimedOp("f.dispatch", "a2a", "comm", 20),
         TimedOp("f.experts", "model", "compute", 5, output=True)]
    b = [TimedOp("b.dgrad", "model", "compute", 5, output=True),
         TimedOp("b.wgrad", "model", "compute", 10, (-1,), deferrable=True)]
    res = overlap([f, b], "streams")
    when = {name: (s, e) for _, name, _, s, e in res.timeline}
    assert when["b.wgrad"][0] == pytest.approx(when["f.experts"][1])  # after both halves, not in the gap
    assert res.release[1] == when["b.dgrad"][1] < when["b.wgrad"][1]
    assert res.makespan == pytest.approx(40)
    prog = overlap([f, b], "streams", wfill="program")
    when = {name: (s, e) for _, name, _, s, e in prog.timeline}
    assert when["b.wgrad"][0] == pytest.approx(when["b.dgrad"][1])
    assert when["b.wgrad"][1] < when["f.dispatch"][1]
    assert prog.makespan == pytest.approx(30)
    with pytest.raises(ValueError, match="wfill 'gaps'"):
        overlap([f, b], "streams", wfill="gaps")


@pytest.fixture(scope="module")
def paper27b():
    return load_config("paper-27b")


def test_hp_placement_is_strictly_lower_on_the_paper_layout(paper27b):
    """paper-27b / h800 / DualPipe PP=6 EP=8: the MLP post+res on the high-priority stream releases the forward
    output and the combine's consumers earlier and co-runs with the other half's GEMMs."""
    hp = predict(paper27b, "h800", ladder=False).summary
    no = predict(paper27b, "h800", options=Options(hp_stream=False), ladder=False).summary
    assert hp["iteration_us"]["mhc"] < no["iteration_us"]["mhc"]
    assert hp["fb_stage_overhead_pct"] < no["fb_stage_overhead_pct"]
    assert hp["iteration_us"]["baseline"] == no["iteration_us"]["baseline"]  # no mHC kernels, nothing to place


@pytest.mark.parametrize("preset,overrides,hw", [
    ("paper-3b", {"parallel": {"ranks": 4, "microbatches": 64, "expert_parallel": 8}}, "h800"),
    ("paper-3b", {"parallel": {"ranks": 3, "microbatches": 96, "expert_parallel": 8, "schedule": "dualpipev"}}, "h200"),
    ("paper-9b", {"parallel": {"ranks": 6, "microbatches": 192, "expert_parallel": 16, "data_parallel": 16,
                               "schedule": "dualpipe"}}, "a100"),
    ("paper-3b", {"parallel": {"ranks": 4, "microbatches": 64, "expert_parallel": 1, "schedule": "1f1b"}}, "h800"),
])
def test_hp_placement_never_costs_more(preset, overrides, hw):
    cfg = load_config(preset, overrides)
    hp = predict(cfg, hw, ladder=False).mhc.makespan
    no = predict(cfg, hw, options=Options(hp_stream=False), ladder=False).mhc.makespan
    assert hp <= no * (1 + 1e-12)


def test_more_hbm_bandwidth_never_raises_mhcs_overhead(small_cfg):
    h800 = get_hardware("h800")
    overheads = [predict(small_cfg, h800.model_copy(update={"hbm_bandwidth": h800.hbm_bandwidth * f}),
                         ladder=False).summary["step_overhead_pct"] for f in (0.5, 1.0, 2.0, 4.0)]
    assert all(b <= a + 1e-9 for a, b in zip(overheads, overheads[1:])), overheads


def test_one_stream_costs_nothing(small_cfg):
    cfg = small_cfg.model_copy(update={"model": small_cfg.model.model_copy(update={
        "residual": small_cfg.model.residual.model_copy(update={"n": 1})})})
    s = predict(cfg, "h800", ladder=False).summary
    assert s["step_overhead_pct"] == 0.0 and s["iteration_us"]["baseline"] == s["iteration_us"]["mhc"]


# ---- the schedule engine: outputs released inside a pair, P2P semantics -------------------------------------
def _pair_engine(p2p, fb_timing):
    sched = lower_comms(build("dualpipev", 2, 8))
    return run_engine(sched, lambda a: {Kind.F: 4.0, Kind.B: 8.0, Kind.I: 4.0, Kind.W: 4.0}.get(a.kind, 12.0),
                      lambda a: 1.0, fb_timing=fb_timing, p2p=p2p)


def test_a_pair_sends_its_forward_output_when_ready_under_rendezvous_not_under_commit():
    early = lambda a, lf, lb: (12.0 + max(lf, lb), 3.0 + lf, 10.0 + lb)  # noqa: E731
    for p2p in ("commit", "rendezvous"):
        res = _pair_engine(p2p, early)
        assert res.completed
        fb = {(s.rank, s.stage, s.mb): s for s in res.spans if s.kind == "FB"}
        sends = [s for s in res.spans if s.kind == "SEND_F" and (s.rank, s.stage, s.mb) in fb]
        assert sends
        inside = [s for s in sends if s.start < fb[(s.rank, s.stage, s.mb)].end - 1e-9]
        if p2p == "commit":
            assert not inside  # posted at the program point after the pair
        else:
            assert len(inside) == len(sends)
    assert _pair_engine("rendezvous", early).end[0] <= _pair_engine("commit", early).end[0]


def test_a_pair_starts_when_either_input_is_there():
    """With fb_timing the pair starts at its first input and the late half's lag is passed in."""
    seen = []

    def timing(a, lf, lb):
        seen.append((lf, lb))
        return 12.0 + max(lf, lb), 12.0 + lf, 12.0 + lb

    res = _pair_engine("rendezvous", timing)
    assert res.completed and seen
    assert all(min(lf, lb) == 0.0 and lf >= 0 and lb >= 0 for lf, lb in seen)
    assert any(max(lf, lb) > 0 for lf, lb in seen)  # some pair did start before its second input


def test_a_weight_grad_of_any_length_never_delays_the_other_half():
    """The next kernel waits 2 units for its dispatch; the deferred W is issued after both halves whatever its
    length, so a 50-unit W and a 1-unit W leave the forward half's times (and the combine it feeds) unchanged."""
    def pair(w):
        f = [TimedOp("f.a", "model", "compute", 5), TimedOp("f.dispatch", "a2a", "comm", 2),
             TimedOp("f.experts", "model", "compute", 5), TimedOp("f.combine", "a2a", "comm", 20, output=True)]
        b = [TimedOp("b.dgrad", "model", "compute", 1, output=True),
             TimedOp("b.wgrad", "model", "compute", w, (-1,), deferrable=True)]
        return overlap([f, b], "streams")
    for w in (50.0, 1.0):
        res = pair(w)
        when = {name: (s, e) for _, name, _, s, e in res.timeline}
        assert when["f.experts"][0] == pytest.approx(7.0) and when["b.wgrad"][0] >= when["f.experts"][1]
        assert res.release[0] == pytest.approx(32.0)


def test_a_chain_runs_alike_every_time_it_is_run():
    """A Chain keeps what run_streams derives from it alone: its runs, alone, in pairs (both orders, both streams
    settings) and with late inputs, in any order and again, equal a run of a fresh plain list of the same ops."""
    from costmodel.pricing.fb_overlap import Chain

    f = [TimedOp("f.attn", "model", "compute", 3.0, (), True, 1.0, 0.2, switch=True),
         TimedOp("f.post", "model", "hp", 1.0, (-1,), True, 0.3, 0.8),
         TimedOp("f.dispatch", "a2a", "comm", 2.0), TimedOp("f.mlp", "model", "compute", 4.0, output=True)]
    b = [TimedOp("b.combine", "a2a", "comm", 2.0), TimedOp("b.mlp", "model", "compute", 5.0, output=True),
         TimedOp("b.mlp.w", "model", "compute", 2.0, (-1,), deferrable=True, switch=True),
         TimedOp("b.post", "model", "hp", 1.0, (-2,), True, 0.3, 0.8), TimedOp("b.attn", "model", "compute", 3.0)]
    cf, cb = Chain(f), Chain(b)
    runs = [((0,), {}), ((0, 1), {}), ((1, 0), {}), ((0, 1), {"lags": (1.5, 0.0)}), ((0, 1), {"b_first": True}),
            ((0,), {"hp": False}), ((1,), {}), ((0, 1), {"hp": False, "lags": (0.0, 2.5)})]
    for _ in range(2):
        for which, kw in runs:
            kw = {"comm_share": 0.1, **kw}
            got = overlap([(cf, cb)[i] for i in which], "streams", **kw)
            want = overlap([list((f, b)[i]) for i in which], "streams", **kw)
            assert (got.makespan, got.release, got.group_time, got.timeline) == \
                (want.makespan, want.release, want.group_time, want.timeline), (which, kw)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), mode=st.sampled_from(["streams", "serial", "max"]), hp=st.booleans(),
       sigma=st.floats(0, 1), share=st.floats(0, 0.5), corun=st.booleans())
def test_the_floor_never_exceeds_the_run(data, mode, hp, sigma, share, corun):
    """fb_overlap.floor (what the tuner prunes with before it runs any streams) is at most the makespan the streams
    give, for one chain or a pair, any streams, dependencies, demands, interference and carve-out."""
    from costmodel.pricing.fb_overlap import floor

    def chain(tag: str) -> list[TimedOp]:
        n = data.draw(st.integers(1, 8))
        ops = []
        for i in range(n):
            deps = tuple(sorted(set(data.draw(st.lists(st.integers(-i, -1), max_size=2))))) if i else ()
            ops.append(TimedOp(f"{tag}{i}", "model", data.draw(st.sampled_from(["compute", "hp", "comm"])),
                               data.draw(st.floats(0.1, 50)), deps, data.draw(st.booleans()),
                               data.draw(st.floats(0, 1)), data.draw(st.floats(0, 1)),
                               switch=data.draw(st.booleans())))  # deferred W: nothing may wait for them
        return ops

    chains = [chain("f")] + ([chain("b")] if data.draw(st.booleans()) else [])
    got = overlap(chains, mode, sigma, hp, corun=corun, comm_share=share)
    assert floor(chains, mode, hp) <= got.makespan * (1 + 1e-9)
