"""CPU runs of the GPU check's new steps (bench/gpu_check.sh): fb_pair_cuda (bench/gpu_pair_check.py), hp_bitwise
(bench/gpu_hp_check.py), the --gpus N mode's plumbing (bench/gpu_multi.py) and their rows in the final table.

On CPU the pair check runs the same code path on a gloo world of one rank (the threaded F&B pair over 1-rank EP
groups, loopback P2P); the hp check has no hp stream to compare (plumbing only); the multi-GPU mode is driven
with a stand-in for torchrun that prints loss lines, so no process group is started here.
"""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from _bench_helpers import load_bench

ROOT = Path(__file__).resolve().parents[2]


_load = load_bench


@pytest.fixture(scope="module")
def pair_json(tmp_path_factory):
    """One run of the pair check in its own process (it starts a process group and patches pipeline.model)."""
    d = tmp_path_factory.mktemp("fb_pair")
    out = d / "fb_pair.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_pair_check.py"), "--device", "cpu", "--small",
                           "--warmup", "1", "--steps", "1", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(out.read_text())


def test_pair_check_runs_the_threaded_pair_and_matches_serial(pair_json):
    d = pair_json
    assert d["ok"] and not d["problems"]
    assert d["backend"] == "gloo" and d["shape"]["stages"] == [0, 3] and d["shape"]["fb_pairs_per_step"] == 11
    assert d["shape"]["exchanging_stages"] == [0, 3]
    tr = d["trace"]
    # both halves ran as the threaded path names them, and the 1-rank all-to-alls really ran (and their grads)
    assert tr["overlap"]["half_spans"]["F"] > 0 and tr["overlap"]["half_spans"]["B"] > 0
    assert tr["serial"]["half_spans"] == {"F": 0, "B": 0}
    for kind in ("A2A_DISPATCH", "A2A_COMBINE", "A2A_DISPATCH.counts", "A2A_DISPATCH.dgrad", "A2A_COMBINE.dgrad"):
        assert tr["overlap"]["a2a_kinds"].get(kind, 0) > 0, tr["overlap"]["a2a_kinds"]
    assert tr["serial"]["a2a_comm_spans"] == tr["overlap"]["a2a_comm_spans"]
    assert d["max_loss_rel"] <= d["tolerance"] and d["max_grad_rel"] <= d["tolerance"]
    assert all(v > 0 for v in d["losses"]["overlap"]) and len(d["steps"]) == 2
    assert d["step_ms_median"]["overlap"] > 0 and d["step_ms_median"]["serial"] > 0


def test_hp_check_plumbing_on_cpu(tmp_path):
    hp = _load("gpu_hp_check")
    out = tmp_path / "hp.json"
    assert hp.main(["--device", "cpu", "--small", "--variants", "mhc-sp:4", "--ranks", "1", "--checks", "1",
                    "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    e = d["variants"]["mhc-sp:4"]
    assert d["ok"] and e["bitwise"] and e["deterministic"] and not d["hp_stream_exists"]
    c = e["ranks"][0]["checks"][0]["hp_vs_none"]
    # rank 1 of DualPipeV P=2, M=4 holds stages 1 and 2 (the bottom of the V: 1 -> 2 is a local hand-off): it sends
    # stage 2's 4 outputs and stage 1's 4 input-grads to rank 0
    assert c["sends"] == 8 and c["grads"] > 0 and c["equal"] == c["tensors"]


def _fake_torchrun(tmp_path: Path, loss_cuda: str = "4.000000") -> Path:
    """Stands in for `python -m torch.distributed.run ...`: prints rank 0's three step lines."""
    script = tmp_path / "fake_python"
    script.write_text("#!/bin/sh\n"
                      "case \"$*\" in *'--device cuda'*) L=" + loss_cuda + " ;; *) L=4.000000 ;; esac\n"
                      "for k in 1 2 3; do echo \"step $k/3  loss $L  step_time 1.0 ms  tokens/s 1\"; done\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_multi_gpu_plumbing_skips_and_table(tmp_path):
    mg = _load("gpu_multi")
    out = tmp_path / "multi.json"
    assert mg.main(["--gpus", "2", "--cpu", "--python", str(_fake_torchrun(tmp_path)), "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    rows = {(r["schedule"], r["pp"]): r for r in d["rows"]}
    assert len(d["rows"]) == 10 and d["counts"] == {"ok": 9, "fail": 0, "skip": 1}
    assert rows[("dualpipe", 1)]["status"] == "SKIP" and "even pp" in rows[("dualpipe", 1)]["reason"]
    assert rows[("dualpipev", 2)]["nccl"]["losses"] == [4.0, 4.0, 4.0]
    assert "+ " in Path(rows[("gpipe", 2)]["nccl"]["log"]).read_text()
    table = (tmp_path / "multi_table.txt").read_text()
    assert "1e-4" in table and "dualpipe" in table and "SKIP" in table
    # the derived configs: 3 MoE blocks in each of the schedule's stages, M = 2 P D, float64; the GPU size's stage
    # message is 16 MiB (over NCCL's 4 MiB buffers: sends rendezvous with their receives)
    lay = mg.layouts(8, ["pp", "ppdpep"])
    assert mg.stage_message_bytes("large") == 16 * 2**20 and mg.stage_message_bytes("small") < 2**20
    for schedule in mg.SCHEDULES:
        for x in lay:
            path = mg.write_config(x, tmp_path, "large", schedule)
            cfg = json.loads(path.read_text())
            stages = (2 if schedule.startswith("dualpipe") else 1) * x["pp"]
            assert cfg["model"]["num_blocks"] == 3 * stages and cfg["model"]["moe"]["first_dense_blocks"] == 0
            assert cfg["parallel"]["microbatches"] == 2 * x["pp"] * x["dp"] and cfg["train"]["dtype"] == "float64"
            assert mg.skip_reason(schedule, x, path, 8) is None


def test_multi_gpu_compare_tolerance():
    mg = _load("gpu_multi")
    rel, probs = mg.compare([4.0, 4.1, 4.2], [4.0, 4.1 * (1 + 5e-5), 4.2])
    assert not probs and 4e-5 < rel < 6e-5
    rel, probs = mg.compare([4.0, 4.1, None], [4.0, 4.2, 4.2])
    assert rel is None and any("rel" in p for p in probs) and any("no loss" in p for p in probs)


def test_report_rows_of_the_new_steps(pair_json, tmp_path):
    rep = _load("gpu_report")
    (tmp_path / "fb_pair.json").write_text(json.dumps(pair_json))
    hp = _load("gpu_hp_check")
    assert hp.main(["--device", "cpu", "--small", "--variants", "mhc:4", "--ranks", "0", "--checks", "1",
                    "--out", str(tmp_path / "hp_bitwise.json")]) == 0
    (tmp_path / "status.tsv").write_text("fb_pair_cuda\t0\t10.0\t120\tfb_pair_cuda.log\n"
                                         "hp_bitwise\t0\t5.0\t120\thp_bitwise.log\n"
                                         "multi_gpu\t1\t1.0\t100\tmulti_gpu.log\n")
    (tmp_path / "multi_gpu.log").write_text("+ python bench/gpu_multi.py\nbench/gpu_multi.py: error: no GPUs\n")
    text, ok = rep.table(tmp_path)
    assert not ok
    lines = {ln.split()[0]: ln for ln in text.splitlines()[1:]}
    assert "pairs/step threaded" in lines["fb_pair_cuda"] and " ok " in lines["fb_pair_cuda"]
    assert "mhc:4" in lines["hp_bitwise"] and "plumbing only" in lines["hp_bitwise"]
    assert "FAIL 1" in lines["multi_gpu"] and "no GPUs" in lines["multi_gpu"]


def _gpu_check(args: list[str], env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ, **(env or {})))


@pytest.mark.parametrize("mode", [[], ["--cpu"]])
def test_gpu_check_step_limits_fit_its_budget(mode):
    """Every step gets its full limit: the limits add up to less than the budget (GPU: one 8-minute device call)."""
    proc = _gpu_check(["--plan", *mode])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1].split()
    total, budget = int(last[3].rstrip("s,")), int(last[5].rstrip("s"))
    assert total <= budget and (mode or budget <= 480), last
    assert _gpu_check(["--plan", *mode], env={"GPU_CHECK_BUDGET": str(total - 1)}).returncode == 1


def test_gpu_check_reports_a_skipped_step_as_skipped(tmp_path):
    """A step the budget cannot hold is a SKIP row with its reason, and the run still ends green."""
    out = tmp_path / "gc"
    proc = _gpu_check(["--cpu"], env={"OUT": str(out), "GPU_CHECK_BUDGET": "15", "GPU_CHECK_ONLY": "stage"},
                      timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    rows = {s["step"]: s for s in json.loads((out / "summary.json").read_text())["steps"]}
    assert rows["env"]["status"] == "ok" and rows["stage"]["status"] == "SKIP", rows
    assert "budget" in rows["stage"]["result"]
    assert "1 ok, 0 failed, 1 skipped of 2 steps" in proc.stdout


def test_gpu_report_table_fails_on_a_failed_step_not_on_a_skip(tmp_path):
    rep = _load("gpu_report")
    (tmp_path / "a.log").write_text("fine\n")
    (tmp_path / "b.log").write_text("skipped: pytest is not importable\n")
    (tmp_path / "status.tsv").write_text("env\t0\t1.0\t20\ta.log\nkernel_tests\tskip\t0\t0\tb.log\n")
    text, ok = rep.table(tmp_path)
    assert ok and "pytest is not importable" in text and "1 skipped" in text
    (tmp_path / "status.tsv").write_text("env\t0\t1.0\t20\ta.log\nkernel_tests\t1\t3.0\t40\tb.log\n")
    assert rep.table(tmp_path)[1] is False
    (tmp_path / "status.tsv").write_text("env\t124\t20.0\t20\ta.log\n")
    assert rep.table(tmp_path)[1] is False


def test_gpu_check_starts_with_the_stream_probe_and_stops_when_it_fails(tmp_path):
    """--cpu: the probe replays the documented 1F1B example with the stream flags the runtime's Comms asks for
    (ok) and with blocking streams (the control, a deadlock); a probe that fails stops the check with one line."""
    out = tmp_path / "gc"
    proc = _gpu_check(["--cpu"], env={"OUT": str(out), "GPU_CHECK_ONLY": "stream_probe"}, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    probe = json.loads((out / "stream_probe.json").read_text())
    assert probe["ok"] and probe["control_fails"] and probe["runtime"]["flags"] == "non-blocking"
    # the runtime asking for blocking streams: the probe fails and nothing after it runs
    fake = tmp_path / "sitecustomize.py"
    fake.write_text("import pipeline.device.emulated as e\n"
                    "real = e.EmulatedCuda.new_stream\n"
                    "e.EmulatedCuda.new_stream = lambda self, role, priority=0, blocking=False: "
                    "real(self, role, priority, True)\n")
    out2 = tmp_path / "gc2"
    proc = _gpu_check(["--cpu"], env={"OUT": str(out2), "GPU_CHECK_ONLY": "stream_probe,stage",
                                      "PYTHONPATH": f"{tmp_path}:{ROOT}"}, timeout=120)
    assert proc.returncode != 0
    assert "gpu_check: stopped: stream probe: FAIL" in proc.stdout, proc.stdout[-2000:]
    rows = {s["step"] for s in json.loads((out2 / "summary.json").read_text())["steps"]}
    assert "stage" not in rows
