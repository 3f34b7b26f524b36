"""Your own model through the pipeline: what a user hands mhc-pipe, and the contract every piece must keep.

Shape letters: T tokens of a micro-batch (batch x sequence, flattened), n residual streams, C hidden, V vocabulary.

A `UserModel` is an embedding (token ids [T] -> [T, C]), an optional stream entry (`expand`, [T, C] -> [T, n, C];
default: n copies), blocks (each [T, n, C] -> [T, n, C]), a head ([T, n, C] -> logits [T, V]: the head reduces the
streams) and a loss (logits [T, V], labels [T] -> this micro-batch's mean token loss), plus n. A model whose
blocks carry more than the streams (DeepSeek-V4's deferred fp32 post/combine term) declares the other tensors in
`extra_state` (StatePart: name, shape per token, dtype): the state between blocks is then the tuple (streams
[T, n, C], *parts [T, ...]), which expand returns, every block maps and the head takes; every part crosses
each stage boundary (packed into one message per channel: pipeline.runtime.boundary) and check-split compares
each. The runtime expands
the streams on a pipeline's first stage only, sends [T, n, C] across every boundary, runs the head (and its stream
reduction) on the last stage only, and hands a block that sets `needs_token_ids = True` the micro-batch's real
token ids as `block(x, token_ids=ids)` on whichever stage holds it (hash routing needs the ids, never something
derived from hidden states).

`UserModel.from_sublayers` builds one from sub-layer functions ([T, C] -> [T, C], e.g. attention and MLP with their
pre-norm) that mhc-pipe wraps in its own residual (`kernels.MHCSublayer`: residual, hc, mhc, mhc-lite), with the
mean over streams before a head that takes [T, C]; `--residual mhc:4` picks the wrapping of such a model.

The F&B pair (DualPipe's overlap of one micro-batch's forward with another's backward): a block that defines
`phases()` -> [(name, fn), ...] (e.g. attention, dispatch, experts, combine) is run phase by phase, each phase a
segment of its stage, and the two halves of a pair hand the compute turn over at every phase boundary
(pipeline.runtime.overlap), as for the built-in model's sub-layers and all-to-alls: a phase that starts
asynchronous communication (keeping its handle in the state it returns) and a later phase that waits for it overlap
it with the other half's phase. fn maps the state to the next: the first phase gets x [T, n, C], the last returns
[T, n, C], a phase in between may return a tuple (tensors, and other values passed on as they are); fn is called
as fn(state, token_ids=ids) when the block sets `needs_token_ids`. The phases chained must compute the block's own
forward (check-split compares the two: the unsplit model runs `forward`). A collective inside a phase must run on a
process group of its own half (forward and backward apart), as our expert exchanges do: which half's phase runs next
depends on when messages arrive. A block without phases is one segment, and the halves of a pair whose stages
hold no phased block run one after the other (the run says so once).

A builder (`def build() -> UserModel`) runs on every rank under the same seed, so every rank holds the same
parameters and keeps only its stages' modules; the parameter names are `embed.*`, `expand.*`, `blocks.<b>.*`,
`head.*` on every layout (checkpoints and gradient comparisons go by them).

bf16 (train.dtype bfloat16): every piece runs under autocast to bf16 with fp32 parameters, and the stream state
between blocks is cast to bf16 (`amp`). Recompute (recompute.mode auto / block): a stage's blocks are rerun as
one unit in its backward (pipeline.runtime.user_stage).

A builder may build on the meta device (`with torch.device("meta"):`): each rank then materialises only its own
pieces (pipeline.user_materialise), and the one-sequence dry run checks shapes on meta tensors.

Tied parameters: one nn.Parameter held by several pieces (an output projection tied to the token embedding, GPT-2
style) is found when the model is built (`ties()`) and goes by its first holder's name (embed, expand, blocks,
head in that order: `embed.weight`, as the unsplit model names it). Every rank holding a piece keeps a copy, and
the copies' gradients are summed over the ranks that hold them before the optimizer (as Megatron sums its shared
embedding's over the first and last stage: pipeline.distributed.tied), so the copies stay bitwise equal.

Bad pieces are refused in one line naming the piece and the fix (`ContractError`, a ValueError): a block whose
output breaks [T, n, C], a head that returns per-stream logits (no stream reduction), an embedding that does not
return [T, C], a loss that is not a scalar.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from kernels import MHCConfig, MHCSublayer, StreamExpand, contract
from kernels import residual_spec as rs


@dataclass(frozen=True)
class StatePart:
    """A tensor carried beside the streams across every block and stage boundary (UserModel.extra_state): its name,
    its shape per token and its dtype (None: the run's activation dtype), e.g. DeepSeek-V4's deferred fp32
    post/combine term, StatePart('deferred', (C,), torch.float32)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype | None = None


class ContractError(ValueError):
    """A piece of a user model broke its shape contract (one line: the piece, what it returned, the fix)."""


class CopyExpand(nn.Module):
    """Default stream entry: h [T, C] -> n copies [T, n, C] (hyper-connections' expand_stream does the same)."""

    def __init__(self, n: int):
        super().__init__()
        self.n = n

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.unsqueeze(1).expand(-1, self.n, -1).contiguous()


class MeanStreamsHead(nn.Module):
    """Head of a sub-layer model: the mean over the streams (kernels.contract), then the user's [T, C] head."""

    def __init__(self, head: nn.Module):
        super().__init__()
        self.inner = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(contract(x))


def parse_residual(value: str | MHCConfig) -> MHCConfig:
    """'mhc:4' (VARIANT:N) -> the MHCConfig mhc-pipe wraps sub-layers in; only MHCSublayer's variants."""
    if isinstance(value, MHCConfig):
        cfg = value
    else:
        try:
            variant, n, k = rs.parse(str(value))  # the one spelling of a residual (kernels.residual_spec)
            cfg = MHCConfig(variant=variant, n=n, **({"active": k} if k is not None else {}))
        except Exception as err:  # noqa: BLE001 - the spec's or pydantic's message, last line
            raise ContractError(f"residual {value!r}: {str(err).splitlines()[-1].strip()}") from None
    if not rs.variant(cfg.variant).wraps_user_sublayers:
        allowed = ", ".join(n for n, v in rs.VARIANTS.items() if v.wraps_user_sublayers)
        raise ContractError(f"residual {cfg.variant!r}: a user model's sub-layers can be wrapped in {allowed} (the "
                            "others carry state between sub-layers the built-in model owns)")
    return cfg


@dataclass
class UserModel:
    """A user's model, as mhc-pipe runs it (module docstring). `split_points`: the first block of every stage
    after the first; without them the stages are balanced by each block's cost, `balance` 'params' (its parameter
    count) or 'measured' (its forward and backward timed on the run's device; rank 0 measures, every rank uses its
    numbers)."""

    embed: nn.Module
    blocks: list[nn.Module]
    head: nn.Module
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    n: int
    hidden: int
    vocab_size: int
    expand: nn.Module | None = None
    split_points: list[int] | None = None
    name: str = "user"
    balance: str = "params"
    residual: MHCConfig | None = field(default=None)  # set by from_sublayers: the wrapping it used
    extra_state: list[StatePart] = field(default_factory=list)  # more tensors carried beside the streams

    def __post_init__(self) -> None:
        for what, value in (("n", self.n), ("hidden", self.hidden), ("vocab_size", self.vocab_size)):
            if not isinstance(value, int) or value < 1:
                raise ContractError(f"UserModel.{what} = {value!r}: a positive integer")
        for what, m in (("embed", self.embed), ("head", self.head)):
            if not isinstance(m, nn.Module):
                raise ContractError(f"UserModel.{what} is a {type(m).__name__}, not a torch.nn.Module")
        self.blocks = list(self.blocks)
        if not self.blocks:
            raise ContractError("UserModel.blocks is empty: a model needs at least one block")
        for b, m in enumerate(self.blocks):
            if not isinstance(m, nn.Module):
                raise ContractError(f"UserModel.blocks[{b}] is a {type(m).__name__}, not a torch.nn.Module")
        if self.balance not in ("params", "measured"):
            raise ContractError(f"UserModel.balance {self.balance!r}: 'params' (parameter counts) or 'measured' "
                                "(timed blocks)")
        if not callable(self.loss):
            raise ContractError("UserModel.loss is not callable: give loss(logits [T, V], labels [T]) -> scalar")
        if self.expand is None:
            self.expand = CopyExpand(self.n)
        self.extra_state = list(self.extra_state)
        for k, part in enumerate(self.extra_state):
            if not isinstance(part, StatePart):
                raise ContractError(f"UserModel.extra_state[{k}] is a {type(part).__name__}; give StatePart(name, "
                                    "shape per token, dtype)")

    # -- the state between blocks ------------------------------------------------------------------------------
    def state_parts(self, dtype: torch.dtype) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """(name, shape per token, dtype) of every tensor of the state between blocks: the streams [n, C] in the
        run's activation `dtype`, then `extra_state`'s parts."""
        return [("streams", (self.n, self.hidden), dtype),
                *((p.name, tuple(p.shape), p.dtype or dtype) for p in self.extra_state)]

    def check_state(self, what: str, y, t: int, dtype: torch.dtype):
        """`y` as the state between blocks: one tensor [T, n, C] or, with extra_state, the tuple (streams, *extra),
        each part cast to its dtype; anything else is one line naming `what` and the part."""
        parts = self.state_parts(dtype)
        if not self.extra_state:
            if not torch.is_tensor(y) or tuple(y.shape) != (t, self.n, self.hidden):
                want = f"[{t}, {self.n}, {self.hidden}]"
                rule = (f"it must turn [T, C] into [T, n, C] = {want}" if what == "expand" else
                        f"the last phase gives back [T, n, C] = {want}" if " phase " in what else
                        f"a block maps [T, n, C] -> [T, n, C] = {want} (return all n={self.n} streams)")
                raise ContractError(f"{what} returned {_shape(y)}; {rule}")
            return _as(y, dtype)
        if type(y) is not tuple or len(y) != len(parts):
            names = ", ".join(name for name, _, _ in parts)
            raise ContractError(f"{what} returned {_shape(y)}; with UserModel.extra_state it must return the tuple "
                                f"({names})")
        out = []
        for (name, shape, want), v in zip(parts, y):
            if not torch.is_tensor(v) or tuple(v.shape) != (t, *shape):
                raise ContractError(f"{what} returned {_shape(v)} for the state's part {name!r}; it must be "
                                    f"{[t, *shape]}")
            out.append(_as(v, want))
        return tuple(out)

    def pieces(self) -> list[tuple[str, nn.Module]]:
        """(piece, module) in model order: embed, expand, blocks.<b>, head (the order names are given in)."""
        return [("embed", self.embed), ("expand", self.expand),
                *((f"blocks.{b}", m) for b, m in enumerate(self.blocks)), ("head", self.head)]

    def tied_parameters(self) -> list[tuple[str, ...]]:
        """Parameters that several pieces (embed, expand, a block, head) hold, as the names each piece gives them
        (the first is the name it goes by); a tie inside one piece is that piece's own business."""
        holders: dict[int, list[str]] = {}
        for piece, module in self.pieces():
            seen: set[int] = set()
            for name, p in module.named_parameters(remove_duplicate=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    holders.setdefault(id(p), []).append(f"{piece}.{name}")
        return [tuple(names) for names in holders.values() if len(names) > 1]

    def ties(self) -> list[Tie]:
        """The tied parameters (module docstring), each with the name it goes by and the pieces holding it."""
        return [Tie(names[0], tuple(names[1:]), tuple(dict.fromkeys(piece_of(n) for n in names)))
                for names in self.tied_parameters()]

    @classmethod
    def from_sublayers(cls, *, embed: nn.Module, sublayers: list[nn.Module], head: nn.Module, loss, hidden: int,
                       vocab_size: int, residual: str | MHCConfig = "mhc:4", split_points: list[int] | None = None,
                       name: str = "user") -> "UserModel":
        """Sub-layer functions [T, C] -> [T, C], each wrapped in mhc-pipe's residual (`residual`, e.g. 'mhc:4',
        'residual:1'); consecutive pairs form a block (attention, MLP), so 2k sub-layers give k blocks. `head`
        takes [T, C]: the streams are averaged before it."""
        res = parse_residual(residual)
        if len(sublayers) % 2:
            raise ContractError(f"from_sublayers: {len(sublayers)} sub-layers; give pairs (attention, MLP) so that "
                                "every block holds two")
        wrapped = [MHCSublayer(res, f, hidden, layer_index=i) for i, f in enumerate(sublayers)]
        blocks = [nn.Sequential(wrapped[i], wrapped[i + 1]) for i in range(0, len(wrapped), 2)]
        return cls(embed=embed, blocks=blocks, head=MeanStreamsHead(head), loss=loss, n=res.n, hidden=hidden,
                   vocab_size=vocab_size, expand=StreamExpand(res, hidden), split_points=split_points, name=name,
                   residual=res)

    # -- the contract ----------------------------------------------------------------------------------------
    def embed_tokens(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """ids [T] -> x_0 [T, n, C]: the embedding, then the stream entry (a pipeline's first stage only)."""
        with amp(dtype, ids.device):
            h = self.embed(ids)
        t, c = ids.shape[0], self.hidden
        if not torch.is_tensor(h) or tuple(h.shape) != (t, c):
            raise ContractError(f"embed returned {_shape(h)} for {t} token ids; it must return [T, C] = [{t}, {c}]")
        with amp(dtype, ids.device):
            x = self.expand(h.to(dtype))
        return self.check_state("expand", x, t, dtype)

    def run_block(self, b: int, x: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
        """Block b on the stream state x [T, n, C], with the token ids if it asks for them."""
        m = self.blocks[b]
        streams = _streams(x)
        with amp(streams.dtype, streams.device):
            y = m(x, token_ids=ids) if needs_token_ids(m) else m(x)
        return self.check_state(f"block {b} ({type(m).__name__})", y, streams.shape[0], streams.dtype)

    def logits(self, x) -> torch.Tensor:
        t = _streams(x).shape[0]
        out = self.head(x)
        if not torch.is_tensor(out) or out.dim() != 2 or out.shape[0] != t or out.shape[1] != self.vocab_size:
            hint = " (per-stream logits: the head must reduce the n streams)" if torch.is_tensor(out) and \
                out.dim() == 3 and out.shape[1] == self.n else ""
            raise ContractError(f"head returned {_shape(out)}; it must return logits [T, V] = "
                                f"[{t}, {self.vocab_size}]{hint}")
        return out

    def micro_loss(self, x: torch.Tensor, labels: torch.Tensor, microbatches: int) -> torch.Tensor:
        """This micro-batch's share of the step's loss: the user's mean token loss / M (micro-batches hold equal
        token counts, so the sum over micro-batches is the mean over the step's tokens)."""
        streams = _streams(x)
        with amp(streams.dtype, streams.device):
            loss = self.loss(self.logits(x), labels)
        if not torch.is_tensor(loss) or loss.dim() != 0:
            raise ContractError(f"loss returned {_shape(loss)}; it must return a scalar (the mean token loss of the "
                                "micro-batch)")
        return loss / microbatches

    def dry_run(self, seq_len: int) -> None:
        """One sequence through every piece without gradients: a broken contract is one line on every rank before
        any rank computes (in a step it would stop one rank while its peers wait for it until the timeout)."""
        param = next(self.named_parts().parameters(), None)
        dtype = param.dtype if param is not None and param.is_floating_point() else torch.float32
        # a model built on the meta device is checked on meta tensors: shapes only, no memory, no numbers
        meta = param is not None and param.is_meta
        ids = torch.zeros(seq_len, dtype=torch.long, device="meta" if meta else "cpu")
        with torch.no_grad():
            x = self.embed_tokens(ids, dtype)
            for b in range(len(self.blocks)):
                y = self.run_block(b, x, ids)
                phases = self.phases(b)
                if phases is not None:
                    z = x
                    for k, (name, fn) in enumerate(phases):
                        z = self.run_phase(b, name, fn, z, ids, k == len(phases) - 1, seq_len)
                    diff = 0.0 if meta else max(float((zp - yp).norm() / yp.norm().clamp_min(1e-30))
                                                for zp, yp in zip(_parts(z), _parts(y)))
                    if diff > 1e-6:
                        raise ContractError(f"block {b} ({type(self.blocks[b]).__name__}): its phases chained do not "
                                            f"compute its forward (relative difference {diff:.1e}); the pipeline "
                                            "runs the phases, the unsplit model the forward")
                x = y
            self.micro_loss(x, ids, 1)

    def phases(self, b: int) -> list[tuple[str, Callable]] | None:
        """Block b's phases (module docstring), checked; None when it has none."""
        m = self.blocks[b]
        fn = getattr(m, "phases", None)
        if fn is None:
            return None
        got = fn() if callable(fn) else fn
        if not isinstance(got, (list, tuple)) or not got or not all(
                isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and p[0].isidentifier()
                and callable(p[1]) for p in got):
            raise ContractError(f"block {b} ({type(m).__name__}).phases() must return a non-empty list of (name, "
                                "function) pairs, names such as 'attention' or 'dispatch'")
        return list(got)

    def has_phases(self) -> bool:
        """Does any block expose phases (then F&B pairs hand the turn over inside its stages)?"""
        return any(self.phases(b) is not None for b in range(len(self.blocks)))

    def run_phase(self, b: int, name: str, fn, state, ids: torch.Tensor | None, last: bool, t: int):
        """One phase of block b; the last must give back [T, n, C]."""
        floats = [v for v in (state if type(state) is tuple else (state,))
                  if torch.is_tensor(v) and v.is_floating_point()]
        dtype = torch.bfloat16 if any(v.dtype == torch.bfloat16 for v in floats) else None
        with amp(dtype, floats[0].device if floats else torch.device("cpu")):
            y = fn(state, token_ids=ids) if needs_token_ids(self.blocks[b]) else fn(state)
        if last:
            act = dtype or (floats[0].dtype if floats else torch.float32)
            y = self.check_state(f"block {b} ({type(self.blocks[b]).__name__}) phase {name!r}, its last,", y, t, act)
        return y

    def wants_token_ids(self, blocks) -> bool:
        return any(needs_token_ids(self.blocks[b]) for b in blocks)

    # -- placement -------------------------------------------------------------------------------------------
    def block_costs(self) -> list[int]:
        """Counted cost of each block: its parameters (at least 1)."""
        return [max(1, sum(p.numel() for p in m.parameters())) for m in self.blocks]

    def measure_block_costs(self, tokens: int, device: torch.device, dtype: torch.dtype, repeats: int = 3,
                            sync=None) -> list[int]:
        """Each block's forward and backward on `tokens` tokens, in microseconds (median of `repeats` after one
        warm-up run), on `device` in `dtype`; the block is moved there for the measurement and back after it, and
        keeps no gradient. `sync()`: waits for the device's queued work (CUDA: the runtime's device layer)."""
        import time

        out = []
        for b, m in enumerate(self.blocks):
            first = next(m.parameters(), None)
            home = (first.device, first.dtype) if first is not None else (torch.device("cpu"), torch.float32)
            m.to(device=device, dtype=dtype)
            parts = [torch.randn(tokens, *shape, device=device, dtype=dt, requires_grad=True)
                     for _, shape, dt in self.state_parts(dtype)]
            x = tuple(parts) if self.extra_state else parts[0]
            ids = torch.zeros(tokens, dtype=torch.long, device=device)
            times = []
            for k in range(repeats + 1):
                if sync is not None:
                    sync()
                t0 = time.perf_counter()
                sum(p.float().sum() for p in _parts(self.run_block(b, x, ids))).backward()
                if sync is not None:
                    sync()
                if k:
                    times.append(time.perf_counter() - t0)
            m.zero_grad(set_to_none=True)
            m.to(device=home[0], dtype=home[1])
            out.append(max(1, round(sorted(times)[len(times) // 2] * 1e6)))
        return out

    def chunks(self, count: int, costs: list[int] | None = None) -> list[range]:
        """Blocks of each of `count` model chunks: at the user's split points, else balanced by `costs` (default:
        the parameter counts)."""
        nb = len(self.blocks)
        if count > nb:
            raise ContractError(f"{nb} blocks cannot fill {count} pipeline stages; use fewer ranks (--pp) or a "
                                "schedule with fewer stages per rank")
        if self.split_points is not None:
            cuts = list(self.split_points)
            if len(cuts) != count - 1 or cuts != sorted(set(cuts)) or (cuts and not 0 < cuts[0] <= cuts[-1] < nb):
                raise ContractError(f"UserModel.split_points {cuts}: give {count - 1} increasing block indices in "
                                    f"1..{nb - 1} (the first block of every stage after the first)")
            edges = [0, *cuts, nb]
            return [range(edges[i], edges[i + 1]) for i in range(count)]
        return balanced_chunks(costs if costs is not None else self.block_costs(), count)

    def named_parts(self) -> nn.Module:
        """The whole model as one module, with the parameter names every stage uses."""
        return Parts(self, range(len(self.blocks)), embed=True, head=True)


@dataclass(frozen=True)
class Tie:
    """A parameter several pieces hold: `name` (its first holder's, what it goes by), the other holders' names
    (`aliases`) and every holding piece (`pieces`: 'embed', 'expand', 'blocks.<b>', 'head')."""

    name: str
    aliases: tuple[str, ...]
    pieces: tuple[str, ...]


def piece_of(name: str) -> str:
    """'blocks.3.attn.w' -> 'blocks.3'; 'head.lm.out.weight' -> 'head'."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "blocks" else parts[0]


class Parts(nn.Module):
    """The pieces of a user model one stage (or the unsplit reference) holds, under their global names."""

    def __init__(self, model: UserModel, blocks: range, *, embed: bool, head: bool):
        super().__init__()
        self.embed = model.embed if embed else None
        self.expand = model.expand if embed else None
        self.blocks = nn.ModuleDict({str(b): model.blocks[b] for b in blocks})
        self.head = model.head if head else None
        # a tied parameter goes by its first holder's name on every stage, also where that holder is elsewhere
        self._aliases = {alias: tie.name for tie in model.ties() for alias in tie.aliases}

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        for name, p in super().named_parameters(prefix, recurse, remove_duplicate):
            yield self._aliases.get(name, name), p


def amp(dtype: torch.dtype | None, device: torch.device):
    """bf16 runs of a user model: its pieces under autocast to bf16 (fp32 parameters, their gradients fp32 and
    reduced in fp32, as torch.amp and torchtitan's mixed precision do), and the stream state between blocks cast
    to bf16, as the built-in model keeps its activations; other dtypes run as they are."""
    if dtype == torch.bfloat16:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _as(y, dtype: torch.dtype):
    """The block's (or stream entry's) output in the run's activation dtype; anything else as it is (the contract
    checks name it)."""
    return y.to(dtype) if torch.is_tensor(y) and y.is_floating_point() and y.dtype != dtype else y


def _streams(x) -> torch.Tensor:
    """The streams of a state (its first part when it carries more)."""
    return x[0] if type(x) is tuple else x


def _parts(x) -> tuple:
    return x if type(x) is tuple else (x,)


def needs_token_ids(m: nn.Module) -> bool:
    return bool(getattr(m, "needs_token_ids", False))


def balanced_chunks(costs: list[int], count: int) -> list[range]:
    """Contiguous chunks of blocks minimising the largest chunk's cost (exact: binary search on the bound)."""
    def fits(bound: int) -> bool:
        used, total = 1, 0
        for c in costs:
            if c > bound:
                return False
            if total + c > bound:
                used, total = used + 1, 0
            total += c
        return used <= count

    lo, hi = max(costs), sum(costs)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
    # greedy under the bound, leaving at least one block for every chunk still to fill
    out, start, total = [], 0, 0
    for i, c in enumerate(costs):
        left_chunks = count - len(out) - 1
        if i > start and (total + c > lo or len(costs) - i == left_chunks):
            out.append(range(start, i))
            start, total = i, 0
        total += c
    out.append(range(start, len(costs)))
    return out


def _shape(value) -> str:
    if torch.is_tensor(value):
        return f"shape {list(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"
