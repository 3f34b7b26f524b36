"""Checkpoints (pipeline/checkpoint/dcp.py): DCP keyed by the single-process model's names, so a run resumes on another
layout with the next loss of an uninterrupted run; a rank killed mid-save leaves the previous checkpoint; damaged
or missing files are one line naming the file and the fix; old-format checkpoints convert.

On 2 shared cores every multi-rank launch costs seconds, so one module fixture runs them all: the uninterrupted
reference runs, two runs that lose a rank while saving, then one launch that resumes every checkpoint (one
train() per checkpoint in the same process group). The tests check their part of its results.

Model: the MoE tiny of _pipeline_helpers (8 blocks, 4 experts, first block dense) in float64, where another
layout sums in another order and losses still agree to ~1e-15.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from _pipeline_helpers import mhcpipe_in_process, tiny_config
from pipeline.checkpoint import dcp, files
from configs import parse_config
from pipeline.launch.local import free_port
from rank_pool import launch

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 15.0
TOL = 1e-12  # float64: another layout sums in another order


def _cfg(schedule: str, pp: int, dp: int = 1, ep: int = 1) -> dict:
    return tiny_config(schedule, pp, dp=dp, ep=ep, moe=True, dtype="float64", blocks=8, steps=3,
                       timeout_s=TIMEOUT_S)


def train_worker(rank: int, world: int, runs: list, out_dir: str | None = None) -> list:
    """pipeline.runtime.train.train for each (cfg dict, checkpoint dir, resume) in turn; per run [(step, loss)] or the
    one-line error of a refused resume. With `out_dir`, each run's result is also appended to
    out_dir/rank<r>.jsonl as soon as it is known (what finished survives a later failure)."""
    from pipeline.runtime.train import train

    out = []
    for cfg_dict, ckpt, resume in runs:
        try:
            hist = train(parse_config(cfg_dict), rank, world, torch.device("cpu"), checkpoint_dir=Path(ckpt),
                         resume=resume, log=lambda *a: None)
            out.append([(s.step, s.loss) for s in hist])
        except ValueError as err:
            out.append(str(err))
        if out_dir is not None:
            with open(Path(out_dir) / f"rank{rank}.jsonl", "a") as f:
                f.write(json.dumps(out[-1]) + "\n")
    return out


def _results(out_dir: Path, res, world: int) -> dict[int, list]:
    """Each rank's per-run results so far; a rank that failed also gets its error as the next entry."""
    got = {}
    for r in range(world):
        path = out_dir / f"rank{r}.jsonl"
        got[r] = [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []
        if res[r].exitcode != 0:
            got[r].append(f"rank failed (exit {res[r].exitcode}): {res[r].error}")
    return got


def _entry(runs: dict, i: int, rank: int = 0):
    got = runs["resumed"][rank]
    assert i < len(got), f"run {i} did not happen: rank {rank}'s results {got}"
    return got[i]


def _ok(results) -> list:
    bad = [(r.rank, r.exitcode, r.error) for r in results if r.exitcode != 0 or r.error]
    assert not bad, f"ranks failed: {bad}"
    return results[0].value


def _point_latest(directory: Path, name: str) -> Path:
    (directory / "latest").write_text(name + "\n")
    return directory


def _copy(src: Path, dst: Path, latest: str | None = None) -> Path:
    shutil.copytree(src, dst)
    return _point_latest(dst, latest) if latest else dst


def write_old_format(step_dir: Path, old_dir: Path, cfg_dict: dict) -> None:
    """What the per-stage pickles of the previous format held (stage<s>.pt by the plan's stages, latest.json)."""
    from pipeline.partition import plan_rank

    cfg = parse_config(cfg_dict)
    sd = dcp.read_all(step_dir)
    step = json.loads((step_dir / "manifest.json").read_text())["step"]
    old_dir.mkdir(parents=True)
    specs = plan_rank(cfg, 0).stages
    for spec in specs:
        prefixes = ([f"blocks.{b}." for b in spec.blocks] + (["embed."] if spec.has_embed else [])
                    + (["head."] if spec.has_head else []))
        names = [k[len("model."):] for k in sd if k.startswith("model.") and k[len("model."):].startswith(
            tuple(prefixes))]
        optim = {}
        for n in names:
            state = {k.rsplit(".", 1)[1]: v for k, v in sd.items() if k.startswith(f"optim.{n}.")}
            if state:
                optim[n] = state
        torch.save({"step": step, "stage": spec.stage, "params": {n: sd[f"model.{n}"] for n in names},
                    "optim": optim}, old_dir / f"stage{spec.stage}.pt")
    par = cfg.parallel
    (old_dir / "latest.json").write_text(json.dumps({"step": step, "schedule": par.schedule, "ranks": par.ranks,
                                                     "data_parallel": 1, "expert_parallel": 1,
                                                     "stages": len(specs)}))


# resume targets: (name, checkpoint written by, resumed on)
TARGETS = [("dualpipe->1f1b", "dualpipe", _cfg("1f1b", 4)),
           ("dualpipe_pp4->1f1b_pp2_dp2_ep2", "dualpipe", _cfg("1f1b", 2, dp=2, ep=2)),
           ("1f1b->dualpipe", "1f1b", _cfg("dualpipe", 4)),
           ("1f1b_pp4->dualpipev_pp2_dp2", "1f1b", _cfg("dualpipev", 2, dp=2)),
           ("converted_old->dualpipe_pp2_dp2_ep2", "converted", _cfg("dualpipe", 2, dp=2, ep=2))]
CRASHES = [("write", 1), ("publish", 0)]  # (phase, rank that dies)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("ckpt")
    timings = {}
    t0 = time.monotonic()
    # 1. uninterrupted: 3 steps of DualPipe and of 1F1B on 4 pipeline ranks, a checkpoint after every step
    refs = {"dualpipe": _cfg("dualpipe", 4), "1f1b": _cfg("1f1b", 4)}
    ref = _ok(launch(train_worker, 4, ([(c, str(base / k), False) for k, c in refs.items()],), timeout_s=240))
    timings["reference"] = time.monotonic() - t0
    losses = {k: [loss for _, loss in ref[i]] for i, k in enumerate(refs)}
    # 2. a rank dies while saving step 1's checkpoint
    crashes = {}
    for phase, victim in CRASHES:
        d = base / f"crash_{phase}"
        os.environ[dcp.CRASH_ENV] = f"{victim}:1:{phase}"
        try:
            t = time.monotonic()
            res = launch(train_worker, 4, ([(refs["dualpipe"], str(d), False)],), timeout_s=120,
                         grace_s=3 * TIMEOUT_S)
            timings[f"crash_{phase}"] = time.monotonic() - t
            crashes[phase] = (victim, res, sorted(p.name for p in d.iterdir()), (d / "latest").read_text().strip())
        finally:
            del os.environ[dcp.CRASH_ENV]
    # 3. checkpoints to resume after step 1 (`latest` pointed back at step_1; each target its own copy)
    old = base / "old"
    write_old_format(base / "dualpipe" / "step_1", old, refs["dualpipe"])
    cfg_path = base / "model.yaml"
    cfg_path.write_text(yaml.safe_dump(refs["dualpipe"]))
    t = time.monotonic()
    conv = mhcpipe_in_process("checkpoint", "convert", str(old), str(base / "converted"), "--config", str(cfg_path))
    timings["convert"] = time.monotonic() - t
    sources = {"dualpipe": base / "dualpipe", "1f1b": base / "1f1b", "converted": base / "converted"}
    resume_runs, dirs = [], {}
    for name, src, cfg in TARGETS:
        dirs[name] = _copy(sources[src], base / f"resume_{name}", latest="step_1")
        resume_runs.append((cfg, str(dirs[name]), True))
    for phase, _ in CRASHES:
        dirs[f"crash_{phase}"] = base / f"crash_{phase}"
        resume_runs.append((refs["dualpipe"], str(base / f"crash_{phase}"), True))
    damaged = _copy(base / "dualpipe", base / "damaged_shard", latest="step_1")
    shard = damaged / "step_1" / "__2_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    resume_runs.append((_cfg("1f1b", 4), str(damaged), True))
    t = time.monotonic()
    out_dir = base / "results"
    out_dir.mkdir()
    res = launch(train_worker, 4, (resume_runs, str(out_dir)), timeout_s=300)
    timings["resume"] = time.monotonic() - t
    resumed = _results(out_dir, res, 4)
    return {"base": base, "refs": refs, "losses": losses, "crashes": crashes, "resumed": resumed, "dirs": dirs,
            "conv": conv, "old": old, "damaged": damaged, "timings": timings}


def test_layouts_and_schedules_agree_uninterrupted(runs):
    print("timings (s):", {k: round(v, 1) for k, v in runs["timings"].items()})
    a, b = runs["losses"]["dualpipe"], runs["losses"]["1f1b"]
    print("dualpipe vs 1f1b uninterrupted:", [abs(x - y) for x, y in zip(a, b)])
    assert len(a) == 3 and max(abs(x - y) for x, y in zip(a, b)) < TOL


@pytest.mark.parametrize("name", [t[0] for t in TARGETS])
def test_resume_on_another_layout_gives_the_uninterrupted_loss(runs, name):
    """Step 1's checkpoint resumed on another layout/schedule: step 2's loss is the uninterrupted run's, and the
    checkpoint the new layout saves after it holds the uninterrupted run's step-2 values for every key."""
    i = [t[0] for t in TARGETS].index(name)
    src = TARGETS[i][1]
    got = _entry(runs, i)
    assert isinstance(got, list), got
    ref = runs["losses"]["dualpipe" if src == "converted" else src]
    assert [s for s, _ in got] == [2], got
    diff = abs(got[0][1] - ref[2])
    print(f"{name}: |next loss - uninterrupted| = {diff:.3g}")
    assert diff < TOL, (got, ref)
    # what the new layout saved (every rank's keys, replicas and mirrored copies once) == the reference step 2
    d = runs["dirs"][name]
    assert (d / "latest").read_text().strip() == "step_2" and not list(d.glob("*.tmp"))
    mine = dcp.read_all(d / "step_2")
    want = dcp.read_all(runs["base"] / ("dualpipe" if src == "converted" else src) / "step_2")
    assert set(mine) == set(want)
    worst = max(float((mine[k].double() - want[k].double()).abs().max()) for k in want)
    print(f"{name}: saved state max |diff| = {worst:.3g}")
    assert worst < 1e-9
    assert any(".experts.3." in k for k in mine) and any(k.endswith(".exp_avg_sq") for k in mine)


@pytest.mark.parametrize("phase", [c[0] for c in CRASHES])
def test_rank_killed_during_save_leaves_previous_checkpoint(runs, phase):
    victim, res, names, latest = runs["crashes"][phase]
    assert res[victim].exitcode == 1
    for r in res:
        if r.rank != victim:  # the others fail with one line, within the timeout
            assert r.exitcode == 1 and r.error and "\n" not in r.error, (r.rank, r.exitcode, r.error)
            assert r.elapsed_s < 60, r.elapsed_s
    assert latest == "step_0" and "step_1" not in names and "step_1.tmp" in names, names
    # resuming continues from step 0's checkpoint with the uninterrupted losses of steps 1 and 2
    got = _entry(runs, len(TARGETS) + [c[0] for c in CRASHES].index(phase))
    assert isinstance(got, list), got
    ref = runs["losses"]["dualpipe"]
    assert [s for s, _ in got] == [1, 2]
    print(f"crash in {phase}: resumed losses - uninterrupted = {[got[i][1] - ref[i + 1] for i in range(2)]}")
    assert all(abs(got[i][1] - ref[i + 1]) < TOL for i in range(2)), (got, ref)
    d = runs["dirs"][f"crash_{phase}"]
    assert sorted(p.name for p in d.iterdir()) == ["latest", "step_1", "step_2"]  # the torn save is gone


def test_damaged_shard_at_load_is_one_line_on_every_rank(runs):
    for rank in range(4):
        err = _entry(runs, len(TARGETS) + len(CRASHES), rank)
        assert isinstance(err, str), (rank, err)
        assert str(runs["damaged"] / "step_1" / "__2_0.distcp") in err and "sha256" in err and "\n" not in err, err
        assert "write 'step_2' into" in err  # the fix: the other complete checkpoint


def test_converter_converts_the_old_format(runs):
    conv = runs["conv"]
    assert conv.returncode == 0, conv.stderr
    assert "converted" in conv.stdout
    assert (runs["base"] / "converted" / "latest").read_text().strip() == "step_1"
    manifest = json.loads((runs["base"] / "converted" / "step_1" / "manifest.json").read_text())
    assert manifest["layout"] == {"pp": 4, "dp": 1, "ep": 1} and manifest["schedule"] == "dualpipe"
    # (resumed on dualpipe pp2 dp2 ep2 with the uninterrupted loss: test_resume_on_another_layout...)


# -- damaged and missing files: one line naming the file and the fix, before anything runs ---------------------
def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGES = {
    "manifest-json": (lambda s: (s / "manifest.json").write_text('{"format": "mhc-pipe-dcp", "step": 1,'),
                      "step_1/manifest.json", "not JSON"),
    "manifest-utf8": (lambda s: (s / "manifest.json").write_bytes(b"\xff\xfe{}"), "step_1/manifest.json",
                      "not UTF-8"),
    "manifest-missing": (lambda s: (s / "manifest.json").unlink(), "step_1/manifest.json", "missing"),
    "shard-flipped": (lambda s: _flip(s / "__1_0.distcp"), "step_1/__1_0.distcp", "sha256"),
    "shard-missing": (lambda s: (s / "__3_0.distcp").unlink(), "step_1/__3_0.distcp", "missing"),
    "metadata-truncated": (lambda s: os.truncate(s / ".metadata", 100), "step_1/.metadata", "bytes"),
    "latest-utf8": (lambda s: (s.parent / "latest").write_bytes(b"\xffstep_1"), "/latest", "not UTF-8"),
    "latest-dangling": (lambda s: (s.parent / "latest").write_text("step_7\n"), "/latest", "step_7"),
}


@pytest.mark.parametrize("case", list(DAMAGES))
def test_damaged_file_is_one_line_naming_it(runs, tmp_path, case):
    damage, names, why = DAMAGES[case]
    d = _copy(runs["base"] / "dualpipe", tmp_path / "ckpt", latest="step_1")
    damage(d / "step_1")
    with pytest.raises(ValueError) as exc:
        dcp.resume_meta(d, parse_config(_cfg("1f1b", 2, dp=2, ep=2)))
    msg = str(exc.value)
    assert "\n" not in msg and str(d) + "/" + names.lstrip("/") in msg and why in msg, msg
    if case.startswith("latest"):
        assert "write 'step_2' into" in msg, msg
    else:
        assert "write 'step_2' into" in msg and str(d / "latest") in msg, msg


def test_other_model_config_names_the_field(runs, tmp_path):
    d = _copy(runs["base"] / "dualpipe", tmp_path / "ckpt")
    cfg = _cfg("dualpipe", 4)
    cfg["model"]["moe"]["expert_hidden"] = 32
    with pytest.raises(ValueError, match=r"model\.moe\.expert_hidden: the checkpoint has 16, this run 32"):
        dcp.resume_meta(d, parse_config(cfg))
    cfg = _cfg("dualpipe", 4)
    cfg["model"]["name"] = "renamed"  # a label, not the model
    cfg["train"]["steps"] = 5
    assert dcp.resume_meta(d, parse_config(cfg))["step"] == 2


def test_metadata_pickle_is_loaded_with_an_allow_list(runs, tmp_path):
    """A .metadata that would run code (its checksum updated too) is refused, and the code does not run."""
    d = _copy(runs["base"] / "dualpipe", tmp_path / "ckpt")
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    meta = d / "step_2" / ".metadata"
    meta.write_bytes(__import__("pickle").dumps(Evil()))
    manifest = json.loads((d / "step_2" / "manifest.json").read_text())
    manifest["files"][".metadata"] = {"bytes": meta.stat().st_size, "sha256": files.sha256(meta)}
    (d / "step_2" / "manifest.json").write_text(json.dumps(manifest))
    cfg = _cfg("dualpipe", 4)
    cfg["train"]["steps"] = 5
    with pytest.raises(ValueError, match=r"\.metadata cannot be read \(UnpicklingError: .*system is not allowed"):
        dcp.resume_meta(d, parse_config(cfg))
    assert not marker.exists()


def test_old_format_is_refused_with_the_converter_command(runs):
    with pytest.raises(ValueError) as exc:
        dcp.resume_meta(runs["old"], parse_config(_cfg("dualpipe", 4)))
    msg = str(exc.value)
    assert "old-format" in msg and f"mhcpipe checkpoint convert {runs['old']} NEW_DIR --config" in msg


def test_converter_refuses_another_model(runs, tmp_path):
    cfg = _cfg("dualpipe", 4)
    cfg["model"]["hidden"] = 48
    with pytest.raises(ValueError, match=r"has shape .* the model of --config .*pass the config the old run used"):
        dcp.convert(runs["old"], tmp_path / "new", parse_config(cfg))
    cfg = _cfg("1f1b", 2)
    cfg["model"]["num_blocks"] = 6
    with pytest.raises(ValueError, match=r"has blocks\.6\..*which the model does not"):
        dcp.convert(runs["old"], tmp_path / "new", parse_config(cfg))
    assert not (tmp_path / "new").exists()


def test_checkpoint_convert_refuses_bad_input_in_one_line(runs, tmp_path):
    """`mhcpipe checkpoint convert` (the app layer's command over pipeline.checkpoint.dcp.convert): a folder that is not
    an old checkpoint, a config that is not there, and another model are each one line naming what is wrong."""
    cfg_path = tmp_path / "other.yaml"
    other = _cfg("dualpipe", 4)
    other["model"]["hidden"] = 48
    cfg_path.write_text(yaml.safe_dump(other))
    for args, words in (((str(tmp_path / "none"), str(tmp_path / "a"), "--config", "tiny"), "is not an old-format"),
                        ((str(runs["old"]), str(tmp_path / "b"), "--config", str(tmp_path / "no.yaml")), "no.yaml"),
                        ((str(runs["old"]), str(tmp_path / "c"), "--config", str(cfg_path)), "the config the old run")):
        res = mhcpipe_in_process("checkpoint", "convert", *args)
        err = res.stderr.strip()
        assert res.returncode == 2 and "\n" not in err and err.startswith("mhcpipe checkpoint: error: "), err
        assert words in err, err
    assert not any((tmp_path / d).exists() for d in "abc")


def _rank_env(rank: int, world: int) -> dict:
    return {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "RANK": str(rank), "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port())}


def test_damaged_files_stop_every_rank_and_the_cli_quickly(runs, tmp_path):
    """What torchrun starts (`python -m pipeline` on each rank): a flipped shard is one line on every rank's stderr,
    exit 2, before any process group; `mhcpipe run` says it once before launching anything."""
    d = _copy(runs["base"] / "dualpipe", tmp_path / "ckpt")
    _flip(d / "step_2" / "__0_0.distcp")
    cfg_path = tmp_path / "pp2.yaml"
    cfg = _cfg("1f1b", 2)
    cfg["train"]["steps"] = 4
    cfg_path.write_text(yaml.safe_dump(cfg))
    args = ["--config", str(cfg_path), "--checkpoint-dir", str(d), "--resume"]
    started = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-m", "pipeline", *args], cwd=ROOT, env=_rank_env(r, 2),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=90) for p in procs]
    wall = time.monotonic() - started
    for r, (p, (_, err)) in enumerate(zip(procs, outs)):
        err = err.strip()
        assert p.returncode == 2 and len(err.splitlines()) == 1, (r, p.returncode, err)
        assert err.startswith(f"python -m pipeline: error (rank {r}): --resume: {d / 'step_2' / '__0_0.distcp'} is "
                              "damaged (sha256 differs"), err
        assert "write 'step_1' into" in err, err
    assert wall < 60, wall
    (d / "step_2" / "manifest.json").write_text("{")
    cli = subprocess.run([sys.executable, "-m", "mhcpipe", "run", *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    err = cli.stderr.strip()
    assert cli.returncode == 2 and len(err.splitlines()) == 1, err
    assert f"{d / 'step_2' / 'manifest.json'} is damaged (not JSON" in err, err
