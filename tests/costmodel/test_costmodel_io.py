"""Bad input, the CLI, hardware specs, calibration, overlap mechanics and trace naming."""
import json
import math
import statistics

import pytest
import yaml

from costmodel.fitting.calibrate import calibrate_local, measure_p2p
from costmodel.physics.hardware import BUILTIN, Curve, HardwareSpec, get_hardware, hardware_names
from costmodel.pricing.fb_overlap import TimedOp, overlap
from costmodel.answers.predict import Options, predict
from mhcpipe.cli import main
from configs import CONFIG_DIR, load_config, presets
from traces.analysis.compare import compare


def test_unknown_hardware_lists_names():
    with pytest.raises(ValueError) as err:
        get_hardware("h900")
    for name in ("h800", "h100", "h200", "b200", "a100", "local"):
        assert name in str(err.value)


def test_predict_leaves_the_collector_as_it_found_it():
    """predict pauses the cyclic garbage collector while it runs (costmodel/answers/predict.py): on, it is on again
    after, also after an error; off (a caller's choice), it stays off."""
    import gc

    cfg = load_config("paper-27b", {"parallel": {"ranks": 8, "microbatches": 128}})
    was = gc.isenabled()
    try:
        gc.enable()
        predict(cfg, "h800", options=Options(allow_uneven=True), ladder=False)
        assert gc.isenabled()
        with pytest.raises(ValueError):
            predict(cfg, "h800")  # uneven stages refused
        assert gc.isenabled()
        gc.disable()
        predict(cfg, "h800", options=Options(allow_uneven=True), ladder=False)
        assert not gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()


def test_uneven_layers_rejected_unless_allowed():
    cfg = load_config("paper-27b", {"parallel": {"ranks": 8, "microbatches": 128}})
    with pytest.raises(ValueError, match="do not divide evenly.*--uneven.*uneven_stages"):
        predict(cfg, "h800")
    pred = predict(cfg, "h800", options=Options(allow_uneven=True), ladder=False)
    assert pred.summary["step_overhead_pct"] > 0


@pytest.mark.parametrize("preset", presets())
def test_every_preset_predicts_as_shipped(preset, capsys):
    """`mhcpipe predict --preset X --hardware h800` with no layout flags: a shipped preset must carry a layout the
    cost model accepts (v4-flash's 43 and v4-pro's 61 blocks need parallel.uneven_stages)."""
    assert main(["predict", "--preset", preset, "--hardware", "h800"]) == 0, capsys.readouterr().err
    assert "mHC overhead:" in capsys.readouterr().out


def test_uneven_stages_in_the_config_is_the_flag():
    cfg = load_config("paper-27b", {"parallel": {"ranks": 8, "microbatches": 128}})
    by_flag = predict(cfg, "h800", options=Options(allow_uneven=True), ladder=False)
    by_config = predict(cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update={"uneven_stages": True})}),
                        "h800", ladder=False)
    assert by_config.summary["iteration_us"] == by_flag.summary["iteration_us"]


def test_cli_errors_are_one_line(capsys):
    for argv, words in ((["predict", "--preset", "nope"], "choose one of"),
                        (["predict", "--preset", "tiny", "--hardware", "x"], "h800"),
                        (["predict", "--preset", "paper-27b", "--microbatches", "32"], "at least 12"),
                        (["predict", "--preset", "paper-27b", "--pp", "8"], "--uneven"),
                        (["predict", "--preset", "paper-27b", "--variant", "xhc", "--n", "16"], "k"),
                        (["predict", "--preset", "paper-27b", "--pp", "7"], "even number of pipeline ranks"),
                        (["predict", "--preset", "tiny", "--ep", "8"], "no MoE"),
                        (["predict", "--preset", "tiny", "--sigma", "nan"], "--sigma"),
                        (["predict", "--preset", "tiny", "--sigma", "-1"], "--sigma"),
                        (["predict", "--preset", "tiny", "--sweep", "n=3..1"], "1..3"),
                        (["predict", "--preset", "tiny", "--sweep", "n=1.5"], "integers"),
                        (["predict", "--preset", "tiny", "--sweep", "bw=nan"], "finite positive"),
                        (["predict", "--preset", "tiny", "--variant", "mhc-lite", "--sweep", "n=3..5"], "n <= 4"),
                        (["predict", "--preset", "tiny", "--json", ""], "--json: empty path")):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and words in err, err


def test_cli_bad_files_are_one_line(tmp_path, capsys):
    """Output paths are refused before the work; broken hardware profiles and config sections name the field."""
    zero = tmp_path / "zero.json"
    zero.write_text(get_hardware("h800").model_copy(update={"peak_flops": {"bf16": 0.0}}).model_dump_json())
    (tmp_path / "broken.json").write_text("{not json")
    cfg = yaml.safe_load((CONFIG_DIR / "tiny.yaml").read_text())
    cfg["parallel"] = None  # `parallel:` with nothing under it
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    (tmp_path / "sub").mkdir()
    for argv, words in ((["--json", str(tmp_path / "sub")], "is a directory"),
                        (["--trace-out", str(tmp_path / "sub")], "is a directory"),
                        (["--hardware", str(zero)], "peak_flops"),
                        (["--hardware", str(tmp_path / "broken.json")], "not valid JSON"),
                        (["--config", str(tmp_path / "cfg.yaml"), "--pp", "4"],
                         "parallel.microbatches: Field required")):
        if argv[0] != "--config":
            argv = ["--preset", "tiny"] + argv
        assert main(["predict"] + argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and words in err, err


def test_cli_table_json_trace_and_sweep(tmp_path, capsys):
    out = tmp_path / "p.json"
    trace = tmp_path / "t.json"
    assert main(["predict", "--preset", "paper-3b", "--pp", "4", "--microbatches", "64", "--json", str(out),
                 "--trace-out", str(trace)]) == 0
    text = capsys.readouterr().out
    assert "mHC overhead" in text and "add --breakdown" in text and "recompute block" in text
    data = json.loads(out.read_text())
    assert data["step_overhead_pct"] > 0 and "memory_per_rank" in data and data["breakdown_pp"] is None
    assert trace.exists() and (tmp_path / "t.baseline.json").exists()
    png = tmp_path / "s.png"
    assert main(["predict", "--preset", "paper-3b", "--pp", "4", "--microbatches", "64", "--sweep", "n=1..3",
                 "-o", str(png)]) == 0
    assert png.stat().st_size > 1000
    assert main(["predict", "--preset", "paper-3b", "--pp", "4", "--microbatches", "64", "--sweep", "bw=10,100",
                 "-o", str(png)]) == 0


def test_predicted_traces_carry_the_schedule_names(small_cfg):
    """The baseline and mHC predictions of one schedule name their spans alike (traces.md §5), so
    traces.analysis.compare
    joins every span of one with its twin in the other, and the per-kind errors it reports are those of the
    twins' durations (here: how much longer mHC's actions are than the baseline's)."""
    pred = predict(small_cfg, "h800", ladder=False)
    kinds = {s.kind for s in pred.mhc.trace.spans}
    assert {"F", "FB", "SEND_F", "RECV_F", "SEND_B", "RECV_B"} <= kinds
    assert pred.mhc.trace.meta["schedule"]["kind"] == "dualpipe"
    cmp = compare(pred.mhc.trace, pred.baseline.trace)
    assert not cmp.unmatched_pred and not cmp.unmatched_meas and cmp.matched == len(pred.mhc.trace.spans)
    twin = {(s.rank, s.kind, s.stage, s.mb, s.partner): s.duration for s in pred.baseline.trace.spans}
    for k in cmp.kinds:
        errs = [(s.duration - twin[(s.rank, s.kind, s.stage, s.mb, s.partner)]) / twin[(s.rank, s.kind, s.stage,
                                                                                        s.mb, s.partner)]
                for s in pred.mhc.trace.spans if s.kind == k.kind]
        assert k.n == len(errs) and k.signed_median_pct == pytest.approx(100 * statistics.median(errs)), k.kind
    by_kind = {k.kind: k for k in cmp.kinds}
    assert by_kind["F"].signed_median_pct > 0 and by_kind["SEND_F"].signed_median_pct > 0  # n-fold boundary too


def test_datasheet_rates_reach_the_documented_ceilings():
    """The roofline of a large op on a built-in spec lands on the rates hardware.py documents: the datasheet peak
    times the top of its efficiency curve (the H200 GEMM and copy ceilings measured in gpu.md §3, DeepSeek-V3's
    160 GB/s achievable NVLink on the H800, Calculon's 0.95 GEMM efficiency on the A100)."""
    h200, h800, a100 = BUILTIN["h200"], BUILTIN["h800"], BUILTIN["a100"]
    flops = 2.0 * 16384**3  # far up the matrix curve (8.8 TFLOP)
    assert flops / (h200.matmul_us(flops, 0.0) * 1e-6) == pytest.approx(790e12, rel=1e-3)
    assert flops / (a100.matmul_us(flops, 0.0) * 1e-6) == pytest.approx(0.95 * 312e12, rel=1e-3)
    copy = 8e9  # bytes, far up the memory curve
    assert copy / (h200.memory_us(copy) * 1e-6) == pytest.approx(4.3e12, rel=1e-3)
    message = 16e9
    assert message / (h800.intra.time_us(message) * 1e-6) == pytest.approx(160e9, rel=1e-3)
    # a small GEMM sits low on the curve: far below the peak, and memory-bound when its bytes dominate
    assert h200.matmul_us(2e6, 0.0) > 2e6 / 989.4e12 * 1e6 * 5
    assert h200.matmul_us(1.0, 1e9) == pytest.approx(h200.memory_us(1e9))
    c = Curve(unit="GFLOP", points=[(0, 0.1), (1, 0.6), (16, 0.9)])
    assert c(0.5) == pytest.approx(0.35) and c(100) == 0.9
    assert set(hardware_names()) >= {"h800", "h100", "h200", "b200", "a100", "local"}


def test_overlap_hides_all_to_all_and_interference_costs():
    chain = [TimedOp("a", "model", "compute", 10), TimedOp("x", "a2a", "comm", 8),
             TimedOp("b", "model", "compute", 10)]
    serial = overlap([chain, chain], "serial")
    streams = overlap([chain, chain], "streams")
    assert serial.makespan == 56 and streams.makespan < serial.makespan
    assert overlap([chain, chain], "streams", sigma=0.5).makespan > streams.makespan


def test_hp_stream_preempts_a_preemptible_kernel_and_waits_for_a_gemm():
    """Chain 0's all-to-all ends while chain 1's long kernel runs; the mHC post+res after it feeds the next
    all-to-all. On the high-priority stream it preempts the long kernel (which resumes afterwards), so the next
    all-to-all starts at once and hides under the rest of the long kernel: 1 + 10 exposed units less. A large
    cuBLAS GEMM does not yield its SMs (gpu.md §6): then the post+res waits for it either way."""
    def chains(preemptible: bool):
        c0 = [TimedOp("combine", "a2a", "comm", 3), TimedOp("post", "mhc", "hp", 1),
              TimedOp("dispatch", "a2a", "comm", 10)]
        c1 = [TimedOp("long", "model", "compute", 20, preemptible=preemptible)]
        return [c0, c1]

    with_hp = overlap(chains(True), "streams", hp=True)
    without = overlap(chains(True), "streams", hp=False)
    assert without.makespan == 31  # long 0-20, post 20-21, dispatch 21-31
    assert with_hp.makespan == 21  # post 3-4 preempts long, dispatch 4-14 under long's rest 4-21
    assert with_hp.exposed_comm < without.exposed_comm
    gemm = overlap(chains(False), "streams", hp=True)
    assert gemm.makespan == without.makespan == 31


def test_local_calibration_quick(tmp_path, monkeypatch):
    spec = calibrate_local(quick=True, p2p=False)
    assert spec.name == "local" and spec.peak_flops["fp32"] > 1e8 and spec.hbm_bandwidth > 1e8
    assert spec.launch_us > 0 and spec.host_cores >= 1
    back = HardwareSpec.load(spec.save(tmp_path / "local.json"))
    assert back == spec
    monkeypatch.setenv("MHCPIPE_LOCAL_PROFILE", str(tmp_path / "local.json"))
    pred = predict(load_config("tiny"), "local", ladder=False)
    assert pred.baseline.makespan > 0 and pred.summary["step_overhead_pct"] > 0


def test_local_p2p_sweep():
    alpha, bw, rows = measure_p2p([4096, 1 << 20], repeats=2)
    assert alpha > 0 and bw > 1e6 and len(rows) == 2


def test_sweeps_over_the_hardware_inputs(capsys, tmp_path):
    """--sweep hbm / intra / inter / sms / gap: one row per value; more HBM bandwidth lowers mHC's kernel term;
    bad values are one line."""
    base = ["predict", "--preset", "paper-3b", "--pp", "4", "--microbatches", "64", "-o", str(tmp_path / "s.png")]

    def rows(sweep: str) -> list[list[float]]:
        assert main([*base, "--sweep", sweep]) == 0
        out = capsys.readouterr().out.splitlines()
        return [[float(x.rstrip("%")) for x in ln.split()[:3]] for ln in out[1:] if ln[:1].isdigit()]

    hbm = rows("hbm=2,4")
    assert len(hbm) == 2 and hbm[1][2] < hbm[0][2]  # the kernels term (pp of the step) falls with HBM bandwidth
    for sweep in ("intra=100,400", "inter=25,100", "sms=10,30", "gap=1,4"):
        assert len(rows(sweep)) == 2, sweep
    assert main([*base, "--sweep", "sms=500"]) == 2
    assert "fewer than the h800's 132" in capsys.readouterr().err


def test_the_overhead_is_split_only_when_asked(capsys, monkeypatch):
    """The ladder (two more simulations) runs with --breakdown / predict(ladder=True) only: without it predict
    simulates the baseline and mHC runs alone, prints where the split is and writes breakdown_pp as null; with it
    the table prints the terms, which sum to the step overhead."""
    import costmodel.answers.predict as pm

    runs = []
    real = pm.Pricer.simulate
    monkeypatch.setattr(pm.Pricer, "simulate", lambda self, *a, **k: runs.append(1) or real(self, *a, **k))
    argv = ["predict", "--preset", "paper-3b", "--pp", "4", "--microbatches", "64"]
    assert main(argv) == 0
    plain = capsys.readouterr().out
    assert len(runs) == 2 and "add --breakdown" in plain and "= kernel traffic" not in plain
    assert main(argv + ["--breakdown"]) == 0
    split = capsys.readouterr().out
    assert len(runs) == 6 and "= kernel traffic" in split and "add --breakdown" not in split
    assert plain.replace("\n    split into", "\n    =").split("\n    =")[0] == split.split("\n    =")[0]
    s = predict(load_config("paper-3b"), "h800", ladder=True).summary
    assert math.isclose(sum(s["breakdown_pp"].values()), s["step_overhead_pct"], rel_tol=1e-9, abs_tol=1e-9)
