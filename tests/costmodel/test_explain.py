"""`mhcpipe predict --explain`: the ladder's rungs are consistent (one switch each, the last one the plain
prediction), each rung moves what its mechanism moves, the step anatomy adds up, and the CLI's bad input is one
line."""
import dataclasses
import json
import math

import pytest

from costmodel.answers.explain import MECHANISMS, explain, format_explain, ladder_steps, pairs_by_rung, to_json
from costmodel.answers.honest import (CALCULON_GEMM, CUTILE, CUTILE_MHC_EFF, MEMORY_CURVE, PAPER_PCT, SPEC_GEMM,
                                      Variant, discriminators, honest_variants, honest_verdict)
from costmodel.physics.hardware import get_hardware
from costmodel.physics.mhc_cost import ResidualSpec
from costmodel.answers.predict import predict, residual_spec_of
from costmodel.pricing.options import Options
from costmodel.simulation.step_anatomy import (RESIDUAL_GROUPS, _stage_residual_bytes, critical_path_summary,
                                               residual_bytes, stage_residual_kernels)
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
    # every rung on the caller's placement (EP 8 fits a node of 8); the other placement is a stated assumption
    assert all(o.ep_per_node == opts.ep_per_node for _, _, _, o in steps)
    assert "every rung uses EP 8 inside one node" in note and "EP 8 over 2 nodes (4 per node)" in note
    for (_, _, s0, o0), (name, _, s1, o1) in zip(steps, steps[1:]):
        a, b = _switches(s0, o0), _switches(s1, o1)
        changed = [k for k in a if a[k] != b[k]]
        assert len(changed) <= 1, (name, changed)
    # the caller's options with the single actions' mode made explicit: the same prediction
    assert steps[-1][2] == spec and steps[-1][3] == dataclasses.replace(opts, single_mode=opts.single_action_mode)
    # the switches the caller leaves at the naive value make their rung a no-op
    assert len({(s, o) for _, _, s, o in steps}) == (len(steps) - (opts.fb_mode == "serial") - (not opts.hp_stream)
                                                     - (opts.single_action_mode == "serial"))


def test_last_rung_is_the_plain_prediction(small_cfg, ex):
    plain = predict(small_cfg, H800, residual_spec_of(small_cfg), Options(), ladder=False).summary
    last = ex.rungs[-1].summary
    assert last["step_overhead_pct"] == plain["step_overhead_pct"]
    assert last["fb_stage_overhead_pct"] == plain["fb_stage_overhead_pct"]
    assert last["iteration_us"] == plain["iteration_us"]
    # the ladder's last row, as printed, is predict's headline to 0.01 pp (its own share of its own baseline)
    assert abs(ex.share_pct(ex.rungs[-1]) - plain["fb_stage_overhead_pct"]) < 0.01
    assert abs(ex.step_share_pct(ex.rungs[-1]) - plain["step_overhead_pct"]) < 0.01
    # one decomposition: the last rung's split of the step overhead is predict's own, term by term, and adds up
    full = predict(small_cfg, H800, residual_spec_of(small_cfg), Options(), ladder=True).summary["breakdown_pp"]
    assert last["breakdown_pp"] == full
    assert abs(sum(full.values()) - plain["step_overhead_pct"]) < 1e-9
    assert to_json(ex)["headline_breakdown_pp"] == full
    assert f"split as `predict` splits it: kernel traffic {full['kernel_traffic']:+.2f}" in format_explain(ex)


def test_each_mechanism_is_shown_where_it_pays_per_pair_kind(ex):
    """Per pair kind, the alone overhead at every rung and each mechanism's change between its two rungs: fused
    kernels cut every pair's overhead, recompute adds to it, and the last column is the last rung's pair table."""
    rows = pairs_by_rung(ex)
    last = {f"{p['f_stage']}/{p['b_stage']}": p for p in ex.rungs[-1].summary["fb_pairs"]}
    assert rows and {r["pair"] for r in rows} == set(last)
    for r in rows:
        pct = r["alone_pct_by_rung"]
        assert len(pct) == len(ex.rungs) and pct[-1] == last[r["pair"]]["alone_pct"]
        for name, a, b in MECHANISMS:
            assert r["mechanisms_pp"][name] == pytest.approx(pct[a] - pct[b], abs=1e-12)
        assert r["mechanisms_pp"]["fused kernels"] < 0 < r["mechanisms_pp"]["recompute"]
    text = format_explain(ex)
    assert "where each mechanism pays, per pair kind" in text and "hp stream" in text


def test_rungs_move_what_their_mechanism_moves(ex):
    naive, fused, rc, singles, ovl = ex.rungs[:5]
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


def test_one_denominator_for_every_rung_and_one_change_per_rung(small_cfg, ex):
    """Every rung's share is the ms mHC adds over its own baseline divided by the last rung's baseline F&B stage:
    the last rung's share is the headline; stream pricing of single actions leaves every pair's price alone, and
    the pair overlap leaves every single action's."""
    final = ex.rungs[-1]
    D = final.summary["fb_stage_us"]["baseline"]
    assert ex.on_fb_stage and ex.denominator_us == D
    for r in ex.rungs:
        fb = r.summary["fb_stage_us"]
        assert math.isclose(ex.share_pct(r), 100 * (fb["mhc"] - fb["baseline"]) / D, rel_tol=1e-12)
    assert math.isclose(ex.share_pct(final), final.fb_pct, rel_tol=1e-9)
    rc, singles, ovl = ex.rungs[2:5]
    assert singles.change.startswith("F, I, W, B priced as single_mode='streams'")
    for name in ("baseline", "mhc"):
        alone = lambda r: [p["alone_us"][name] for p in r.summary["fb_pairs"]]  # noqa: E731
        assert alone(singles) == alone(rc)  # pairs still serial
        assert alone(ovl) != alone(singles)
        for kind in ("F", "I", "W", "B"):
            if kind in singles.summary["op_us"][name]:
                assert ovl.summary["op_us"][name][kind] == singles.summary["op_us"][name][kind]
    assert singles.summary["op_us"]["mhc"] != rc.summary["op_us"]["mhc"]


def test_the_headline_is_the_fb_stage_as_the_step_runs_it(small_cfg):
    """fb_stage_overhead_pct: every pair as often as the schedule runs it and as long as the simulation ran it
    (late inputs included), per rank; the per-kind table adds up to it."""
    pred = predict(small_cfg, H800, ladder=False)
    s = pred.summary
    for name, sim in (("baseline", pred.baseline), ("mhc", pred.mhc)):
        spans = [sp for sp in sim.trace.spans if sp.kind == "FB"]
        ranks = {sp.rank for sp in spans}
        assert math.isclose(s["fb_stage_us"][name], sum(sp.duration for sp in spans) / len(ranks), rel_tol=1e-12)
        from_table = sum(p["count"] * p["as_run_us"][name] for p in s["fb_pairs"]) / len(ranks)
        assert math.isclose(from_table, s["fb_stage_us"][name], rel_tol=1e-9)
        n_pairs = sum(a.kind.value == "FB" for acts in pred.schedule.actions for a in acts)
        assert sum(p["count"] for p in s["fb_pairs"]) == n_pairs == len(spans) > 0
        for p in s["fb_pairs"]:  # a pair as run waits for its later input: never shorter than alone
            assert p["as_run_us"][name] >= p["alone_us"][name] * (1 - 1e-12)
    assert math.isclose(s["fb_stage_overhead_pct"],
                        100 * (s["fb_stage_us"]["mhc"] / s["fb_stage_us"]["baseline"] - 1), rel_tol=1e-12)


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
    assert len({v.ep_layout for v in vs}) == 2 and len(vs) == 16  # 7 per hardware + the other GEMM precision
    # GEMMs on Calculon's curve once per hardware, at the caller's placement: faster GEMMs, a larger share for mHC
    for h in ("h800", "h200"):
        calc = [v for v in vs if v.hardware == h and v.gemm == CALCULON_GEMM]
        assert len(calc) == 1 and calc[0].sigma == 0 and calc[0].ep_layout == "EP 8 inside one node"
        twin = next(v for v in vs if v.hardware == h and v.gemm == SPEC_GEMM and v.sigma == 0 and v.dispatcher ==
                    "DeepEP" and v.ep_layout == calc[0].ep_layout and v.mhc_kernels == calc[0].mhc_kernels)
        assert calc[0].fb_pct > twin.fb_pct
    # the placement over nodes once more with the other dispatcher: every token copy on the network costs more
    # network time than DeepEP's once per remote node (the pair's overlap decides what that does to the overhead)
    for h in ("h800", "h200"):
        a2a = [v for v in vs if v.hardware == h and v.dispatcher == "all-to-all"]
        assert len(a2a) == 1 and "nodes" in a2a[0].ep_layout and a2a[0].sigma == 0
        twin = next(v for v in vs if v.hardware == h and v.dispatcher == "DeepEP" and v.sigma == 0
                    and v.ep_layout == a2a[0].ep_layout and v.mhc_kernels == a2a[0].mhc_kernels)
        assert twin.fb_pct != a2a[0].fb_pct
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
        assert (v.step_pct, v.fb_pct) == (s["step_overhead_pct"], s["fb_stage_overhead_pct"])
    # sigma slows the compute under the all-to-all for the baseline and mHC alike; the other switches move it too
    assert len({round(v.step_pct, 9) for v in vs}) > 1
    for v in vs:
        assert v.gap_pp == v.fb_pct - PAPER_PCT
    # every assumption of the sets separates some pair of them, and the answer says by how much
    assert {d.assumption for d in discriminators(vs)} == {"hardware", "EP layout", "sigma", "mHC kernels",
                                                          "dispatcher", "GEMM efficiency", "GEMM precision"}


def test_verdict_reports_the_span_and_what_separates_the_sets():
    sets = [Variant("h200", "EP a", 0.0, 7.0, 5.0), Variant("h200", "EP a", 0.15, 7.0, 6.0),
            Variant("h200", "EP b", 0.0, 7.0, 9.0), Variant("h200", "EP b", 0.15, 7.0, 10.0),
            Variant("h200", "EP a", 0.0, 9.0, 5.5, CUTILE)]
    v = honest_verdict(sets)
    assert v.startswith("the 5 assumption sets span 5.00-10.00% of the F&B stage") and "lies inside it" in v
    assert "closest: h200, EP a, DeepEP, GEMMs spec curve in bf16, sigma 0.15, memory curve, -0.70 pp" in v
    assert "pp below it" in honest_verdict([Variant("h800", "x", 0.0, 9.0, 8.0)])
    assert "pp above it" in honest_verdict([Variant("h800", "x", 0.0, 9.0, 3.0)])
    d = {x.assumption: x for x in discriminators(sets)}
    assert math.isclose(d["EP layout"].mean_pp, 4.0) and d["EP layout"].pairs == 2  # (5, 9) and (6, 10)
    assert math.isclose(d["sigma"].mean_pp, 1.0) and d["sigma"].pairs == 2
    assert math.isclose(d["mHC kernels"].mean_pp, 0.5) and d["mHC kernels"].pairs == 1
    assert "hardware" not in d and [x.assumption for x in discriminators(sets)][0] == "EP layout"


def test_explain_refuses_the_baseline(small_cfg):
    with pytest.raises(ValueError, match="no mHC overhead"):
        explain(small_cfg, H800, ResidualSpec.baseline(), Options(), honest=False)


SMALL = ["predict", "--preset", "paper-3b", "--pp", "4", "--microbatches", "64", "--ep", "8"]


def test_cli_explain_writes_table_waterfall_and_json(tmp_path, capsys):
    png, js = tmp_path / "w.png", tmp_path / "w.json"
    assert main(SMALL + ["--explain", "-o", str(png), "--json", str(js)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "of the overlapped F&B stage" in out.splitlines()[1] and "honest answer" in out
    assert png.stat().st_size > 10_000
    data = json.loads(js.read_text())
    assert [r["name"] for r in data["rungs"]][0] == "naive eager" and len(data["honest_answer"]["variants"]) == 16


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
