"""The cost model's modelling switches (`Options`): what `mhcpipe predict` flags, `--explain` rungs and
`--sensitivity` move, checked once here; the Pricer (costmodel.pricing.pricer) reads them."""
from __future__ import annotations

from dataclasses import dataclass

from costmodel.pricing.fb_overlap import MODES
from schedules.engine import P2P_MODES

DISPATCHERS = ("deepep", "alltoall")
FB_ORDERS = ("runtime", "deepseek")


@dataclass(frozen=True)
class Options:
    """Modelling switches (what `mhcpipe predict` flags, `--explain` rungs and `--sensitivity` move)."""

    fb_mode: str = "streams"
    """how an F&B step is priced (overlap.MODES): its sub-operations on three streams in DualPipe's program order
    ("streams"), F + B back to back ("serial", as the DeepSeek figures draw it), or max(F, B)"""
    fb_order: str = "runtime"
    """the issue order inside an F&B pair (fb_overlap._issue_order): "runtime" (what pipeline/runtime/overlap.py
    runs: the forward half's first segment first, the backward's weight gradients after both halves) or "deepseek"
    (our reading of DeepSeek-V3's Fig. 4: the backward half's segment first, so its combine all-to-all runs under
    the forward's attention, each weight gradient where its backward produced it: MLP(B), MLP(W), ATTN(B), ATTN(W));
    the runtime does not run the second"""
    single_mode: str | None = None
    """how single actions (F, I, W, B) are priced: "streams" (their kernels and all-to-alls on the streams) or
    "serial"; None = as fb_mode implies ("serial" when fb_mode is "serial", "streams" otherwise)"""
    hp_stream: bool = True
    """MLP-side post+res (and its backward) on the high-priority stream, co-running with the other half's GEMMs"""
    sigma: float | None = None
    """extra compute slowdown under an all-to-all beyond the SM carve-out (None = the hardware's)"""
    comm_sms: int | None = None
    """SMs the all-to-all kernels occupy while they run (None = the hardware's)"""
    corun: bool = True
    """kernels on different streams share SMs and HBM bandwidth (False: one compute kernel at a time)"""
    p2p: str = "rendezvous"
    """stage-boundary P2P semantics (costmodel.md §2.6): "rendezvous" (a transfer starts when the sender has
    produced the tensor and the receiver has posted its receive: this runtime), "commit" (sends posted after the
    action that produced them, as DualPipe's reference commits them), "dataflow" (a transfer starts when its
    tensor is produced: the lower bound)"""
    recompute: bool = True
    """price the stage-aligned recompute of mHC intermediates (False: keep them, no recompute kernels)"""
    ep_per_node: int | None = None
    """EP ranks that share a node (None = as many as fit: min(EP, gpus_per_node)); fewer sends part of every
    all-to-all over the inter-node network"""
    dispatcher: str = "deepep"
    """how an EP group over nodes exchanges tokens (comm.py): "deepep" (a token crosses the network once per remote
    node and is forwarded inside it, DeepEP's internode kernels) or "alltoall" (every token copy crosses on its
    own, an NCCL all-to-all such as Megatron-LM's alltoall dispatcher); the memory reserve counts DeepEP's buffers
    either way"""
    pp_bandwidth: float | None = None
    """override of the PP link bandwidth in bytes/s (sweeps)"""
    data_parallel: int | None = None
    """the replicas D that place pipeline neighbours D ranks apart (None = the config's; tune prices one replica's
    config and passes its layout's D)"""
    allow_uneven: bool = False
    """accept stages with different block counts (as the config's parallel.uneven_stages does)"""
    split: str = "even"
    """how blocks are cut into stages: 'even' (configs.stage_blocks, the runtime's split) or 'balanced' (by cost,
    costmodel.pricing.stage_split: the ends' embedding, head and MTP and DualPipe's two chunks per rank counted)"""
    unit_costs: bool = False
    """self-check (costmodel.md §2.6): F = I = W = 1, B = 2, F&B = 3, free P2P"""

    def __post_init__(self) -> None:
        if self.p2p not in P2P_MODES:
            raise ValueError(f"p2p {self.p2p!r}: choose one of {', '.join(P2P_MODES)}")
        if self.fb_mode not in MODES:
            raise ValueError(f"fb_mode {self.fb_mode!r}: choose one of {', '.join(MODES)}")
        if self.single_mode not in (None, "streams", "serial"):
            raise ValueError(f"single_mode {self.single_mode!r}: choose 'streams', 'serial' or None")
        if self.fb_order not in FB_ORDERS:
            raise ValueError(f"fb_order {self.fb_order!r}: choose one of {', '.join(FB_ORDERS)}")
        if self.dispatcher not in DISPATCHERS:
            raise ValueError(f"dispatcher {self.dispatcher!r}: choose one of {', '.join(DISPATCHERS)}")
        if self.ep_per_node is not None and self.ep_per_node < 1:
            raise ValueError(f"ep_per_node {self.ep_per_node}: EP ranks per node must be >= 1")

    @property
    def single_action_mode(self) -> str:
        """The pricing mode of a single action (F, I, W, B): single_mode, or what fb_mode implies."""
        if self.single_mode is not None:
            return self.single_mode
        return "serial" if self.fb_mode == "serial" else "streams"
