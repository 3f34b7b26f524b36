"""Checkpoints with torch.distributed.checkpoint (DCP), keyed by the single-process model's parameter names, so
that a run on any layout (pp, dp, ep, schedule) resumes a checkpoint written by any other.

Layout of a checkpoint directory:
    latest              "step_<k>": the newest complete checkpoint (replaced atomically: tmp file + os.replace)
    step_<k>/           one checkpoint: DCP's .metadata and __<rank>_0.distcp shards, and
        manifest.json   {"format", "step", "schedule", "layout": {pp, dp, ep}, "dtype", "model" (cfg.model without
                         its name), "model_digest", "files": {name: {"bytes", "sha256"}}}
    step_<k>.tmp/       a save in progress (or one a crash interrupted: never read, removed by the next save)

Keys: `model.<fqn>` for every parameter and `optim.<fqn>.<state>` for its AdamW state (step, exp_avg,
exp_avg_sq), where <fqn> is the name in the single-process model (`embed.*`, `blocks.<b>.*`, `head.*`; experts by
their global index, `...experts.<e>...`, on every EP layout). Every rank saves the keys its stages hold; copies of
one key (data-parallel replicas, DualPipe's mirrored chunks: identical after their all-reduce) are written once
(DCP's save planner deduplicates replicated keys). On load every rank asks for exactly the keys its stages hold
(DCP, no collectives: each rank reads on its own), so pp=4 -> pp=2 x dp=2 x ep=2 or dualpipe -> 1f1b just works.
Only a different model config is refused (one line naming the differing field); train.dtype may differ (values
are converted).

Save (after every step; collective over the world group passed in via the runtime): rank 0 clears
step_<k>.tmp, barrier, every rank writes its shards with dcp.save, barrier, rank 0 hashes every file into the
manifest, renames step_<k>.tmp -> step_<k>, replaces `latest`, and removes older checkpoints but the previous one;
barrier. A crash at any point leaves `latest` naming a complete checkpoint.

Resume (`resume_meta`, before any process group exists, on every rank, and by `mhcpipe run` before it launches
torchrun): `latest`, the manifest and every file's size and sha256 are checked, so a missing or damaged file is
one line naming it and the fix, on every rank, before any training. `.metadata` is unpickled with an allow-list of
DCP's metadata classes (weights_only semantics); tensors are read by DCP with torch.load(weights_only=True).

Old checkpoints (stage<s>.pt + latest.json) are refused with the command that converts them:
    mhcpipe checkpoint convert OLD_DIR NEW_DIR --config CONFIG

Test hook: MHCPIPE_TEST_CRASH_IN_SAVE="<rank>:<step>[:write|publish|enospc]" makes that rank die (os._exit) during
the save of that step: `write` (default) after writing half of its shard, `publish` (rank 0) after writing the
manifest, before the rename; `enospc`: its shard write fails as on a full disk (the save ends with one line on
every rank, the previous checkpoint stays `latest`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the type of every `cfg` here; configs is imported where it is used
    from configs import RunConfig

import hashlib
import json
import os
import shutil
import sys
import warnings
from pathlib import Path

import torch

from pipeline.checkpoint.files import (FORMAT, LATEST, MANIFEST, VERSION, atomic_write_text, checked_metadata, dcp_load,
                                     fix_hint, fsync_dir, latest_step_dir, read_all, read_manifest, sha256,
                                     prune, verify_files)

__all__ = ["save", "load", "resume_meta", "read_all", "convert", "state_dict", "CRASH_ENV"]

CRASH_ENV = "MHCPIPE_TEST_CRASH_IN_SAVE"


def _model_dict(model_cfg) -> dict:
    """The model config that must match to resume (its name is a label only)."""
    d = model_cfg.model_dump(mode="json")
    d.pop("name", None)
    return d


def _digest(model: dict) -> str:
    return hashlib.sha256(json.dumps(model, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class ModelMismatch(ValueError):
    """The checkpoint was written by another model config (its message names the first differing field)."""

    def __init__(self, message: str, step_dir: Path, diff: str):
        super().__init__(message)
        self.step_dir, self.diff = step_dir, diff


def _first_difference(was, now, path: str) -> str | None:
    if isinstance(was, dict) and isinstance(now, dict):
        for key in sorted(set(was) | set(now)):
            diff = _first_difference(was.get(key), now.get(key), f"{path}.{key}")
            if diff:
                return diff
        return None
    if was != now:
        return f"{path}: the checkpoint has {json.dumps(was)}, this run {json.dumps(now)}"
    return None


# -- the state dict ----------------------------------------------------------------------------------------------
def state_dict(rt) -> dict[str, torch.Tensor]:
    """This rank's keys: its stages' parameters and their optimizer state, by global parameter name."""
    out: dict[str, torch.Tensor] = {}
    state = rt.optimizer.state
    for name, p in rt.params.items():
        out[f"model.{name}"] = p.detach()
        for k, v in state.get(p, {}).items():
            if not torch.is_tensor(v):
                v = torch.tensor(v)
            out[f"optim.{name}.{k}"] = v.detach()
    return out


class _Writer:
    """dcp.FileSystemWriter with the crash test hook (built lazily: DCP imports are slow)."""

    @staticmethod
    def make(path: Path, rank: int, crash: bool, disk_full: bool = False):
        import torch.distributed.checkpoint as dcp

        class Writer(dcp.FileSystemWriter):
            def write_data(self, plan, planner):
                if disk_full:  # as a full disk answers the shard's first write
                    import errno

                    raise OSError(errno.ENOSPC, "No space left on device", str(Path(self.path)))
                fut = super().write_data(plan, planner)
                if crash:
                    fut.wait()
                    for wr in fut.value():  # half of each shard written, then the rank dies
                        f = Path(self.path) / wr.storage_data.relative_path
                        if f.exists():
                            os.truncate(f, f.stat().st_size // 2)
                    print(f"{CRASH_ENV}: rank {rank} dies while saving {path}", file=sys.stderr, flush=True)
                    os._exit(1)
                return fut

        return Writer(path, sync_files=True)


def _crash_point(rank: int, step: int) -> str | None:
    spec = os.environ.get(CRASH_ENV)
    if not spec:
        return None
    parts = spec.split(":")
    if len(parts) < 2 or int(parts[0]) != rank or int(parts[1]) != step:
        return None
    return parts[2] if len(parts) > 2 else "write"


def _barrier(rt, what: str, group=None) -> None:
    import torch.distributed as dist

    from pipeline.distributed.collective import collective

    collective(dist.barrier, what=what, rank=rt.rank, timeout_s=rt.timeout_s,
               group=group if group is not None else rt.groups.world_group)


def save(directory: Path, rt, step: int, *, state: dict | None = None, group=None) -> None:
    """Save step `step` (collective: every rank of the world calls it after the step). `state`: this rank's keys
    already staged (pipeline.checkpoint.async_save; default: read from the runtime now); `group`: the process
    group the save's barriers and DCP's collectives run on (default: the world's)."""
    import torch.distributed.checkpoint as dcp

    from pipeline.distributed.errors import PipelineError, describe

    directory = Path(directory)
    tmp = directory / f"step_{step}.tmp"
    crash = _crash_point(rt.rank, step)
    if rt.rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # an interrupted save of this step
    _barrier(rt, "the checkpoint barrier (before the save)", group)
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.save(state if state is not None else state_dict(rt),
                 storage_writer=_Writer.make(tmp, rt.rank, crash == "write", crash == "enospc"),
                 process_group=group if group is not None else rt.groups.world_group)
    except CheckpointException as err:  # a BaseException: the ranks whose writes failed, gathered on every rank
        failed = PipelineError(f"rank {rt.rank}: saving the checkpoint to {tmp} failed ({first_failure(err)}); "
                               f"{directory / LATEST} still names the previous complete checkpoint")
        failed.hang_related = False  # a disk's answer, not a communication fault
        raise failed from None
    except Exception as err:  # noqa: BLE001 - DCP wraps backend and I/O errors alike
        raise PipelineError(f"rank {rt.rank}: saving the checkpoint to {tmp} failed: {describe(err)}") from None
    _barrier(rt, "the checkpoint barrier (shards written)", group)
    if rt.rank == 0:
        _publish(directory, tmp, step, rt.cfg, die_before_rename=crash == "publish")
    _barrier(rt, "the checkpoint barrier (published)", group)


def first_failure(err) -> str:
    """'rank 2: [Errno 28] No space left on device: ...' of a DCP CheckpointException (its first failed rank)."""
    for rank, (exc, _) in sorted(err.failures.items()):
        return f"rank {rank}: {type(exc).__name__}: {exc}".splitlines()[0]
    return "no rank named"


def _manifest(step_dir: Path, step: int, cfg: RunConfig) -> dict:
    par = cfg.parallel
    model = _model_dict(cfg.model)
    files = {f.name: {"bytes": f.stat().st_size, "sha256": sha256(f)}
             for f in sorted(step_dir.iterdir()) if f.is_file() and f.name != MANIFEST}
    return {"format": FORMAT, "version": VERSION, "step": step, "schedule": par.schedule,
            "layout": {"pp": par.ranks, "dp": par.data_parallel, "ep": par.expert_parallel},
            "dtype": cfg.train.dtype, "model": model, "model_digest": _digest(model), "files": files}


def _publish(directory: Path, tmp: Path, step: int, cfg: RunConfig, die_before_rename: bool = False) -> None:
    """Rank 0, all shards written: manifest, rename, `latest`, prune (pipeline.checkpoint.files.prune: the
    train.keep_checkpoints newest are kept)."""
    atomic_write_text(tmp / MANIFEST, json.dumps(_manifest(tmp, step, cfg), indent=1, sort_keys=True))
    fsync_dir(tmp)
    if die_before_rename:
        print(f"{CRASH_ENV}: rank 0 dies before publishing {tmp}", file=sys.stderr, flush=True)
        os._exit(1)
    final = directory / f"step_{step}"
    if final.exists():  # a fresh run writing into an old run's directory
        aside = directory / f"step_{step}.old"
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    os.replace(tmp, final)
    fsync_dir(directory)
    atomic_write_text(directory / LATEST, f"step_{step}\n")
    prune(directory, final.name, cfg.train.keep_checkpoints)


_VERIFIED: dict[tuple[str, str], dict] = {}  # (step dir, manifest digest) -> manifest, verified in this process


def resume_meta(directory: Path, cfg: RunConfig) -> dict:
    """The manifest of the checkpoint a run of `cfg` resumes from, checked before any process group exists:
    `latest`, the manifest and every file (size, sha256) intact, the same model config, steps left to train
    (train.steps counts from step 0). Adds "path": the checkpoint folder. One-line ValueError otherwise."""
    directory = Path(directory)
    step_dir = latest_step_dir(directory)
    manifest = read_manifest(directory, step_dir)
    diff = _first_difference(manifest["model"], _model_dict(cfg.model), "model")
    if diff:
        raise ModelMismatch(f"--resume: {step_dir} was written by another model config ({diff}); resume with the "
                            "checkpoint's model config or start without --resume", step_dir, diff)
    key = (str(step_dir.resolve()), _digest(manifest))
    if key not in _VERIFIED:
        verify_files(directory, step_dir, manifest)
        checked_metadata(directory, step_dir)
        _VERIFIED[key] = manifest
    done = manifest["step"] + 1
    if done >= cfg.train.steps:
        raise ValueError(f"--resume: the checkpoint in {directory} has trained {done} steps and train.steps is "
                         f"{cfg.train.steps}: nothing left to run; raise --steps (it counts from step 0)")
    return {**manifest, "path": str(step_dir)}


def load(directory: Path, rt) -> int:
    """Load the parameters and optimizer state of this rank's stages; returns the next step to run. Every rank
    reads its own keys (no collectives); a barrier at the end."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = resume_meta(Path(directory), rt.cfg)
    step_dir = Path(meta["path"])
    have = checked_metadata(Path(directory), step_dir).state_dict_metadata
    sd: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[str, torch.Tensor]] = {}
    prefixes = {f"optim.{name}.": name for name in rt.params}
    for key, md in have.items():
        if key.startswith("optim.") and isinstance(md, TensorStorageMetadata):
            name, _, state = key.rpartition(".")
            pname = prefixes.get(name + ".")
            if pname is not None:
                p = rt.params[pname]
                on_param = tuple(md.size) == tuple(p.shape) and state != "step"
                buf = torch.empty(md.size, dtype=p.dtype if on_param else md.properties.dtype,
                                  device=p.device if on_param else "cpu")
                optim.setdefault(pname, {})[state] = sd[key] = buf
    for name, p in rt.params.items():
        key = f"model.{name}"
        md = have.get(key)
        if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != tuple(p.shape):
            # (a key stored as bytes would be unpickled by DCP without weights_only: never asked for)
            what = ("has no" if md is None else "has no tensor for" if not isinstance(md, TensorStorageMetadata)
                    else f"has shape {list(md.size)} for")
            raise ValueError(f"--resume: {step_dir} {what} parameter {name} (this run: {list(p.shape)}); it does not "
                             "match this model")
        sd[key] = p.detach()
    try:
        with torch.no_grad():
            dcp_load(step_dir, sd)
    except Exception as err:  # noqa: BLE001
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise ValueError(f"--resume: reading {step_dir} failed ({first}); {fix_hint(Path(directory), step_dir.name)}") \
            from None
    for pname, state in optim.items():
        rt.optimizer.state[rt.params[pname]] = state
    _barrier(rt, "the barrier after loading the checkpoint")
    return int(meta["step"]) + 1


# -- converting old checkpoints ---------------------------------------------------------------------------------
def model_shapes(cfg: RunConfig) -> dict[str, torch.Size]:
    """Every parameter of the single-process model and its shape (built on the meta device: no memory)."""
    from pipeline.model import build_block, build_embedding, build_head, param_dtype

    mc, seed = cfg.model, cfg.train.seed
    with torch.device("meta"):
        parts = {"embed": build_embedding(mc, seed, param_dtype(cfg.train.dtype)), "head": build_head(mc, seed)}
        parts.update({f"blocks.{b}": build_block(mc, cfg.parallel.seq_len, b, seed) for b in range(mc.num_blocks)})
    return {f"{prefix}.{n}": p.shape for prefix, mod in parts.items() for n, p in mod.named_parameters()}


def convert(old_dir: Path, new_dir: Path, cfg: RunConfig) -> Path:
    """An old-format checkpoint (stage<s>[.ep<e>].pt + latest.json) -> NEW_DIR/step_<k> in this format. `cfg`:
    the run's config (the old format does not record the model); names and shapes are checked against it."""
    import torch.distributed.checkpoint as dcp

    old_dir, new_dir = Path(old_dir), Path(new_dir)
    latest = old_dir / "latest.json"
    try:
        meta = json.loads(latest.read_bytes().decode("utf-8"))
        step = int(meta["step"])
    except FileNotFoundError:
        raise ValueError(f"{latest} is missing: {old_dir} is not an old-format checkpoint folder") from None
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError):
        raise ValueError(f"{latest} is damaged (not JSON with a step); it cannot be converted") from None
    files = sorted(old_dir.glob("stage*.pt"))
    if not files:
        raise ValueError(f"{old_dir} has no stage<s>.pt files to convert")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            blob = torch.load(f, map_location="cpu", weights_only=True)
            if blob["step"] != step:
                raise ValueError(f"{f} is from step {blob['step']}, {latest} says {step}: the old save did not "
                                 "finish; it cannot be converted")
            params, optim = blob["params"], blob["optim"]
        except ValueError:
            raise
        except Exception as err:  # noqa: BLE001 - unpickling errors have no common type
            raise ValueError(f"{f} is damaged ({type(err).__name__}); it cannot be converted") from None
        for name, t in params.items():
            sd.setdefault(f"model.{name}", t)  # DualPipe's copies and the replicas: the same values
        for name, state in optim.items():
            for k, v in state.items():
                sd.setdefault(f"optim.{name}.{k}", v if torch.is_tensor(v) else torch.tensor(v))
    shapes = model_shapes(cfg)
    names = {k[len("model."):] for k in sd if k.startswith("model.")}
    if names != set(shapes):
        missing, extra = sorted(set(shapes) - names), sorted(names - set(shapes))
        what = f"lacks {missing[0]}" if missing else f"has {extra[0]}, which the model does not"
        raise ValueError(f"{old_dir} {what} ({len(missing)} missing, {len(extra)} unknown): it was not written by "
                         "the model of --config; pass the config the old run used")
    for name, shape in shapes.items():
        if sd[f"model.{name}"].shape != shape:
            raise ValueError(f"{old_dir}: {name} has shape {list(sd[f'model.{name}'].shape)}, the model of --config "
                             f"{list(shape)}; pass the config the old run used")
    new_dir.mkdir(parents=True, exist_ok=True)
    tmp = new_dir / f"step_{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True), no_dist=True)
    old_par = {"schedule": meta.get("schedule", cfg.parallel.schedule), "ranks": meta.get("ranks", cfg.parallel.ranks),
               "data_parallel": meta.get("data_parallel", 1), "expert_parallel": meta.get("expert_parallel", 1)}
    was = cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update=old_par)})
    _publish(new_dir, tmp, step, was)
    return new_dir / f"step_{step}"
