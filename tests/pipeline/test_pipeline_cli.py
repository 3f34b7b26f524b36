"""Entry points: `mhcpipe run` (torchrun) end to end with trace and checkpoint/resume; one-line errors."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from _pipeline_helpers import check_ok, mhcpipe_in_process, tiny_config
from pipeline.launch.local import variants_worker
from rank_pool import launch
from traces.trace import Trace

ROOT = Path(__file__).resolve().parents[2]


def _why(proc) -> str:
    """A failed run's stderr: the ranks' own messages come first, torchrun's summary of the failure last."""
    err = proc.stderr
    return err if len(err) <= 4000 else f"{err[:3000]}\n[...]\n{err[-1000:]}"


def _mhcpipe(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "mhcpipe", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})


@pytest.mark.timeout(300)
def test_run_trace_interleave_checkpoint_resume(tmp_path):
    """Three real launches: mHC and the baseline interleaved with a trace (the step lines, the variants' turns,
    each variant's trace); a run that checkpoints every step; a resume from step 1 whose last loss is the
    uninterrupted run's. A resume with nothing left is refused before anything starts."""
    cfg = tiny_config("dualpipev", 2, steps=3)
    path = tmp_path / "tiny2.yaml"
    path.write_text(yaml.safe_dump(cfg))
    full = _mhcpipe("run", "--config", str(path), "--residual", "mhc:4", "--interleave", "residual:1",
                    "--trace-dir", str(tmp_path / "trace"))
    assert full.returncode == 0, _why(full)
    lines = [ln for ln in full.stdout.splitlines() if "] step " in ln]
    assert [ln.split()[0] + ln.split()[2] for ln in lines] == \
        ["[mhc:4]1/3", "[residual:1]1/3", "[residual:1]2/3", "[mhc:4]2/3", "[mhc:4]3/3", "[residual:1]3/3"], \
        full.stdout
    for ln in lines:
        assert re.search(r"loss \d+\.\d+ .*step_time [\d.]+ ms .*tokens/s [\d,]+ .*peak_act [\d.]+ MiB", ln), ln
    for name, n in (("mhc_4", 4), ("residual_1", 1)):
        meta = json.loads((tmp_path / "trace" / name / "trace.json").read_text())["meta"]
        assert meta["residual"]["n"] == n

    trace = Trace.load(tmp_path / "trace" / "mhc_4" / "trace.json").to_records()
    assert trace["meta"]["source"] == "measured" and trace["meta"]["time_unit"] == "us"
    assert trace["meta"]["schedule"] == {"kind": "dualpipev", "ranks": 2, "microbatches": 4, "mirrors": False,
                                         "stages_per_rank": 2}  # the kind's facts (schedules.registry.trace_meta)
    names = {s["name"] for s in trace["spans"]}
    assert {"F/s0/mb0", "SEND_F/s0/mb0~comm", "RECV_F/s0/mb0~comm", "F/s0/mb0/L1.post_res~hp"} <= names
    assert any(re.fullmatch(r"FB/s\d+/mb\d+\+s\d+/mb\d+", n) for n in names)
    assert any(n.startswith("W/s") for n in names)
    ranks = {s["rank"] for s in trace["spans"]}
    assert ranks == {0, 1}
    # one host, one clock: a forward that consumes another rank's output starts after that output was made
    # (with barrier-aligned clocks this fails by the barrier's exit jitter, milliseconds)
    forwards: dict[tuple[int, int], list[dict]] = {}
    for s in trace["spans"]:
        m = re.fullmatch(r"F/s(\d+)/mb(\d+)", s["name"])
        if m:
            forwards.setdefault((int(m.group(1)), int(m.group(2))), []).append(s)
    checked = 0
    for (stage, mb), spans in forwards.items():
        prev = forwards.get((stage - 1, mb))
        if prev is None or prev[0]["rank"] == spans[0]["rank"]:
            continue
        for consumer, producer in zip(sorted(spans, key=lambda s: s["start"]), sorted(prev, key=lambda s: s["start"])):
            assert consumer["start"] >= producer["start"] + producer["duration"] - 1.0, (consumer, producer)
            checked += 1
    assert checked >= 3 * 4  # 3 steps x 4 micro-batches cross at least one rank boundary

    ckpt = tmp_path / "ckpt"
    three = _mhcpipe("run", "--config", str(path), "--checkpoint-dir", str(ckpt))
    assert three.returncode == 0, _why(three)
    losses = [float(re.search(r"loss (\S+)", ln).group(1)) for ln in three.stdout.splitlines()
              if ln.startswith("step ")]
    assert len(losses) == 3, three.stdout
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_1", "step_2"]  # DCP, the newest two kept
    assert (ckpt / "latest").read_text().strip() == "step_2" and (ckpt / "step_1" / "manifest.json").is_file()
    (ckpt / "latest").write_text("step_1\n")  # as if the run had stopped after step 2 of 3
    resumed = _mhcpipe("run", "--config", str(path), "--checkpoint-dir", str(ckpt), "--resume")
    assert resumed.returncode == 0, _why(resumed)
    last = [ln for ln in resumed.stdout.splitlines() if ln.startswith("step ")]
    assert len(last) == 1 and last[0].startswith("step 3/3")
    assert float(re.search(r"loss (\S+)", last[0]).group(1)) == losses[2]
    again = mhcpipe_in_process("run", "--config", str(path), "--checkpoint-dir", str(ckpt), "--resume")
    err = again.stderr.strip()
    assert again.returncode == 2 and len(err.splitlines()) == 1 and "nothing left to run; raise --steps" in err, err


@pytest.mark.parametrize("args,field", [
    (["run", "--config", "tiny", "--microbatches", "5", "--schedule", "dualpipe"], "parallel"),
    (["run", "--config", "tiny", "--residual", "residual:4"], "model.residual"),
    (["run", "--config", "tiny", "--recompute", "sometimes"], "--recompute"),
    (["run", "--config", "no-such-preset"], "unknown preset"),
    (["run", "--config", "tiny", "--nproc", "3", "--schedule", "dualpipe"], "parallel"),
    (["run", "--config", "tiny", "--interleave", "residual"], "--interleave"),
    (["run", "--config", "tiny", "--interleave", "mhc:4"], "already uses that residual"),
    (["run", "--config", "tiny", "--interleave", "residual:1", "--checkpoint-dir", "/tmp/x"], "--checkpoint-dir"),
    (["run", "--config", "tiny", "--resume"], "--resume needs --checkpoint-dir"),
    (["run", "--config", "tiny", "--resume", "--checkpoint-dir", "/nonexistent/ckpt"], "no checkpoint in"),
    # layouts: every one refused before a process starts, naming the field and the flag
    (["run", "--config", "tiny-moe", "--pp", "2", "--dp", "2", "--nproc", "3"], "parallel.ranks (--pp 2) x"),
    (["run", "--config", "tiny-moe", "--pp", "2", "--dp", "2", "--ep", "4"], "must divide parallel.data_parallel"),
    (["run", "--config", "tiny-moe", "--pp", "1", "--dp", "3", "--ep", "3", "--microbatches", "12"],
     "must divide model.moe.num_experts"),
    (["run", "--config", "tiny", "--pp", "2", "--dp", "2", "--ep", "2"], "has no MoE"),
    (["run", "--config", "tiny", "--schedule", "dualpipe", "--pp", "3"], "use an even number of pipeline ranks"),
    (["run", "--config", "deepseek-v3", "--pp", "16", "--dp", "1", "--ep", "1", "--microbatches", "32"],
     "model.mla, model.mtp_depth, train.fp8"),
    (["run", "--config", "tiny-moe", "--pp", "2", "--dp", "3"], "parallel.microbatches=8 must be a multiple"),
    (["run", "--config", "tiny", "--dp", "0"], "--dp 0"),
])
def test_bad_config_is_one_line_exit_2(args, field):
    out = mhcpipe_in_process(*args)
    assert out.returncode == 2
    err = out.stderr.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1 and field in err, err


def test_module_entry_outside_torchrun():
    out = subprocess.run([sys.executable, "-m", "pipeline"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "torchrun" in out.stderr and "Traceback" not in out.stderr


def test_config_error_names_field(tmp_path):
    cfg = tiny_config("1f1b", 2)
    cfg["model"]["hidden"] = -3
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = mhcpipe_in_process("run", "--config", str(path))
    assert out.returncode == 2 and "model.hidden" in out.stderr, out.stderr


@pytest.mark.timeout(120)
def test_host_staged_transport_matches_direct():
    cfg = tiny_config("zb1p", 2, steps=2)
    direct = launch(variants_worker, 2, ([cfg], True), timeout_s=100)
    staged = launch(_staged_worker, 2, ([cfg],), timeout_s=100)
    check_ok(direct)
    check_ok(staged)
    assert [s["loss"] for s in direct[0].value[0]["stats"]] == staged[0].value


def _staged_worker(rank, world, cfgs):
    import torch

    from configs import parse_config
    from pipeline.runtime.train import RankRuntime

    cfg = parse_config(cfgs[0])
    rt = RankRuntime(cfg, rank, torch.device("cpu"), staged=True)
    rt.align_clocks()
    return [rt.step(k).loss for k in range(cfg.train.steps)]


@pytest.mark.timeout(300)
def test_expert_and_data_parallel_layout_prints_the_single_process_losses(tmp_path):
    """`--pp 2 --dp 2 --ep 2` on the tiny-moe preset: the same config and global batch as one process, so the same
    losses (tiny-moe runs in float64, where the order of sums moves a loss by ~1e-15, far below the 6 printed
    decimals). Its trace folder, diagnostics included, reads back: the critical path runs through one replica's
    pipeline, its P2P between the replica's own ranks (issue 34: it failed on "rank 3 never produced F/s0")."""
    from configs import load_config
    from pipeline.single_process import train_single_process
    from traces.analysis.critical_path import critical_path
    from traces.formats.io import load_trace

    out = _mhcpipe("run", "--config", "tiny-moe", "--steps", "2", "--pp", "2", "--dp", "2", "--ep", "2",
                   "--trace-dir", str(tmp_path), "--diagnostics-every", "1")
    assert out.returncode == 0, _why(out)
    printed = re.findall(r"loss (\S+)", out.stdout)
    want, _, _ = train_single_process(load_config("tiny-moe", {"train": {"steps": 2}}), steps=2)
    assert printed == [f"{v:.6f}" for v in want], (printed, want)
    trace = load_trace(tmp_path)
    assert "diagnostics_rank0.json" in trace.meta["skipped"] and trace.ranks == [0, 1, 2, 3]
    cp = critical_path(trace)
    assert cp.scope.startswith("data-parallel replica ") and cp.length_us > 0
    # every message found its other end inside the replica (the old reading sent rank 3's receives to itself)
    assert [n for n in cp.notes if "no RECV" in n or "not in the trace" in n] == []
    # within that replica (on a loaded host its longest chain may stay on one of its ranks)
    assert {p.rank for p in cp.path} <= {0, 1}


@pytest.mark.timeout(120)
def test_bad_layout_under_torchrun_stops_every_rank_before_it_computes():
    from pipeline.launch.local import free_port

    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                          str(free_port()), "-m", "pipeline",
                          "--config", "tiny-moe", "--pp", "3"], cwd=ROOT, capture_output=True, text=True, timeout=110,
                         env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert out.returncode != 0
    lines = [ln for ln in out.stderr.splitlines() if "python -m pipeline: error (rank" in ln]
    assert lines, out.stderr[-3000:]  # every rank reports; torchrun may stop the others once one has exited
    assert all("parallel.ranks (--pp 3) x parallel.data_parallel (--dp 1) = 3, but 2 processes" in ln for ln in lines)
    assert "step 1/" not in out.stdout


@pytest.mark.timeout(240)
def test_a_run_writes_its_trace_as_binary_columns(tmp_path):
    """--trace-format npz (train.trace_format): each rank's spans and the merged trace as our .npz (docs/traces.md
    §8), which the folder readers and the analyses take as they take trace.json."""
    from traces.formats.io import load_trace

    cfg = tiny_config("1f1b", 2, steps=3)
    path = tmp_path / "tiny2.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "trace"
    run = _mhcpipe("run", "--config", str(path), "--trace-dir", str(out), "--trace-format", "npz")
    assert run.returncode == 0, _why(run)
    names = sorted(p.name for p in out.iterdir() if p.suffix in (".json", ".npz"))
    assert names == ["rank0.npz", "rank1.npz", "trace.npz"], names
    merged, folder = load_trace(out / "trace.npz"), load_trace(out)
    assert folder.spans == merged.spans and merged.meta["source"] == "measured"
    ranks = [load_trace(out / f"rank{r}.npz") for r in (0, 1)]
    assert len(merged.spans) == sum(len(t.spans) for t in ranks) > 0
    assert {"F/s0/mb0", "SEND_F/s0/mb0~comm", "RECV_F/s0/mb0~comm"} <= {s.label for s in merged.spans}
    for cmd in (["critical-path", str(out), "--steps", "1..2"], ["check-comm", str(out)]):
        res = mhcpipe_in_process(*cmd)
        assert res.returncode == 0, (cmd, res.stderr)
