"""A user's model as a run: its builder called under the run's seed, the config that describes it, what the runtime
refuses for it (pipeline.user_model is the model's contract; this is the run around it).

`load_builder("examples/my_model.py:build")` (or "package.module:build") finds a builder without running the file as a
script; `build_model(builder, seed, residual)` calls it under a seed derived from the run's (every rank builds the
same parameters) and turns any failure into one line; `user_run(builder, args, world)` is what a user's torchrun
script does before training: the run flags' config, its `model` section describing the user's model
(`model_section`).

`cfg.model` of a user run: name, vocab_size, num_blocks, hidden and residual (variant and n) are the user model's;
num_heads, head_dim and mlp_hidden are the built-in block's fields and say nothing about the user's blocks
(head_dim = mlp_hidden = hidden, one head; nothing of the runtime reads them for a user model).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the type of every `cfg` here; configs is imported where it is used
    from configs import RunConfig

import hashlib
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path

from schedules import build as build_schedule

from pipeline.model import seeded
from pipeline.partition import chunk_count
from pipeline.user_model import UserModel


def load_builder(spec: str):
    """'path/to/file.py:build' or 'package.module:build' -> the builder (a callable returning a UserModel)."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise ValueError(f"model {spec!r}: give FILE.py:FUNCTION or MODULE:FUNCTION, e.g. examples/hc_model.py:build")
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_file():
                raise ValueError(f"model {spec!r}: {path} does not exist")
            modname = "mhcpipe_user_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
            loader = importlib.util.spec_from_file_location(modname, path)
            module = importlib.util.module_from_spec(loader)
            sys.modules[modname] = module  # pickling the builder's classes (rank processes) needs the module
            sys.path.insert(0, str(path.resolve().parent))  # the file's own imports of its neighbours
            try:
                loader.loader.exec_module(module)
            finally:
                sys.path.remove(str(path.resolve().parent))
        else:
            module = importlib.import_module(where)
    except ValueError:
        raise
    except Exception as err:  # noqa: BLE001 - the user's file: any error is one line
        raise ValueError(f"model {spec!r}: importing {where} failed: {type(err).__name__}: {err}") from None
    builder = getattr(module, name, None)
    if not callable(builder):
        raise ValueError(f"model {spec!r}: {where} has no function {name}")
    return builder


def build_model(builder, seed: int, residual: str | None = None, seq_len: int | None = None) -> UserModel:
    """The builder's model, built under (seed, 'user-model'): every rank and the unsplit reference get the same
    parameters. `residual` (--residual) goes to builders that take it; so does the run's `seq_len` (attention
    inside a block needs the sequences of its [T, ...] tokens)."""
    params = inspect.signature(builder).parameters
    if residual is not None and "residual" not in params:
        raise ValueError(f"--residual {residual}: this model's builder {builder.__name__}() takes no residual argument "
                         "(sub-layer models built with UserModel.from_sublayers do: def build(residual='mhc:4'))")
    kwargs = {} if residual is None else {"residual": residual}
    if seq_len is not None and "seq_len" in params:
        kwargs["seq_len"] = seq_len
    try:
        with seeded(seed, "user-model"):
            model = builder(**kwargs)
    except ValueError as err:
        raise ValueError(f"building the model ({builder.__name__}): {err}") from None
    except Exception as err:  # noqa: BLE001 - the user's code: any error is one line
        raise ValueError(f"building the model ({builder.__name__}) failed: {type(err).__name__}: {err}") from None
    if not isinstance(model, UserModel):
        raise ValueError(f"{builder.__name__}() returned a {type(model).__name__}; it must return a "
                         "pipeline.user_model.UserModel")
    return model


def model_section(model: UserModel) -> dict:
    """The `model` section of a config describing `model` (module docstring: which fields mean something)."""
    if model.residual is not None:
        residual = model.residual.model_dump()
    else:
        residual = {"variant": "mhc" if model.n > 1 else "residual", "n": model.n}
    return {"name": f"{model.name} (user model)", "vocab_size": model.vocab_size, "num_blocks": len(model.blocks),
            "hidden": model.hidden, "num_heads": 1, "head_dim": model.hidden, "mlp_hidden": model.hidden,
            "residual": residual}


def user_config(cfg: RunConfig, model: UserModel):
    """`cfg` (the run's parallel/train/recompute settings) with `model` describing the user's model."""
    from configs import parse_config

    data = cfg.model_dump()
    data["model"] = model_section(model)
    return parse_config(data)


def refuse_for_user_model(cfg: RunConfig, args) -> None:
    """What the runtime does for its own model only (one line each)."""
    refused = [("--interleave", getattr(args, "interleave", None)),
               ("--expand (give UserModel.expand)", getattr(args, "expand", None)),
               ("--ep (expert parallelism splits the built-in MoE's experts; a user block's experts would need a "
                "way to name them to the runtime and its dispatch/combine phases to run on the runtime's expert "
                "groups, which the user-model API does not have yet)", cfg.parallel.expert_parallel > 1),
               ("--diagnostics-every (reads the built-in mHC coefficients)", cfg.train.diagnostics_every)]
    given = [name for name, on in refused if on]
    if given:
        raise ValueError(f"{given[0]}: not for a user model; drop it")


def user_run(builder, args, world: int | None):
    """(cfg, model) of a user's torchrun script: the model built under the seed of --config (which gives the
    parallel/train settings; its own model section is replaced by the user's), refused settings named in one line,
    the split checked and one sequence run through every piece before any rank computes."""
    from configs import load_config_data

    from pipeline.launch.run_args import config_from_args

    raw, _ = load_config_data(args.config)
    seed = (raw.get("train") or {}).get("seed", 0)
    seq_len = (raw.get("parallel") or {}).get("seq_len")
    residual, args.residual = args.residual, None
    try:
        model = build_model(builder, seed if isinstance(seed, int) else 0, residual,
                            seq_len if isinstance(seq_len, int) and seq_len > 0 else None)
        cfg = config_from_args(args, world, model=model_section(model))
    finally:
        args.residual = residual
    refuse_for_user_model(cfg, args)
    par = cfg.parallel
    model.chunks(chunk_count(par.schedule, build_schedule(par.schedule, par.ranks, par.microbatches_per_replica)))
    try:
        model.dry_run(par.seq_len)
    except ValueError:
        raise
    except Exception as err:  # noqa: BLE001 - the user's code: one line
        raise ValueError(f"the model's first forward failed: {type(err).__name__}: {err}") from None
    return cfg, model
