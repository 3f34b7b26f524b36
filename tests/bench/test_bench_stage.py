"""CPU smoke tests of the stage benchmark (bench/stage_bench.py), its loopback transport and the GPU-check report.

The benchmark itself targets an H200; here it runs its exact code path at a tiny shape: a DualPipeV middle
rank's lowered action list with every boundary replaced by a local hand-off, n = 1 and n = 4 (recompute),
recorder spans, and the cost model's H200 prediction of the same actions.
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
import torch

from _bench_helpers import load_bench
from configs import eq20_block_size

ROOT = Path(__file__).resolve().parents[2]


_load = load_bench


@pytest.fixture(scope="module")
def stage_mod():
    return _load("stage_bench")


@pytest.fixture(scope="module")
def small_run(stage_mod, tmp_path_factory):
    out = tmp_path_factory.mktemp("stage") / "stage.json"
    rc = stage_mod.main(["--device", "cpu", "--small", "--warmup", "1", "--steps", "2", "--out", str(out)])
    assert rc == 0
    return json.loads(out.read_text())


def test_small_run_measures_every_action_kind(small_run):
    v1, v4 = small_run["variants"]["n1"], small_run["variants"]["n4"]
    for v in (v1, v4):
        m = v["measured"]
        # rank 1 of DualPipeV P=4, M=8: 10 F, 4 B, 6 I, 6 W, 6 FB per step (F/B halves of an FB not counted)
        assert m["kind_count_per_step"]["F"] == 10 and m["kind_count_per_step"]["B"] == 4
        assert m["kind_count_per_step"]["I"] == 6 and m["kind_count_per_step"]["W"] == 6
        assert m["kind_count_per_step"]["FB"] == 6
        assert len(m["step_ms"]) == 2 and all(t > 0 for t in m["step_ms"])
        # every boundary went through the loopback: 16 RECV_F + 16 RECV_B and as many sends per step (3 steps)
        assert m["loopback"] == {"sends": 3 * 32, "recvs": 3 * 32}
        assert m["stages"] == [1, 6] and m["hp_spans"] > 0
    # the prediction prices the recompute block the runtime ran: Eq. 20 over a stage's 2 sub-layers
    assert v1["measured"]["recompute_block"] is None and v1["rc_assumed"] is None
    assert v4["measured"]["recompute_block"] == v4["rc_assumed"] == eq20_block_size(2, 4) == 1
    assert not [note for note in small_run["notes"] if "the prediction assumed" in note], small_run["notes"]
    assert "RC" in v4["measured"]["kind_ms"] and "RC" not in v1["measured"]["kind_ms"]


def test_small_run_prediction_and_overhead(small_run):
    v1, v4 = small_run["variants"]["n1"], small_run["variants"]["n4"]
    for v in (v1, v4):
        p = v["predicted"]
        assert p["hardware"] == "h200" and p["recv_copies"] == 32
        assert set(p["kind_us"]) >= {"F", "B", "I", "W", "FB"}
        assert all(t > 0 for t in p["kind_us"].values())
        assert p["step_us"] == pytest.approx(p["compute_us"] + 32 * p["recv_copy_us"])
    o = small_run["overhead"]
    assert o["predicted_pct"] == pytest.approx(100 * (v4["predicted"]["step_us"] / v1["predicted"]["step_us"] - 1))
    assert o["diff_pp"] == pytest.approx(o["predicted_pct"] - o["measured_pct"])
    assert small_run["targets"]["overhead_ok"].startswith("n/a")  # CPU: no GPU targets claimed


def test_small_run_measured_overhead_agrees_with_the_wall_clock(small_run):
    """The measured overhead, from the recorder's step spans, against a second clock: the wall time the benchmark
    took around each step (time.perf_counter, outside the recorder). A span lies inside its wall time, the two
    give the same overhead within a few per cent of the step ratio, and mHC (n = 4: four streams, 20 Sinkhorn
    rounds, unfused kernels) is slower than the plain residual."""
    v1, v4 = (small_run["variants"][k]["measured"] for k in ("n1", "n4"))
    for m in (v1, v4):
        assert len(m["wall_ms"]) == len(m["step_ms"]) == 2
        assert all(0.5 * w <= s <= w for s, w in zip(m["step_ms"], m["wall_ms"])), (m["step_ms"], m["wall_ms"])
        assert m["step_ms_median"] == pytest.approx(statistics.median(m["step_ms"]))
    spans = statistics.median(v4["step_ms"]) / statistics.median(v1["step_ms"])
    wall = statistics.median(v4["wall_ms"]) / statistics.median(v1["wall_ms"])
    o = small_run["overhead"]
    assert o["measured_pct"] == pytest.approx(100 * (spans - 1))
    assert spans == pytest.approx(wall, rel=0.05), (spans, wall)
    assert o["measured_pct"] > 20, o  # measured here: +480% to +790% per round
    # per round: the two variants' steps of that round, n = 4 over n = 1
    assert o["paired_pct"] == pytest.approx([100 * (b / a - 1) for a, b in zip(v1["step_ms"], v4["step_ms"])])


def test_full_shape_prediction_runs_without_gpu(stage_mod, tmp_path):
    out = tmp_path / "pred.json"
    assert stage_mod.main(["--predict-only", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["shape"] == {"ranks": 4, "rank": 1, "stages": [1, 6], "blocks_per_stage": 3, "T": 4096, "C": 2560,
                            "heads": 32, "head_dim": 128, "mlp_hidden": 12288, "dtype": "bfloat16", "M": 8,
                            "num_blocks": 24}
    v4 = res["variants"]["n4"]["predicted"]
    assert v4["boundary_bytes"] == 4096 * 4 * 2560 * 2  # 84 MB: one n=4 boundary at this shape (gpu.md §6)
    # Eq. 20 over the stage's 6 sub-layers, as the runtime cuts it: 4*ceil(6/2) + 6*2 = 24 is the minimum
    assert v4["recompute_block"] == eq20_block_size(6, 4) == 2 and math.isfinite(res["overhead"]["predicted_pct"])
    assert "measured" not in res["variants"]["n1"]


def test_write_config_is_a_valid_run_config(stage_mod, tmp_path):
    from configs import load_config

    path = tmp_path / "two.yaml"
    assert stage_mod.main(["--device", "cuda", "--write-config", str(path), "--config-ranks", "2"]) == 0
    cfg = load_config(path)
    assert cfg.parallel.ranks == 2 and cfg.parallel.microbatches == 4 and cfg.model.num_blocks == 4
    assert (cfg.model.hidden, cfg.model.num_heads, cfg.model.head_dim, cfg.model.mlp_hidden) == (2560, 32, 128, 12288)
    assert cfg.model.moe is None and cfg.train.device == "cuda" and cfg.recompute.mode == "auto"


def test_bad_flags_fail_with_a_clear_message(stage_mod, capsys):
    with pytest.raises(SystemExit):
        stage_mod.main(["--rank", "4"])
    assert "outside the 4 ranks" in capsys.readouterr().err


def test_loopback_transport_rejects_a_wrong_buffer():
    from pipeline.distributed.loopback import LoopbackTransport

    loop = LoopbackTransport(1, torch.device("cpu"), (4, 2, 8), torch.float32)
    buf = torch.empty(4, 2, 8)
    (p,) = loop.post([(False, "RECV_F/s0/mb0", 0, buf)])
    assert p.done and torch.equal(loop.wait(p), loop.activation) and p.tensor is buf
    (q,) = loop.post([(True, "SEND_F/s1/mb0", 2, buf)])
    assert q.done and loop.poll(q)
    with pytest.raises(ValueError, match="boundary_shape"):
        loop.post([(False, "RECV_B/s2/mb0", 2, torch.empty(4, 1, 8))])
    with pytest.raises(ValueError, match="cannot tell"):
        loop.post([(False, "X/s2/mb0", 2, buf)])


def test_gpu_report_table_marks_failures(tmp_path):
    report = _load("gpu_report")
    (tmp_path / "status.tsv").write_text("env\t0\t3.2\t60\tenv.log\nstage\t124\t130.0\t130\tstage.log\n"
                                         "pipeline_2rank\tskip\t0\t0\tpipeline_2rank.log\n")
    (tmp_path / "stage.log").write_text("building\n")
    text, ok = report.table(tmp_path)
    assert not ok
    lines = text.splitlines()
    assert "TIMEOUT" in lines[2] and "building" in lines[2] and "SKIP" in lines[3]

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert not summary["ok"] and [r["status"] for r in summary["steps"]] == ["ok", "TIMEOUT", "SKIP"]


def test_gpu_report_resume_check(tmp_path):
    """The world1_nccl step's verdict: the resumed run's losses against the uninterrupted run's, step by step."""
    report = _load("gpu_report")
    line = "step {k}/3  loss {v}  step_time 5.0 ms  tokens/s 1  peak_act -  peak_mem 1.0 MiB\n"
    full = tmp_path / "full.log"
    full.write_text("".join(line.format(k=k, v=v) for k, v in ((1, 5.729753), (2, 5.738761), (3, 5.708213))))
    good, bad, empty = tmp_path / "good.log", tmp_path / "bad.log", tmp_path / "empty.log"
    good.write_text("launching\n" + line.format(k=3, v=5.708213))
    bad.write_text(line.format(k=3, v=5.7090))
    empty.write_text("mhcpipe: error: rank 0: ...\n")
    assert report.check_resume(full, good, 1e-5)["ok"]
    res = report.check_resume(full, bad, 1e-5)
    assert not res["ok"] and "step 3: resumed loss 5.709" in res["problems"][0]
    assert not report.check_resume(full, empty, 1e-5)["ok"]
