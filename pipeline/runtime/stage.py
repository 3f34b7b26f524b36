"""One pipeline stage: its modules and how one micro-batch runs forward and backward through them.

Shape letters: T tokens of a micro-batch, n streams, C hidden, V vocabulary.

A stage holds (by the model's parameter names) `embed` on a pipeline's first stage, `blocks.<b>` for its
Transformer blocks and `head` on a pipeline's last stage. Its work is cut into *segments*: the embedding, then
groups of sub-layers (recompute blocks of L_r sub-layers, or one Transformer block each when recompute is off),
then the head with the loss. Each segment starts from a detached leaf, so backward runs segment by segment:
that is what lets an overlapped F&B interleave the forward of one micro-batch with the backward of another,
rebuilds recompute blocks one at a time, and yields the stage's input-grad as the first segment's leaf grad.

Forward and backward are generators that yield after every segment; the executor drives them (plain F/B/I:
to the end; FB: each half on its own thread, handing the turn over at every segment boundary, pipeline.runtime.overlap).
`labels` names the segments in forward order (`L0.embed`, `L4.block`, `L16.head`: the first sub-layer, then
what it is), for the spans of an overlapped pair.

On CUDA the post+res kernel of every MLP sub-layer runs on the rank's high-priority stream (paper §4.3.3):
the hp stream waits for the compute stream; the compute stream waits for the result only where it is consumed
(the next sub-layer, the head, the stage output before its send), so the other half of an F&B pair runs beside
it; every tensor that crosses streams is `record_stream`-ed so the caching allocator cannot hand its memory out
early (mhc.md §9 pitfall 4). Autograd runs those ops' backward on the same hp stream with its own dependencies.
On CPU the placement is only recorded (`~hp` spans).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the type of every `cfg` here; configs is imported where it is used
    from configs import RunConfig

import functools
import threading
from dataclasses import dataclass, field

import torch

from torch import nn
from torch.autograd.graph import get_gradient_edge

from kernels import residual_spec as rs
from kernels import single_pass
from traces.trace import span_name

from pipeline.distributed.expert import start_count_read
from pipeline.runtime.saved_tensors import SavedTensors
from pipeline.model import build_block, build_embedding, build_head
from pipeline.partition import StageSpec
from pipeline.runtime.recompute import RecomputeBlock, split_blocks
from pipeline.observability.recorder import Recorder
from pipeline.weight_grad import WeightGradStore


@dataclass
class ChunkRun:
    """What the forward of one (stage, mb) leaves for its backward."""

    stage: int
    mb: int
    segs: list = field(default_factory=list)  # (leaf or None, output/loss, RecomputeBlock or None)
    output: torch.Tensor | None = None  # detached stage output (to send or hand off)
    loss: torch.Tensor | None = None  # head stages: this micro-batch's loss contribution
    input_grad: torch.Tensor | None = None  # set by the backward (None on an embedding stage)
    ids: torch.Tensor | None = None  # the micro-batch's token ids, for a stage whose blocks ask for them

    def release_output(self) -> torch.Tensor:
        """The detached output, for its send; from now on the backward holds only the output's gradient edge, so
        its storage is freed as soon as the send no longer needs it (DualPipe frees sent outputs too: the
        backward of the stage needs their gradient, never their values)."""
        leaf, out, rec = self.segs[-1]
        if type(out) is tuple:  # a user model's state of several tensors: each part's edge
            self.segs[-1] = (leaf, tuple(get_gradient_edge(o) if torch.is_tensor(o) and o.requires_grad else o
                                         for o in out), rec)
        elif out is not None:  # None: a user stage's recompute unit, whose backward reruns its forward
            self.segs[-1] = (leaf, get_gradient_edge(out), rec)
        sent, self.output = self.output, None
        return sent


class Stage(nn.Module):
    wants_ids = False  # the embedding stage reads the ids; no block of the built-in model does

    def __init__(self, spec: StageSpec, cfg: RunConfig, *, store: WeightGradStore | None, dtype: torch.dtype,
                 rc_block: int | None, expert=None, dev=None):
        super().__init__()
        mc, seed = cfg.model, cfg.train.seed
        self.spec = spec
        self.hidden = mc.hidden
        self.embed = build_embedding(mc, seed, dtype) if spec.has_embed else None
        self.blocks = nn.ModuleDict({str(b): build_block(mc, cfg.parallel.seq_len, b, seed, store, comm=expert)
                                     for b in spec.blocks})
        self.head = build_head(mc, seed, store) if spec.has_head else None
        for m in self.blocks.modules():  # EP=1 count reads: early, and no longer than every other wait of the run
            if hasattr(m, "count_reader"):
                m.count_reader = functools.partial(start_count_read, timeout_s=cfg.train.timeout_s, dev=dev)
        subs = [(layer, m, layer % 2 == 1) for b in spec.blocks for layer, m in self.blocks[str(b)].sublayers()]
        self.groups = split_blocks(subs, rc_block)
        self.expert = expert
        self.has_moe = expert is not None and any(
            getattr(self.blocks[str(b)].mlp.sublayer.core, "comm", None) is not None for b in spec.blocks)
        first, end = 2 * spec.blocks[0], 2 * spec.blocks[-1] + 2
        self.labels = ([f"L{first}.embed"] if self.embed is not None else []) + \
            [f"L{g[0][0]}.block" for g in self.groups] + ([f"L{end}.head"] if self.head is not None else [])
        self.recompute = rc_block is not None
        spec = rs.variant(mc.residual.variant)
        self.residual = spec.one_stream
        self.single_pass = spec.carries_coefficient  # carries (x, a) between sub-layers, packed at boundaries
        self.flash = spec.takes_k and mc.residual.flash  # xHC-Flash: the MLP reuses its attention's routing
        if self.flash and rc_block is not None and rc_block % 2:
            raise ValueError(f"recompute block of {rc_block} sub-layers with xHC-Flash: the MLP sub-layer reuses its "
                             "attention's routing, so a block must hold whole Transformer blocks; use an even "
                             "recompute.block_size")

    # -- one sub-layer ---------------------------------------------------------------------------------
    @property
    def exchanges(self) -> bool:
        """Expert-parallel all-to-alls inside this stage's forward and backward (what an F&B pair can overlap)."""
        return self.has_moe and self.expert.exchanging

    def _post_fn(self, m, coeffs):
        if self.residual:
            return lambda x, y: x + y[:, None]
        return lambda x, y: m.apply_post_res(x, y, coeffs)

    def _sublayer(self, i, layer, m, is_mlp, x, a, routing, rec: RecomputeBlock | None, env: "StageEnv", mb: int):
        """One sub-layer: returns (x_next, a_next, coeffs). `a`: mhc-sp's carried input-mixing coefficient;
        `routing`: xHC-Flash's attention coefficients for the MLP of the same block."""
        env.sync_hp()  # x may still be in the making on the hp stream
        f = m.sublayer
        if self.residual:
            coeffs, u = None, x[:, 0]
        elif self.single_pass:
            coeffs = m.coefficients(x)
            u = m.apply_pre(x, a)
        else:
            coeffs = m.coefficients(x, routing) if routing is not None else m.coefficients(x)
            u = m.apply_pre(x, coeffs)
        if env.diagnostics is not None and coeffs is not None:
            env.diagnostics.sublayer(self.spec.stage, mb, layer, m, x, coeffs, a)
        if rec is not None:
            rec.register(u, "u", i)
        h = f.norm(u)
        if rec is not None:
            rec.register(h, "h", i)
        y = f.core(h)
        post = self._post_fn(m, coeffs)
        if is_mlp:
            hp_name = span_name("F", self.spec.stage, mb, stream="hp", part=f"L{layer}.post_res")
            x_next = env.hp_post(post, x, y, coeffs, name=hp_name,
                                 stage=self.spec.stage, mb=mb)
        else:
            x_next = post(x, y)
        if rec is not None:
            kept_y = y.detach()
            kept_c = None if coeffs is None else type(coeffs)(*(c.detach() for c in coeffs))
            post_kept = self._post_fn(m, kept_c)
            norm = f.norm
            kept_a = None if a is None else a.detach()

            def step(xi, m=m, kept_c=kept_c, kept_y=kept_y, kept_a=kept_a, post_kept=post_kept, norm=norm):
                if kept_c is None:
                    ui = xi[:, 0]
                else:
                    ui = m.apply_pre(xi, kept_a if kept_a is not None else kept_c)
                return ui, norm(ui), post_kept(xi, kept_y)

            rec.record(step, env.saved.hold(kept_y))
        return x_next, (coeffs.h_pre if self.single_pass else None), coeffs

    def _pack(self, x, a):
        return x if a is None else single_pass.pack_state(x, a)

    def _unpack(self, state):
        """A segment's input: (x, a), a = None except for mhc-sp, whose state travels packed with its a."""
        if not self.single_pass:
            return state, None
        return single_pass.unpack_state(state, self.hidden)

    # -- forward / backward generators -----------------------------------------------------------------
    def forward_steps(self, run: ChunkRun, inp: torch.Tensor, labels: torch.Tensor | None, env: "StageEnv"):
        mb, x = run.mb, inp
        if self.embed is not None:
            with env.saved.hooks():
                x = self.embed(x)
                if self.single_pass:
                    x = self._pack(x, self.embed.entry_coefficient(x.shape[0], x))
            run.segs.append((None, x, None))
            yield
        for group in self.groups:
            leaf = x.detach().requires_grad_(True)
            with env.saved.hooks():
                y, a = self._unpack(leaf)
            rec = RecomputeBlock(y, group[0][0]) if self.recompute else None
            routing = None
            with env.saved.hooks(rec):
                for i, (layer, m, is_mlp) in enumerate(group):
                    if rec is not None and i > 0:
                        rec.register(y, "x", i)
                    y, a, coeffs = self._sublayer(i, layer, m, is_mlp, y, a, routing if is_mlp else None, rec, env, mb)
                    routing = coeffs if self.flash and not is_mlp else None
                if a is not None:
                    env.sync_hp()  # the pack reads y, which the hp stream may still be writing
                out = self._pack(y, a)
            if rec is not None:
                rec.end_forward()
            run.segs.append((leaf, out, rec))
            x = out
            yield
        env.sync_hp()  # the stage output, for the head or the send
        if env.diagnostics is not None and self.groups:
            env.diagnostics.stage_end(self.spec.stage, mb, self.groups[-1][-1][0] + 1, self._unpack(x)[0])
        if self.head is not None:
            leaf = x.detach().requires_grad_(True)
            with env.saved.hooks():
                xs, a = self._unpack(leaf)
                loss = self.head(xs, labels, env.total_tokens, a)
            run.segs.append((leaf, loss, None))
            run.loss = loss.detach()
            yield
        else:
            run.output = x.detach()

    def backward_steps(self, run: ChunkRun, grad: torch.Tensor | None, env: "StageEnv"):
        g = grad
        nblocks = sum(1 for seg in run.segs if seg[2] is not None)
        while run.segs:
            leaf, out, rec = run.segs.pop()
            if rec is not None:
                first = rec.first_layer
                name = span_name("RC", self.spec.stage, run.mb, part=None if nblocks == 1 else f"L{first}.block")
                with env.recorder.range("RC", self.spec.stage, run.mb, name=name):
                    rec.rebuild()
                env.saved.note_transient(rec.cache_bytes())
            torch.autograd.backward(out, g)
            if rec is not None:
                rec.release()
            g = None if leaf is None else leaf.grad
            del leaf, out, rec
            yield
        run.input_grad = g


class StageEnv:
    """Per-rank services a stage uses while running: saved-tensor accounting, recorder, hp stream."""

    def __init__(self, saved: SavedTensors, recorder: Recorder, total_tokens: int, hp_stream=None, dev=None):
        self.saved = saved
        self.recorder = recorder
        self.total_tokens = total_tokens
        self.hp = hp_stream
        self.dev = dev  # pipeline.device: the hp stream's device (None on CPU)
        self.diagnostics = None  # pipeline.observability.diagnostics_log.StepProbe while a logged step runs
        self._tls = threading.local()  # per half of an F&B pair: its post+res still running on the hp stream

    def hp_post(self, post, x, y, coeffs, *, name: str, stage: int, mb: int) -> torch.Tensor:
        """post+res of an MLP sub-layer on the high-priority stream (CUDA), recorded as a `~hp` span. The compute
        stream does not wait for it here: whoever consumes the output first calls `sync_hp` (the next sub-layer,
        the head, or the stage output before its send), so work that does not need it (the other half of an F&B
        pair) runs beside it."""
        if self.hp is None:
            with self.recorder.range("F.post_res", stage, mb, stream="hp", name=name):
                return post(x, y)
        dev = self.dev
        main = dev.current_stream()
        self.hp.wait_stream(main)
        with dev.use(self.hp):
            with self.recorder.range("F.post_res", stage, mb, stream="hp", name=name, cuda_stream=self.hp):
                out = post(x, y)
            done = dev.event()
            done.record(self.hp)
        self._tls.pending = done
        dev.record_stream(out, main)
        for t in (x, y, *(coeffs or ())):
            dev.record_stream(t, self.hp)
        return out

    def sync_hp(self) -> None:
        """Make the current stream wait for this thread's last post+res on the hp stream (no-op on CPU)."""
        if self.hp is None:
            return
        done = getattr(self._tls, "pending", None)
        if done is not None:
            self._tls.pending = None
            self.dev.current_stream().wait_event(done)
