"""`mhcpipe predict --explain`: the ladder's rungs are consistent (one switch each, the last one the plain
prediction), each rung moves what its mechanism moves, the step anatomy adds up, and the CLI's bad input is one
line."""
import dataclasses
import json
import math

import pytest

from costmodel.explain import (CUTILE, CUTILE_MHC_EFF, MEMORY_CURVE, PAPER_PCT, TOLERANCE_PP, Variant, explain,
                               honest_variants, honest_verdict, ladder_steps)
from costmodel.hardware import get_hardware
from costmodel.mhc_cost import ResidualSpec
from costmodel.predict import predict, residual_spec_of
from costmodel.pricing import Options
from costmodel.step_anatomy import (RESIDUAL_GROUPS, _stage_residual_bytes, critical_path_summary, residual_bytes,
                                    stage_residual_kernels)
from mhcpipe.cli import main

H800 = get_hardware("h800")


@pytest.fixture(scope="module")
def ex(small_cfg):
    return explain(small_cfg, H800, residual_spec_of(small_cfg), Options(), honest=False)


def _switches(spec: ResidualSpec, o: Options) -> dict:
    return {"fused": spec.fused, **dataclasses.asdict(o)}


@pytest.mark.parametrize("opts", [Options(), Options(fb_mode="max", hp_stream=False, sigma=0.1)])
def test_each_rung_switches_one_mechanism_and_ends_at_the_callers_options(small_cfg, opts):
    spec = residual_spec_of(small_cfg)
    steps, note = ladder_steps(small_cfg, H800, spec, opts)
    first = steps[0]
    assert not first[2].fused and first[3].fb_mode == "serial" and not first[3].hp_stream and not first[3].recompute
    assert first[3].ep_per_node == 4 and "EP 8 over 2 nodes (4 per node)" in note  # EP 8 fits a node of 8
    for (_, _, s0, o0), (name, _, s1, o1) in zip(steps, steps[1:]):
        a, b = _switches(s0, o0), _switches(s1, o1)
        changed = [k for k in a if a[k] != b[k]]
        assert len(changed) <= 1, (name, changed)
    assert steps[-1][2] == spec and steps[-1][3] == opts
    # the switches the caller leaves at the naive value make their rung a no-op
    assert len({(s, o) for _, _, s, o in steps}) == len(steps) - (opts.fb_mode == "serial") - (not opts.hp_stream)


def test_last_rung_is_the_plain_prediction(small_cfg, ex):
    plain = predict(small_cfg, H800, residual_spec_of(small_cfg), Options(), ladder=False).summary
    last = ex.rungs[-1].summary
    assert last["overhead_pct"] == plain["overhead_pct"]
    assert last["fb_step_overhead_pct"] == plain["fb_step_overhead_pct"]
    assert last["iteration_us"] == plain["iteration_us"]


def test_rungs_move_what_their_mechanism_moves(ex):
    naive, fused, rc, ovl = ex.rungs[:4]
    # fusing touches mHC's kernels only: fewer bytes, a cheaper mHC step, the same baseline
    assert fused.mhc["residual_bytes_per_rank"] < naive.mhc["residual_bytes_per_rank"]
    assert fused.baseline["residual_bytes_per_rank"] == naive.baseline["residual_bytes_per_rank"]
    assert fused.summary["iteration_us"]["baseline"] == naive.summary["iteration_us"]["baseline"]
    assert fused.summary["iteration_us"]["mhc"] < naive.summary["iteration_us"]["mhc"]
    assert fused.step_pct < naive.step_pct and fused.fb_pct < naive.fb_pct
    # recompute adds the rebuild kernels' bytes and time, and lowers the peak memory
    assert rc.mhc["residual_bytes_per_rank"] > fused.mhc["residual_bytes_per_rank"]
    assert rc.summary["iteration_us"]["mhc"] >= fused.summary["iteration_us"]["mhc"]
    assert rc.summary["memory_gib"]["mhc"] < fused.summary["memory_gib"]["mhc"]
    # serial F&B: every all-to-all exposed; the overlap hides part of it, for the baseline as well (like for like)
    for r in (naive, fused, rc):
        for side in (r.mhc, r.baseline):
            assert side["a2a_total_us"] > 0 and math.isclose(side["a2a_exposed_us"], side["a2a_total_us"], rel_tol=1e-9)
    assert ovl.mhc["a2a_exposed_us"] < rc.mhc["a2a_exposed_us"]
    assert ovl.baseline["a2a_exposed_us"] < rc.baseline["a2a_exposed_us"]
    assert ovl.summary["iteration_us"]["baseline"] < rc.summary["iteration_us"]["baseline"]
    # the boundary is n C wide whatever the kernels do
    for r in ex.rungs:
        assert math.isclose(r.mhc["boundary_bytes_per_rank"], 4 * r.baseline["boundary_bytes_per_rank"], rel_tol=1e-12)


def test_residual_bytes_count_every_microbatch_once_per_stage(small_cfg):
    """Every micro-batch crosses every stage of its pipeline once forward and once backward (DualPipe: two
    pipelines of M/2), so a step's residual bytes are M/pipelines x the sum over stages; the baseline's are the
    residual adds, 3C per sub-layer and pass."""
    pred = predict(small_cfg, H800, ladder=False)
    sched = pred.schedule
    per_mb = len(sched.pipelines)
    M = sched.num_microbatches
    for name in ("baseline", "mhc"):
        pr = pred.pricers[name]
        total = sum(sum(_stage_residual_bytes(pr, st)) for st in pr.layout)
        assert math.isclose(residual_bytes(pr, sched), M / per_mb * total, rel_tol=1e-12)
    pb = predict(small_cfg, H800, options=Options(recompute=False), ladder=False).pricers["baseline"]
    s = pb.shape
    for st, (blocks, _, _) in pb.layout.items():
        assert _stage_residual_bytes(pb, st) == (2 * len(blocks) * 3 * s.C * s.T * s.d,) * 2
    # mHC: a pipeline's first stage also expands h into n streams, its last contracts them ((n+1)C each way)
    pm = pred.pricers["mhc"]
    first, middle, last = (next(st for st, (_, f, la) in pm.layout.items() if (f, la) == k)
                           for k in ((True, False), (False, False), (False, True)))
    ends = (4 + 1) * s.C * s.T * s.d
    for st in (first, last):
        for got, mid in zip(_stage_residual_bytes(pm, st), _stage_residual_bytes(pm, middle)):
            assert math.isclose(got - mid, ends, rel_tol=1e-12)


@pytest.mark.parametrize("opts,hw", [(Options(), H800), (Options(recompute=False, hp_stream=False), H800),
                                     (Options(), H800.model_copy(update={"mhc_memory_eff": CUTILE_MHC_EFF}))])
def test_residual_kernels_are_the_ones_the_pricer_prices(small_cfg, opts, hw):
    """The byte count's kernel lists price, kernel by kernel, to the residual-side time of the Pricer's own
    forward and I chains: a change of what the Pricer runs that the count misses fails here (also with the mHC
    kernels on their own curve: the anatomy counts bytes and leaves their time to Pricer.kernel_us)."""
    pred = predict(small_cfg, hw, options=opts, ladder=False)
    for name in ("baseline", "mhc"):
        pr = pred.pricers[name]
        for st in pr.layout:
            fwd, bwd = stage_residual_kernels(pr, st)
            priced = [sum(op.duration for op in ops if op.group in RESIDUAL_GROUPS)
                      for ops in (pr.forward_ops(st), pr.backward_ops(st, with_w=False))]
            mine = [sum(pr.kernel_us(k, backward) for k in ks) for ks, backward in ((fwd, False), (bwd, True))]
            assert priced[0] > 0 and priced[1] > 0
            for a, b in zip(mine, priced):
                assert math.isclose(a, b, rel_tol=1e-9), (name, st, mine, priced)


def test_critical_path_adds_up_to_the_makespan(small_cfg):
    pred = predict(small_cfg, H800, ladder=False)
    for sim in (pred.baseline, pred.mhc):
        cp = critical_path_summary(sim)
        assert math.isclose(cp["makespan_us"], sim.makespan, rel_tol=1e-9)
        parts = cp["compute_us"] + cp["comm_us"] + cp["other_us"] + cp["gaps_us"]
        assert math.isclose(parts, sim.makespan, rel_tol=1e-9)
        # a simulated trace explains every start by an input's end: no gaps; the path crosses ranks by P2P
        assert cp["gaps_us"] <= 1e-6 * sim.makespan and cp["comm_us"] > 0 and len(cp["ranks"]) > 1
        assert math.isclose(sum(cp["by_kind_us"].values()), cp["compute_us"], rel_tol=1e-12)


def test_honest_answer_is_stated_assumptions_not_a_fit(small_cfg):
    spec = residual_spec_of(small_cfg)
    vs = honest_variants(small_cfg, spec, Options())
    assert {(v.hardware, v.sigma) for v in vs} == {(h, s) for h in ("h800", "h200") for s in (0.0, 0.15)}
    assert len({v.ep_layout for v in vs}) == 2 and len(vs) == 10
    # per hardware, 2 placements x 2 sigmas on the memory curve, and the caller's placement at sigma 0 with the
    # mHC kernels at the cuTile efficiency: a different price from the memory curve's, and the one it says
    cut = [v for v in vs if v.mhc_kernels == CUTILE]
    assert [v.hardware for v in cut] == ["h800", "h200"] and all(v.sigma == 0 for v in cut)
    for v in cut:
        ref = next(w for w in vs if w.mhc_kernels == MEMORY_CURVE and (w.hardware, w.ep_layout, w.sigma)
                   == (v.hardware, v.ep_layout, v.sigma))
        assert ref.ep_layout == "EP 8 inside one node" and ref.fb_pct != v.fb_pct
        hw = get_hardware(v.hardware).model_copy(update={"mhc_memory_eff": CUTILE_MHC_EFF})
        s = predict(small_cfg, hw, spec, Options(sigma=0.0), ladder=False).summary
        assert (v.step_pct, v.fb_pct) == (s["overhead_pct"], s["fb_step_overhead_pct"])
    # sigma slows the compute under the all-to-all for the baseline and mHC alike; the other switches move it too
    assert len({round(v.step_pct, 9) for v in vs}) > 1
    for v in vs:
        assert v.within == (abs(v.fb_pct - PAPER_PCT) <= TOLERANCE_PP)
    assert Variant("h800", "x", 0.0, 9.0, PAPER_PCT + TOLERANCE_PP + 0.01).within is False
    assert Variant("h800", "x", 0.0, 9.0, PAPER_PCT - TOLERANCE_PP).within is True


def test_verdict_counts_and_names_the_smaller_group():
    inside = [Variant("h200", "EP a", 0.0, 7.0, PAPER_PCT), Variant("h200", "EP b", 0.15, 7.0, PAPER_PCT + 1)]
    outside = Variant("h800", "EP a", 0.0, 9.0, PAPER_PCT + TOLERANCE_PP + 1, CUTILE)
    v = honest_verdict(inside + [outside])
    assert v.startswith("2 of 3 land within") and "outside: h800, EP a, sigma 0, cuTile 0.80 (" in v
    assert "EP b" not in v and "within: h200" in honest_verdict(inside[:1] + [outside, outside])
    assert honest_verdict(inside).startswith("all 2") and honest_verdict([outside]).startswith("none of the 1")


def test_explain_refuses_the_baseline(small_cfg):
    with pytest.raises(ValueError, match="no mHC overhead"):
        explain(small_cfg, H800, ResidualSpec.baseline(), Options(), honest=False)


SMALL = ["predict", "--preset", "paper-3b", "--pp", "4", "--microbatches", "8", "--ep", "8"]


def test_cli_explain_writes_table_waterfall_and_json(tmp_path, capsys):
    png, js = tmp_path / "w.png", tmp_path / "w.json"
    assert main(SMALL + ["--explain", "-o", str(png), "--json", str(js)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "of the overlapped F&B stage" in out.splitlines()[1] and "honest answer" in out
    assert png.stat().st_size > 10_000
    data = json.loads(js.read_text())
    assert [r["name"] for r in data["rungs"]][0] == "naive eager" and len(data["honest_answer"]["variants"]) == 10


def test_cli_report_errors_are_one_line(capsys):
    for extra, words in ((["--explain", "--sweep", "n=1..4"], "--sweep and --explain"),
                         (["--explain", "--sensitivity"], "--explain and --sensitivity"),
                         (["--explain", "--trace-out", "t.json"], "--trace-out"),
                         (["--sensitivity", "0"], "--sensitivity 0"),
                         (["--sensitivity", "100"], "below 100"),
                         (["--sensitivity", "-5"], "greater than 0"),
                         (["--sensitivity", "nan"], "--sensitivity nan")):
        assert main(SMALL + extra) == 2, extra
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and words in err, err
