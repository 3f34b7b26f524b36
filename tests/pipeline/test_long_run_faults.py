"""A long run survives faults (pipeline.checkpoint.policy, pipeline.runtime.nonfinite, the restart store of
pipeline.distributed.p2p): each fault injected into real `mhcpipe run` launches (1F1B on 2 ranks, float64, so a
resumed or restarted run's losses equal the uninterrupted run's exactly)."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BASE = ["--config", "tiny", "--schedule", "1f1b", "--pp", "2", "--dtype", "float64"]


def run(tmp: Path, *args, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mhcpipe", "run", *BASE, *args], cwd=tmp, capture_output=True,
                          text=True, timeout=timeout,
                          env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
                               **(env or {})})


def losses(proc) -> dict[int, float]:
    """step number (1-based, as logged) -> loss; a restarted job logs some steps twice: the last counts."""
    out = {}
    for m in re.finditer(r"^step (\d+)/\d+  loss (\S+)", proc.stdout, re.M):
        out[int(m.group(1))] = float(m.group(2))
    return out


def errors(proc) -> list[str]:
    return [ln for ln in proc.stderr.splitlines() if "error" in ln and not ln.startswith(("E1", "W1", "["))]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, float]:
    tmp = tmp_path_factory.mktemp("uninterrupted")
    proc = run(tmp, "--steps", "4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return losses(proc)


def listing(d: Path) -> tuple:
    return tuple(sorted(p.name for p in d.iterdir())), (d / "latest").read_text()


def test_a_relaunch_without_resume_resumes_and_another_config_or_no_resume_is_refused_deleting_nothing(
        tmp_path, uninterrupted):
    first = run(tmp_path, "--steps", "2", "--checkpoint-dir", "ck")
    assert first.returncode == 0, first.stderr[-3000:]
    ck = tmp_path / "ck"
    before = listing(ck)
    for args, want in ((["--residual", "residual:1"], "holds checkpoints, which a run resumes by default: "),
                       (["--no-resume"], "--no-resume: ck holds checkpoints (latest: step_1)")):
        refused = run(tmp_path, "--steps", "4", "--checkpoint-dir", "ck", *args)
        err = refused.stderr.strip()
        assert refused.returncode == 2 and len(err.splitlines()) == 1 and want in err and "--overwrite" in err, err
        assert listing(ck) == before  # nothing deleted, nothing written
    again = run(tmp_path, "--steps", "4", "--checkpoint-dir", "ck")  # the usual relaunch: no flag
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from ck/step_1 (step 2 done" in again.stderr
    assert losses(again) == {3: uninterrupted[3], 4: uninterrupted[4]}
    fresh = run(tmp_path, "--steps", "1", "--checkpoint-dir", "ck", "--no-resume", "--overwrite")
    assert fresh.returncode == 0 and losses(fresh) == {1: uninterrupted[1]}, fresh.stderr[-3000:]
    assert listing(ck) == (("latest", "step_0"), "step_0\n")  # the overwritten run's later steps are gone


def test_checkpoint_interval_and_keep_last_n(tmp_path):
    proc = run(tmp_path, "--steps", "4", "--checkpoint-dir", "ck", "--checkpoint-every", "3", "--keep-checkpoints",
               "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert listing(tmp_path / "ck") == (("latest", "step_3"), "step_3\n")  # saved after step 3 and the last


def test_a_rank_killed_mid_run_under_max_restarts_resumes_to_the_uninterrupted_losses(tmp_path):
    """4 ranks: the restarted ones must not read the dead round's addresses from torchrun's store (without a
    store prefix per round they connect to dead ports: 'Gloo connectFullMesh failed')."""
    four = ["--pp", "4", "--steps", "4"]
    ref = run(tmp_path, *four)
    assert ref.returncode == 0, ref.stderr[-3000:]
    proc = run(tmp_path, *four, "--checkpoint-dir", "ck", "--max-restarts", "1",
               env={"MHCPIPE_TEST_KILL": "2:2"})  # rank 2 dies (SIGKILL) before step 3, in the first attempt
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from ck/step_1" in proc.stderr
    assert losses(proc) == losses(ref)


def test_a_nan_gradient_stops_naming_step_rank_and_stage_or_is_skipped_as_if_that_update_never_ran(
        tmp_path, uninterrupted):
    stop = run(tmp_path, "--steps", "3", "--checkpoint-dir", "ck", env={"MHCPIPE_TEST_NAN_GRAD": "1:1"})
    assert stop.returncode == 1
    said = errors(stop)
    assert said and all(ln == said[0] for ln in said), said
    assert said[0].startswith("mhcpipe: error: step 2: non-finite gradient on rank 1, stage 1 (blocks 4-7): the run "
                              "stops before its optimizer step"), said
    assert (tmp_path / "ck" / "latest").read_text().strip() == "step_0"
    skip = run(tmp_path, "--steps", "4", "--checkpoint-dir", "skip", "--skip-nonfinite",
               env={"MHCPIPE_TEST_NAN_GRAD": "1:1"})
    assert skip.returncode == 0, skip.stderr[-3000:]
    assert re.search(r"^step 2/4 .*SKIPPED \(non-finite gradient on rank 1, stage 1 \(blocks 4-7\); 1 skipped\)",
                     skip.stdout, re.M), skip.stdout
    # the same as step 2 never updating: step_0 resumed as if two steps were done
    ref = tmp_path / "ref"
    shutil.copytree(tmp_path / "ck" / "step_0", ref / "step_1")
    manifest = json.loads((ref / "step_1" / "manifest.json").read_text())
    manifest["step"] = 1
    (ref / "step_1" / "manifest.json").write_text(json.dumps(manifest))
    (ref / "latest").write_text("step_1\n")
    without = run(tmp_path, "--steps", "4", "--checkpoint-dir", "ref")
    assert without.returncode == 0, without.stderr[-3000:]
    got = losses(skip)
    assert got[1] == uninterrupted[1] and got[2] == uninterrupted[2]  # step 2's loss is computed, not applied
    assert {3: got[3], 4: got[4]} == losses(without) and got[3] != uninterrupted[3]


def test_a_full_disk_on_one_rank_ends_the_run_in_one_line_and_the_previous_checkpoint_resumes_exactly(
        tmp_path, uninterrupted):
    full = run(tmp_path, "--steps", "3", "--checkpoint-dir", "ck",
               env={"MHCPIPE_TEST_CRASH_IN_SAVE": "1:1:enospc"})
    assert full.returncode == 1
    said = errors(full)
    # each rank that reports says the same one line; torchrun stops the other rank once the first exits with the
    # error, so under load the second line may never be printed (1 run in 4 clean runs of the suite, measured)
    assert 1 <= len(said) <= 2 and all("No space left on device" in ln and "ck/latest still names the previous "
                                       "complete checkpoint" in ln for ln in said), said
    assert (tmp_path / "ck" / "latest").read_text().strip() == "step_0"
    resumed = run(tmp_path, "--steps", "4", "--checkpoint-dir", "ck")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert losses(resumed) == {k: uninterrupted[k] for k in (2, 3, 4)}


def test_a_rank_killed_during_an_asynchronous_save_leaves_latest_intact_and_resumes_exactly(tmp_path, uninterrupted):
    """--async-checkpoint: the save of step 2 is written by a background thread while step 3 trains; rank 1 dies
    half-way through its shard. `latest` still names step_0 (complete), and a relaunch (asynchronous saves again)
    resumes from it to the uninterrupted losses."""
    killed = run(tmp_path, "--steps", "4", "--checkpoint-dir", "ck", "--async-checkpoint",
                 env={"MHCPIPE_TEST_CRASH_IN_SAVE": "1:1:write"})
    assert killed.returncode != 0
    assert "MHCPIPE_TEST_CRASH_IN_SAVE: rank 1 dies while saving" in killed.stderr
    assert (tmp_path / "ck" / "latest").read_text().strip() == "step_0"
    resumed = run(tmp_path, "--steps", "4", "--checkpoint-dir", "ck", "--async-checkpoint")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from ck/step_0" in resumed.stderr and "saved (asynchronous)" in resumed.stdout
    assert losses(resumed) == {k: uninterrupted[k] for k in (2, 3, 4)}
    assert listing(tmp_path / "ck") == (("latest", "step_2", "step_3"), "step_3\n")
