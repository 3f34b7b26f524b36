"""`mhcpipe predict --sensitivity`: the tornado's base is the plain prediction, every input moves as documented
(integers to valid neighbours), rows are sorted by swing, and physics holds (faster HBM, or faster mHC kernels
alone, never raises mHC's overhead)."""
import json
import math

import pytest

from costmodel.physics.hardware import Curve, get_hardware
from costmodel.answers.predict import predict, residual_spec_of
from costmodel.pricing.pricer import MHC_GROUPS
from costmodel.pricing.options import Options
from costmodel.answers.sensitivity import (
    ASSUMED, CHOICES, MEASURED, check_pct, format_sensitivity, moves, sensitivity, to_json
)
from configs import load_config
from mhcpipe.cli import main

H800 = get_hardware("h800")


@pytest.fixture(scope="module")
def se(small_cfg):
    return sensitivity(small_cfg, H800, residual_spec_of(small_cfg), Options(), 20.0)


def test_base_is_the_plain_prediction(small_cfg, se):
    plain = predict(small_cfg, H800, residual_spec_of(small_cfg), Options(), ladder=False).summary
    assert se.base.step_pct == plain["step_overhead_pct"] and se.base.fb_pct == plain["fb_stage_overhead_pct"]


def test_faster_hbm_never_raises_the_overhead(se):
    hbm = next(r for r in se.rows if r.name.startswith("HBM"))
    for metric in ("step_pct", "fb_pct"):
        lo, base, hi = (getattr(p, metric) for p in (hbm.low, se.base, hbm.high))
        assert hi <= base <= lo, (metric, lo, base, hi)


def _top(c: Curve) -> float:
    return max(e for _, e in c.points)


def test_faster_mhc_kernels_never_raise_the_overhead(small_cfg, se):
    """The tornado's mHC-kernel row: its slower side raises both overheads, its faster side lowers them; and over a
    sweep of flat mHC-kernel efficiencies (TileLang-like 0.4 to peak) the overhead only falls as they rise."""
    row = next(r for r in se.rows if r.name == "mHC kernel bandwidth")
    for metric in ("step_pct", "fb_pct"):
        lo, base, hi = (getattr(p, metric) for p in (row.low, se.base, row.high))
        assert lo > base > hi, (metric, lo, base, hi)
    spec = residual_spec_of(small_cfg)
    for opts in (Options(), Options(recompute=False, hp_stream=False)):
        prev = None
        for eff in (0.4, 0.6, 0.8, 1.0):
            hw = H800.model_copy(update={"mhc_memory_eff": Curve(unit="MB", points=[(0, eff)])})
            s = predict(small_cfg, hw, spec, opts, ladder=False).summary
            now = (s["step_overhead_pct"], s["fb_stage_overhead_pct"])
            if prev is not None:
                assert now[0] < prev[0] and now[1] < prev[1], (opts, eff, prev, now)
            prev = now


def test_mhc_kernel_curve_moves_mhc_and_never_the_baseline(small_cfg):
    """None means the memory curve (the same prediction as setting it explicitly). The curve prices mHC's own
    kernels and their recompute only: the plain residual's add and norm rebuild (groups mhc / recompute in
    mhc_cost.py) stay on the memory curve, so the baseline's step never moves, with or without recompute."""
    spec = residual_spec_of(small_cfg)
    same = predict(small_cfg, H800.model_copy(update={"mhc_memory_eff": H800.memory_eff}), spec, Options(),
                   ladder=False).summary
    plain = predict(small_cfg, H800, spec, Options(), ladder=False)
    assert same["iteration_us"] == plain.summary["iteration_us"]
    slow_hw = H800.model_copy(update={"mhc_memory_eff": Curve(unit="MB", points=[(0, 0.4)])})
    for opts in (Options(), Options(recompute=False)):
        fast = plain if opts == Options() else predict(small_cfg, H800, spec, opts, ladder=False)
        slow = predict(small_cfg, slow_hw, spec, opts, ladder=False)
        pf, ps = fast.pricers["mhc"], slow.pricers["mhc"]
        for st in pf.layout:
            ops_f = pf.forward_ops(st) + pf.backward_ops(st, with_w=True)
            ops_s = ps.forward_ops(st) + ps.backward_ops(st, with_w=True)
            moved = {o.name for o, q in zip(ops_f, ops_s) if o.duration != q.duration}
            assert moved and moved <= {o.name for o in ops_f if o.group in MHC_GROUPS}, (st, moved)
        it_f, it_s = fast.summary["iteration_us"], slow.summary["iteration_us"]
        assert it_s["baseline"] == it_f["baseline"] and it_s["mhc"] > it_f["mhc"]


def test_inputs_move_as_documented(small_cfg):
    by = {name: sides for name, _, sides in moves(small_cfg, H800, 20.0)}
    (_, _, lo), (_, _, hi) = by["HBM bandwidth TB/s"]
    assert math.isclose(lo.hbm_bandwidth, 0.8 * H800.hbm_bandwidth) and math.isclose(hi.hbm_bandwidth,
                                                                                       1.2 * H800.hbm_bandwidth)
    assert lo.intra == H800.intra and lo.matrix_eff == H800.matrix_eff  # one input at a time
    (_, _, lo), (_, _, hi) = by["inter-node bandwidth GB/s"]
    assert math.isclose(hi.inter.bandwidth, 1.2 * H800.inter.bandwidth) and hi.intra == H800.intra
    (_, _, lo), (_, _, hi) = by["GEMM efficiency"]
    top = max(e for _, e in H800.matrix_eff.points)
    assert math.isclose(max(e for _, e in lo.matrix_eff.points), 0.8 * top)
    assert math.isclose(max(e for _, e in hi.matrix_eff.points), 1.2 * top)
    (_, _, lo), (_, _, hi) = by["mHC kernel bandwidth"]  # the memory curve's shape at -+20% of its top, capped at 1
    assert lo.mhc_memory_eff.points == H800.memory_eff.scaled(0.8 * _top(H800.memory_eff)).points
    assert _top(hi.mhc_memory_eff) == 1.0 and 1.2 * _top(H800.memory_eff) > 1
    for side in (lo, hi):  # only the mHC kernels' curve moves
        assert side.memory_eff == H800.memory_eff and side.hbm_bandwidth == H800.hbm_bandwidth
        assert side.matrix_eff == H800.matrix_eff
    cutile = H800.model_copy(update={"mhc_memory_eff": Curve(unit="MB", points=[(0, 0.8)])})
    lo, hi = ({n: s for n, _, s in moves(small_cfg, cutile, 20.0)}["mHC kernel bandwidth"])
    assert math.isclose(_top(lo[2].mhc_memory_eff), 0.64) and math.isclose(_top(hi[2].mhc_memory_eff), 0.96)
    a100 = get_hardware("a100")  # Calculon's A100 curve tops at 0.95: +20% is capped at peak
    hi = {n: s for n, _, s in moves(small_cfg, a100, 20.0)}["GEMM efficiency"][1][2]
    assert max(e for _, e in hi.matrix_eff.points) == 1.0
    # EP 8 of 64 experts on D = 8 replicas: 4 below, nothing above (EP must divide D); M 64 = 8 per replica on
    # DualPipe P=4: the neighbouring counts the generator and the layout accept
    low, high = by["EP"]
    assert low[1].parallel.expert_parallel == 4 and high is None
    low, high = by["M (micro-batches)"]
    M0 = small_cfg.parallel.microbatches
    assert low is None and high[1].parallel.microbatches > M0  # DualPipe needs M >= 2P = 8 per replica
    for m in [*range(1, M0), *range(M0 + 1, high[1].parallel.microbatches)]:
        with pytest.raises(ValueError):
            load_config("paper-3b", {"parallel": {"ranks": 4, "microbatches": m, "expert_parallel": 8}})
    assert [c.model.hidden for _, c, _ in by["C (hidden)"]] == [1024, 1536]
    for _, c, _ in by["C (hidden)"]:  # only C moved
        assert c.parallel == small_cfg.parallel and c.model.mlp_hidden == small_cfg.model.mlp_hidden


def test_integer_inputs_keep_only_valid_sides():
    """72 experts (paper-27b) at EP 8: the next power of two above that divides 72 does not exist."""
    cfg = load_config("paper-27b")
    by = {name: sides for name, _, sides in moves(cfg, H800, 20.0)}
    assert by["EP"][0][1].parallel.expert_parallel == 4 and by["EP"][1] is None
    # DualPipe: even M per replica, 24 -> 22 and 26 on each of the 8 replicas
    assert [s[1].parallel.microbatches for s in by["M (micro-batches)"]] == [176, 208]
    dense = {name for name, _, _ in moves(load_config("tiny"), H800, 20.0)}
    assert "EP" not in dense


def test_rows_sorted_by_swing_and_measure_first_is_a_hardware_input(se):
    swings = [r.swing(se.metric, se.base) for r in se.rows]
    assert swings == sorted(swings, reverse=True) and swings[0] > 0
    first = se.measure_first()
    assert first.name in MEASURED
    assert first.swing(se.metric, se.base) == max(r.swing(se.metric, se.base) for r in se.rows if r.name in MEASURED)


@pytest.mark.parametrize("bad", [0, -1, 100, 150, float("nan")])
def test_bad_percentages(bad):
    with pytest.raises(ValueError, match="--sensitivity"):
        check_pct(bad)


def test_cli_sensitivity_writes_table_tornado_and_json(tmp_path, capsys):
    png, js = tmp_path / "t.png", tmp_path / "t.json"
    argv = ["predict", "--preset", "paper-3b", "--pp", "4", "--microbatches", "64", "--ep", "8",
            "--sensitivity", "10", "-o", str(png), "--json", str(js)]
    assert main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "measure this first:" in out and png.stat().st_size > 10_000
    data = json.loads(js.read_text())
    assert data["pct"] == 10 and data["measure_first"] in MEASURED
    # paper-3b trains in bf16: no FP8 GEMM row
    assert {r["input"] for r in data["rows"]} == set(MEASURED + CHOICES + ASSUMED) - {"FP8 GEMM efficiency"}


def test_memory_is_reported_and_moves_with_the_layout_not_the_bandwidth(small_cfg, se):
    """Every point carries mHC's peak memory per GPU (predict's number); a layout input (EP, C) moves it, a
    bandwidth does not, and the JSON gives each row's memory swing."""
    plain = predict(small_cfg, H800, residual_spec_of(small_cfg), Options(), ladder=False).summary
    assert se.base.memory_gib == plain["memory_gib"]["mhc"]
    rows = {r.name: r for r in se.rows}
    assert rows["HBM bandwidth TB/s"].swing("memory_gib", se.base) == 0
    assert rows["C (hidden)"].swing("memory_gib", se.base) > 1.0 and rows["EP"].swing("memory_gib", se.base) > 0
    data = to_json(se)
    assert {r["input"]: r["swing_memory_gib"] for r in data["rows"]}["C (hidden)"] > 1.0
    assert "memory per GPU" in format_sensitivity(se)


def test_reserve_terms_move_memory_only_by_their_own_bytes(small_cfg, se):
    """The memory reserve's terms are sensitivity rows: each moves the peak by its own change (the fragmentation
    share by its share of the dynamic bytes) and never the time."""
    rows = {r.name: r for r in se.rows}
    base = se.base.memory_gib
    r = H800.reserve
    for name, term_gib in (("CUDA context GiB", r.cuda_context_bytes / 2**30), ("NCCL buffers GiB",
                                                                                r.nccl_bytes / 2**30)):
        row = rows[name]
        assert row.swing("fb_pct", se.base) == 0 and row.swing("step_pct", se.base) == 0
        assert row.low.memory_gib == pytest.approx(base - 0.2 * term_gib, rel=1e-12)
        assert row.high.memory_gib == pytest.approx(base + 0.2 * term_gib, rel=1e-12)
    frag = rows["fragmentation share"]
    assert frag.low.memory_gib < base < frag.high.memory_gib and frag.swing("step_pct", se.base) == 0


def test_more_sinkhorn_iterations_never_cost_less(se):
    row = {r.name: r for r in se.rows}["Sinkhorn iterations"]
    assert (row.low.label, row.high.label) == ("16", "24")
    assert row.low.step_pct < se.base.step_pct < row.high.step_pct


def test_attention_backward_factor_is_what_prices_the_core_backward(small_cfg, se):
    """The spec's attention_bwd_factor sets the attention core's backward FLOPs (ops.attention); a heavier
    backward makes every step longer, baseline and mHC alike, so mHC's share falls."""
    spec = residual_spec_of(small_cfg)
    cores = {}
    for f in (2.5, 3.0):
        pred = predict(small_cfg, H800.model_copy(update={"attention_bwd_factor": f}), spec, Options(), ladder=False)
        kern = [k for k in pred.pricers["mhc"]._block(False)[0][0].I if k.name == "attn.core.bwd"]
        fwd = [k for k in pred.pricers["mhc"]._block(False)[0][0].F if k.name == "attn.core"]
        assert kern[0].flops == pytest.approx(f * fwd[0].flops, rel=1e-12)
        cores[f] = pred.summary["iteration_us"]["baseline"]
    assert cores[3.0] > cores[2.5]
    row = {r.name: r for r in se.rows}["attention backward factor"]
    assert row.high.fb_pct < se.base.fb_pct < row.low.fb_pct
