"""A checkpoint folder on disk: the `latest` pointer, the manifest and its per-file sha256, and DCP reading with
weights_only semantics. Every problem is a one-line ValueError naming the file and the fix (restore it, or point
`latest` at an earlier complete checkpoint). The layout of a folder is described in pipeline.checkpoint.dcp.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import re
import shutil
import warnings
from pathlib import Path

import torch

FORMAT = "mhc-pipe-dcp"
VERSION = 1
LATEST = "latest"
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"step_(\d+)")
_CONVERT = "mhcpipe checkpoint convert {old} NEW_DIR --config CONFIG"


# -- small file helpers ----------------------------------------------------------------------------------------
def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def read_latest_name(directory: Path) -> str | None:
    try:
        return (directory / LATEST).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None


# -- reading -----------------------------------------------------------------------------------------------------
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "TensorProperties",
                                              "_MEM_FORMAT_ENCODING", "ChunkStorageMetadata", "MetadataIndex",
                                              "StorageMeta", "BytesStorageMetadata"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's .metadata allowing only its own classes, torch.Size and dtypes (weights_only semantics)."""

    def find_class(self, module, name):
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if name in _METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's .metadata")


def read_metadata(step_dir: Path):
    """DCP's Metadata of a checkpoint folder, unpickled with the allow-list."""
    return _MetadataUnpickler(io.BytesIO((Path(step_dir) / ".metadata").read_bytes())).load()


def _reader(step_dir: Path):
    import torch.distributed.checkpoint as dcp

    class Reader(dcp.FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            md = read_metadata(Path(self.path))
            if getattr(md, "storage_meta", None) is None:
                from torch.distributed.checkpoint.metadata import StorageMeta

                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    return Reader(step_dir)


def dcp_load(step_dir: Path, sd: dict) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "torch.distributed is disabled ...": no_dist is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(sd, storage_reader=_reader(step_dir), no_dist=True)


def read_all(step_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder, on the CPU (single process: tests, inspection)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = read_metadata(step_dir)
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()
          if isinstance(m, TensorStorageMetadata)}
    dcp_load(Path(step_dir), sd)
    return sd


def _earlier(directory: Path, than: str | None) -> list[str]:
    """Other checkpoint folders with a manifest, newest first (candidates for `latest`)."""
    found = []
    for entry in directory.iterdir() if directory.is_dir() else ():
        m = _STEP_DIR.fullmatch(entry.name)
        if m and entry.name != than and (entry / MANIFEST).is_file():
            found.append((int(m.group(1)), entry.name))
    return [name for _, name in sorted(found, reverse=True)]


def fix_hint(directory: Path, damaged: str | None) -> str:
    others = _earlier(directory, damaged)
    if others:
        return (f"restore it, or resume from an earlier checkpoint: write '{others[0]}' into {directory / LATEST}"
                + (f" (complete folders here: {', '.join(others)})" if len(others) > 1 else ""))
    return "restore it, or start again without --resume"


def latest_step_dir(directory: Path) -> Path:
    latest = directory / LATEST
    if not latest.exists():
        if (directory / "latest.json").exists():
            raise ValueError(f"--resume: {directory} holds an old-format checkpoint (latest.json + stage<s>.pt); "
                             f"convert it: {_CONVERT.format(old=directory)}, then --checkpoint-dir NEW_DIR")
        others = _earlier(directory, None)
        hint = f"; to resume one of {', '.join(others)}, write its name into {latest}" if others else ""
        raise ValueError(f"--resume: no checkpoint in {directory} ({LATEST} missing){hint}")
    try:
        name = latest.read_bytes().decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ValueError(f"--resume: {latest} is damaged (not UTF-8 text); it names the checkpoint folder to resume: "
                         f"{fix_hint(directory, None)}") from None
    except OSError as err:
        raise ValueError(f"--resume: cannot read {latest}: {err.strerror}") from None
    if not _STEP_DIR.fullmatch(name):
        raise ValueError(f"--resume: {latest} is damaged (holds {name[:40]!r}, not a folder name step_<k>); "
                         f"{fix_hint(directory, None)}")
    step_dir = directory / name
    if not step_dir.is_dir():
        raise ValueError(f"--resume: {latest} names {name}, but {step_dir} is missing; {fix_hint(directory, name)}")
    return step_dir


def read_manifest(directory: Path, step_dir: Path) -> dict:
    path = step_dir / MANIFEST
    fix = fix_hint(directory, step_dir.name)
    try:
        text = path.read_bytes().decode("utf-8")
        manifest = json.loads(text)
    except FileNotFoundError:
        raise ValueError(f"--resume: {path} is missing (the save did not finish); {fix}") from None
    except UnicodeDecodeError:
        raise ValueError(f"--resume: {path} is damaged (not UTF-8 text); {fix}") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"--resume: {path} is damaged (not JSON: {err.msg} at line {err.lineno}); {fix}") from None
    except OSError as err:
        raise ValueError(f"--resume: cannot read {path}: {err.strerror}; {fix}") from None
    ok = (isinstance(manifest, dict) and manifest.get("format") == FORMAT and isinstance(manifest.get("step"), int)
          and isinstance(manifest.get("files"), dict) and ".metadata" in manifest["files"]
          and isinstance(manifest.get("model"), dict)
          and all(isinstance(v, dict) and isinstance(v.get("bytes"), int) and isinstance(v.get("sha256"), str)
                  for v in manifest["files"].values()))
    if not ok:
        raise ValueError(f"--resume: {path} is damaged (not a {FORMAT} manifest: format, step, model and files with "
                         f"bytes and sha256 per file, .metadata among them); {fix}")
    if manifest.get("version", VERSION) > VERSION:
        raise ValueError(f"--resume: {path} is format version {manifest['version']}; this mhc-pipe reads up to "
                         f"{VERSION}: upgrade mhc-pipe")
    if f"step_{manifest['step']}" != step_dir.name:
        raise ValueError(f"--resume: {path} is damaged (says step {manifest['step']} in folder {step_dir.name}); {fix}")
    return manifest


def verify_files(directory: Path, step_dir: Path, manifest: dict) -> None:
    fix = fix_hint(directory, step_dir.name)
    for name, want in sorted(manifest["files"].items()):
        path = step_dir / name
        if "/" in name or name in ("", ".", ".."):
            raise ValueError(f"--resume: {step_dir / MANIFEST} is damaged (file name {name!r}); {fix}")
        if not path.is_file():
            raise ValueError(f"--resume: {path} is missing (listed in {MANIFEST}); {fix}")
        size = path.stat().st_size
        if size != want["bytes"]:
            raise ValueError(f"--resume: {path} is damaged ({size} bytes, {MANIFEST} says {want['bytes']}); {fix}")
        if sha256(path) != want["sha256"]:
            raise ValueError(f"--resume: {path} is damaged (sha256 differs from {MANIFEST}); {fix}")


def checked_metadata(directory: Path, step_dir: Path):
    """DCP's Metadata of the checkpoint, or one line naming .metadata (refused classes, an unreadable pickle)."""
    try:
        return read_metadata(step_dir)
    except Exception as err:  # noqa: BLE001 - unpickling errors have no common type
        raise ValueError(f"--resume: {step_dir / '.metadata'} cannot be read ({type(err).__name__}: "
                         f"{str(err).splitlines()[0][:160] if str(err) else ''}); "
                         f"{fix_hint(directory, step_dir.name)}") \
            from None


_STEP_ANY = re.compile(r"step_(\d+)(\.tmp|\.old)?")


def prune(directory: Path, latest: str, keep: int) -> list[str]:
    """Remove every step folder but the `keep` newest complete ones up to `latest` (which is kept): older ones,
    folders of a later step than `latest` (an overwritten run's, or a save that never reached `latest`) and
    leftovers (.tmp of finished saves, .old). Returns the names removed."""
    now = int(_STEP_ANY.fullmatch(latest).group(1))
    complete = sorted((int(m.group(1)), e.name) for e in directory.iterdir() if e.is_dir()
                      and (m := _STEP_ANY.fullmatch(e.name)) and m.group(2) is None and int(m.group(1)) <= now)
    kept = {name for _, name in complete[-keep:]} | {latest}
    removed = []
    for entry in directory.iterdir():
        m = _STEP_ANY.fullmatch(entry.name)
        if entry.is_dir() and m and entry.name not in kept:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry.name)
    return sorted(removed)
