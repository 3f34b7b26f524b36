"""The config a run's flags make, shared by `torchrun -m pipeline` (pipeline/__main__.py, which declares the flags:
`add_run_arguments`) and `mhcpipe run` (mhcpipe/run_cli.py, which checks them once before it launches torchrun).
The functions here take the parsed flags (`RunFlags`: what the entries' parsers return); the command line itself is
parsed in the entries.

`config_from_args` overlays the flags on the YAML config and checks the layout;
`interleaved_configs` adds the --interleave variant; `check_resume` checks --resume against the checkpoint folder;
`variant_dir` is where an interleaved variant's trace goes. Bad values raise ValueError with one line naming the
flag or field.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the type of every `cfg` here; configs is imported where it is used
    from configs import RunConfig

from pathlib import Path
from typing import Protocol


class RunFlags(Protocol):
    """The parsed run flags (pipeline.__main__.add_run_arguments declares them); None = the flag was not given."""

    config: str
    schedule: str | None
    microbatches: int | None
    pp: int | None
    dp: int | None
    ep: int | None
    steps: int | None
    residual: str | None
    expand: str | None
    recompute: str | None
    device: str | None
    dtype: str | None
    emulate_cuda: bool
    timeout: float | None
    transport: str
    comm_rules: str | None
    p2p_groups: str | None
    diagnostics_every: int | None
    diagnostics_dir: Path | None
    trace_dir: Path | None
    trace_format: str | None
    checkpoint_dir: Path | None
    resume: bool | None  # None: resume when the folder holds a checkpoint of this model (pipeline.checkpoint.policy)
    overwrite: bool
    checkpoint_every: int | None
    keep_checkpoints: int | None
    skip_nonfinite: bool
    async_checkpoint: bool
    interleave: str | None
    no_overlap: bool
    cpu_bind: bool


def _positive(flag: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise ValueError(f"--{flag} {value}: must be >= 1")


# flag -> (config section, field, value to set; None = the flag's own value); `--pp` (which may come from the
# process count) and `--recompute` (parsed) are handled apart
_FLAG_FIELDS = {
    "schedule": ("parallel", "schedule", None),
    "microbatches": ("parallel", "microbatches", None),
    "dp": ("parallel", "data_parallel", None),
    "ep": ("parallel", "expert_parallel", None),
    "no_overlap": ("parallel", "overlap", False),
    "cpu_bind": ("train", "cpu_bind", True),
    "steps": ("train", "steps", None),
    "device": ("train", "device", None),
    "dtype": ("train", "dtype", None),
    "emulate_cuda": ("train", "emulate_cuda", True),
    "timeout": ("train", "timeout_s", None),
    "diagnostics_every": ("train", "diagnostics_every", None),
    "trace_format": ("train", "trace_format", None),
    "p2p_groups": ("parallel", "p2p_groups", None),
    "checkpoint_every": ("train", "checkpoint_every", None),
    "keep_checkpoints": ("train", "keep_checkpoints", None),
    "skip_nonfinite": ("train", "skip_nonfinite", True),
    "async_checkpoint": ("train", "checkpoint_async", True),
}
# the one switch for the NCCL-rules transport: train.comm_rules, --comm-rules and $MHCPIPE_COMM_RULES, one spelling
COMM_RULES = ("backend", "nccl", "nccl-pair")
COMM_RULES_ENV = "MHCPIPE_COMM_RULES"


def config_from_args(args: RunFlags, world: int | None, model: dict | None = None):
    """The run's config from the file and the flags; `world` (processes started), when known, sets the pipeline
    ranks if --pp is not given (world / data_parallel) and must equal pp x dp. `model`: a model section that
    replaces the file's before validation (a user's model: pipeline.launch.user_config)."""
    from configs import load_config_data, parse_config
    from pipeline.distributed.layout import Layout

    for flag in ("pp", "dp", "ep", "microbatches", "steps", "diagnostics_every"):
        _positive(flag, getattr(args, flag))
    over: dict = {"parallel": {}, "train": {}, "model": {}}
    for flag, (section, field, value) in _FLAG_FIELDS.items():
        given = getattr(args, flag, None)
        if given:  # unset flags (None, False, 0) keep the config's value
            over[section][field] = given if value is None else value
    if getattr(args, "comm_rules", None):
        over["train"]["comm_rules"] = args.comm_rules
    if args.pp:
        over["parallel"]["ranks"] = args.pp
    elif world is not None:
        data, _ = load_config_data(args.config, {k: v for k, v in over.items() if v})
        dp = (data.get("parallel") or {}).get("data_parallel", 1)
        if not isinstance(dp, int) or dp < 1:
            dp = 1  # the validation below names the bad field
        if world % dp:
            raise ValueError(f"parallel.data_parallel (--dp {dp}) does not divide the {world} processes started; "
                             "processes = --pp x --dp")
        over["parallel"]["ranks"] = world // dp
    if args.recompute:
        if args.recompute in ("off", "auto"):
            over["recompute"] = {"mode": args.recompute}
        elif args.recompute.isdigit():
            over["recompute"] = {"mode": "block", "block_size": int(args.recompute)}
        else:
            raise ValueError(f"--recompute {args.recompute!r}: use 'off', 'auto' or a block size")
    data, path = load_config_data(args.config, {k: v for k, v in over.items() if v})
    if model is not None:
        data["model"] = model
    cfg = parse_config(data, str(path))
    if args.residual:
        cfg = with_residual_flag(cfg, "--residual", args.residual)
    if getattr(args, "expand", None):
        from configs import parse_config

        data = cfg.model_dump()
        data["model"]["residual"]["expand"] = args.expand
        cfg = parse_config(data)
    Layout.of(cfg).check(cfg, world)
    refuse_cost_model_only(cfg)
    if cfg.train.diagnostics_every and diagnostics_dir(args) is None:
        raise ValueError("--diagnostics-every (train.diagnostics_every) writes diagnostics_rank<r>.json into a "
                         "folder: add --diagnostics-dir DIR (or --trace-dir DIR)")
    return cfg


def refuse_cost_model_only(cfg: RunConfig) -> None:
    """The fields the cost model prices but this runtime does not build (its attention is multi-head, its GEMMs run
    in the activation dtype, its router has no node limit): a run would silently train another model."""
    moe = cfg.model.moe
    given = [name for name, on in (("model.mla", cfg.model.mla is not None), ("model.mtp_depth", cfg.model.mtp_depth),
                                   ("train.fp8", cfg.train.fp8),
                                   ("model.moe.max_nodes_per_token", moe is not None and moe.max_nodes_per_token))
             if on]
    if given:
        raise ValueError(f"{', '.join(given)}: priced by the cost model only (mhcpipe predict / tune); the runtime "
                         "builds multi-head attention, no MTP, GEMMs in train.dtype and unlimited routing: drop "
                         f"{'them' if len(given) > 1 else 'it'} from the config to run it")


def with_residual_flag(cfg: RunConfig, flag: str, value: str):
    """cfg with the residual a VARIANT:N (xHC: xhc:N:K) flag names, validated like a config file."""
    from configs import parse_config

    from kernels import residual_spec as rs

    try:
        variant, n, k = rs.parse(value, check=False)  # the one spelling; the config names a bad value
    except ValueError as err:
        raise ValueError(f"{flag} {err}") from None
    try:
        return parse_config(cfg.with_residual(variant, n, k).model_dump())
    except (ValueError, TypeError) as err:  # pydantic's ValidationError is a ValueError: one line naming the field
        first = err.errors()[0]["msg"] if hasattr(err, "errors") else str(err)
        raise ValueError(f"{flag}: model.residual: {first}") from None


def diagnostics_dir(args: RunFlags) -> Path | None:
    """Where the run's diagnostics go: --diagnostics-dir, else --trace-dir, else nowhere."""
    return getattr(args, "diagnostics_dir", None) or getattr(args, "trace_dir", None)


def interleaved_configs(cfg: RunConfig, args: RunFlags) -> list:
    """[cfg] or, with --interleave, [cfg, the same with the other residual]; refuses what cannot be interleaved."""
    if not args.interleave:
        return [cfg]
    if args.checkpoint_dir is not None or args.resume:
        raise ValueError("--interleave measures two variants side by side; it does not checkpoint or resume "
                         "(drop --checkpoint-dir/--resume)")
    other = with_residual_flag(cfg, "--interleave", args.interleave)
    if other.model.residual == cfg.model.residual:
        raise ValueError(f"--interleave {args.interleave}: the run already uses that residual; name the other "
                         "variant, e.g. --residual mhc:4 --interleave residual:1")
    return [cfg, other]


def check_resume(cfg: RunConfig, args: RunFlags) -> str | None:
    """Decide whether the run resumes (pipeline.checkpoint.policy: by default when --checkpoint-dir holds a
    checkpoint of this model), before launch, and set `args.resume` to the answer; returns the line to print."""
    from pipeline.checkpoint.policy import decide_resume

    if args.checkpoint_dir is None:
        if args.resume:
            raise ValueError("--resume needs --checkpoint-dir (the folder a run wrote with --checkpoint-dir)")
        if getattr(args, "overwrite", False):
            raise ValueError("--overwrite needs --checkpoint-dir (the folder whose checkpoints a fresh run replaces)")
        args.resume = False
        return None
    args.resume, line = decide_resume(Path(args.checkpoint_dir), cfg, args.resume, getattr(args, "overwrite", False))
    return line


def variant_dir(trace_dir: Path, cfg: RunConfig) -> Path:
    """TRACE_DIR/<variant>_<n> (xHC: xhc_<N>_<k>): where an interleaved variant's trace goes."""
    return Path(trace_dir) / cfg.model.residual.label.replace(":", "_")
