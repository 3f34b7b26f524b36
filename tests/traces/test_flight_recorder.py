"""`mhcpipe check-comm` on a folder of Flight Recorder dumps made here on gloo (torch >= 2.13 records gloo
collectives), the allow-list reader, and the run's Flight Recorder settings."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.observability.fr_setup import flight_recorder_dir, flight_recorder_env
from traces.formats.flight_recorder import FlightRecorderError, analyse, load_dump

ROOT = Path(__file__).resolve().parents[2]
GLOO_RECORDS = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)


@pytest.fixture(scope="module")
def dump_dir(tmp_path_factory):
    if not GLOO_RECORDS:
        pytest.skip("torch < 2.13 does not record gloo collectives in Flight Recorder")
    folder = tmp_path_factory.mktemp("fr")
    env = dict(os.environ, PYTHONPATH=str(ROOT), TORCH_FR_BUFFER_SIZE="200", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(ROOT / "tests" / "traces" / "_fr_hang_worker.py"), str(folder)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "timed out after 2 s in the step statistics all-gather" in proc.stdout
    return folder


def _check_comm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mhcpipe", "check-comm", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(ROOT)))


def test_check_comm_names_the_collective_a_rank_never_posted(dump_dir):
    rep = analyse(dump_dir)
    assert rep.ranks == [0, 1] and not rep.ok and len(rep.problems) == 1, rep.problems
    # rank 0 posted collective #3 (the all-gather), rank 1 stopped at #2 (the loss all-reduce): named by action
    p = rep.problems[0]
    assert "ranks [0] posted gloo:all_gather #3 carrying the step statistics all-gather" in p, p
    assert "rank 1 stopped at #2 (gloo:all_reduce carrying the loss all-reduce)" in p, p
    proc = _check_comm(str(dump_dir))
    assert proc.returncode == 1 and proc.stdout.startswith("1 problem(s): "), proc.stdout + proc.stderr
    assert "the step statistics all-gather" in proc.stdout


def test_a_forged_dump_is_refused_in_one_line(dump_dir, tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "ran"),))

    bad = tmp_path / "forged"
    bad.mkdir()
    good = pickle.loads((dump_dir / "rank_0").read_bytes())  # a real dump, then a payload in one entry
    good["entries"][0]["profiling_name"] = Evil()
    (bad / "rank_0").write_bytes(pickle.dumps(good))
    proc = _check_comm(str(bad))
    assert proc.returncode == 2 and not (tmp_path / "ran").exists(), proc.stdout + proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "rank_0: not a Flight Recorder dump" in err[0] and "names posix.system" in err[0], err
    (bad / "rank_0").write_bytes(pickle.dumps({"hello": 1}))
    with pytest.raises(FlightRecorderError, match="no 'version' and 'entries'"):
        load_dump(bad / "rank_0")
    (bad / "rank_0").write_bytes(b"not a pickle at all")
    proc = _check_comm(str(bad))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_flight_recorder_settings_leave_the_users_own(tmp_path):
    env = {"TORCH_FR_BUFFER_SIZE": "50", "TORCHELASTIC_RUN_ID": "job7"}
    folder = flight_recorder_dir(None, env)
    assert folder.parts[-3:] == ("runs", "flight_recorder", "job7")
    assert flight_recorder_dir(str(tmp_path), env) == tmp_path.resolve() / "flight_recorder"
    done = flight_recorder_env(folder, env)
    assert env["TORCH_FR_BUFFER_SIZE"] == "50" and "TORCH_FR_BUFFER_SIZE" not in done
    # the deprecated name of the buffer size is not set on a torch that reads the new one (every rank would warn)
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(folder / "rank_")
    fresh = {}
    flight_recorder_env(folder, fresh)
    assert fresh["TORCH_FR_BUFFER_SIZE"] == "2000" and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in fresh


def test_the_error_path_writes_the_ledger_and_names_where_the_dumps_go(tmp_path, capsys, monkeypatch):
    from pipeline.__main__ import report_flight_recorder

    report_flight_recorder(tmp_path, 0, "gloo", 5.0)
    err = capsys.readouterr().err
    assert (tmp_path / "actions_rank0.json").exists() and str(tmp_path) in err and "NCCL runs only" in err
    monkeypatch.setenv("MHCPIPE_FR_WAIT_S", "0.2")
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", str(tmp_path / "rank_"))
    report_flight_recorder(tmp_path, 0, "nccl", 5.0)
    err = capsys.readouterr().err
    assert f"mhcpipe check-comm {tmp_path}" in err and "rank 0: Flight Recorder dump not written" in err, err
    (tmp_path / "rank_0").write_bytes(b"x")
    report_flight_recorder(tmp_path, 0, "nccl", 5.0)
    assert f"dump written: {tmp_path / 'rank_'}0" in capsys.readouterr().err
