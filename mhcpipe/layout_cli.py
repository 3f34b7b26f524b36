"""`mhcpipe layout`: the process groups a launch makes, before launching it (no GPU, no process group).

    mhcpipe layout --config CONFIG [--pp P] [--dp D] [--ep EP] [--schedule KIND] [--p2p-groups channel|shared]
                   [--rank R] [--gpus-per-node 8] [--json OUT]

example: mhcpipe layout --config v4-pro --dp 128

Prints the groups the start-up creates (the runtime makes only groups it posts on) and the creations collective over
the whole world that make them (NCCL: one `split_group` per family of disjoint groups; gloo: one `new_group` per
group), the communicators per rank,
a range for NCCL's buffer memory per rank, and one rank's groups in the order the start-up warm-up connects
them (pipeline.distributed.warmup). The groups come from pipeline.distributed.group_plan, which a test checks against
a real start-up. Micro-batches do not change the groups: a count that does not divide over --dp is rounded up here.

NCCL memory: a range per rank from NCCL's protocol buffers (Simple 4 MiB, LL 512 KiB, LL128 4.69 MiB per channel,
peer and direction), the channels a connection gets on its link (a group inside one node of `--gpus-per-node`
GPUs: NVLink; else the network) and the peers each group connects; the assumptions are printed with it
(pipeline/distributed/nccl_memory.py).
"""
from __future__ import annotations

import argparse
import json
import math
from collections import Counter
from pathlib import Path

from schedules.registry import names

HELP = "the process groups a layout makes: creations, communicators per rank, NCCL buffers, the warm-up's order"
EXAMPLE = "mhcpipe layout --config v4-pro --dp 128"
SHOWN = 12  # groups listed for the chosen rank before "... and K more"


def register(subparsers) -> None:
    p = subparsers.add_parser("layout", help=HELP, description=f"{HELP}\n\nexample: {EXAMPLE}",
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="preset name or YAML file")
    p.add_argument("--pp", type=int, help="pipeline ranks (parallel.ranks)")
    p.add_argument("--dp", type=int, help="data-parallel replicas (parallel.data_parallel)")
    p.add_argument("--ep", type=int, help="expert-parallel degree (parallel.expert_parallel)")
    p.add_argument("--schedule", choices=names())
    p.add_argument("--p2p-groups", choices=("channel", "shared"), help="parallel.p2p_groups")
    p.add_argument("--rank", type=int, default=0, help="the rank whose groups are listed (default 0)")
    p.add_argument("--gpus-per-node", type=int, default=8,
                   help="GPUs per node: a group inside one node talks over NVLink (default 8)")
    p.add_argument("--json", dest="json_out", type=Path, help="write the plan and the counts as JSON here")
    p.set_defaults(func=run_layout)


def _config(args):
    from configs import load_config, load_config_data

    for flag in ("pp", "dp", "ep", "gpus_per_node"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} {value}: must be >= 1")
    par: dict = {}
    for flag, field in (("pp", "ranks"), ("dp", "data_parallel"), ("ep", "expert_parallel"),
                        ("schedule", "schedule"), ("p2p_groups", "p2p_groups")):
        if getattr(args, flag) is not None:
            par[field] = getattr(args, flag)
    data, _ = load_config_data(args.config, {"parallel": par})
    raw = data.get("parallel", {})
    dp, pp = int(raw.get("data_parallel", 1)), int(raw.get("ranks", 1))
    per_pipeline = max(math.ceil(int(raw.get("microbatches", dp)) / dp), 2 * pp)
    par["microbatches"] = dp * (per_pipeline + per_pipeline % 2)  # any schedule takes it; the groups ignore it
    return load_config(args.config, {"parallel": par})


def summarize(layout, plan, gpus_per_node: int) -> dict:
    from pipeline.distributed.group_plan import groups_of, world_wide_creations
    from pipeline.distributed.nccl_memory import ASSUMPTIONS, rank_range_mib

    per_rank = [groups_of(plan, r) for r in range(layout.world)]
    comms = [len(g) for g in per_rank]
    ranges = [rank_range_mib(g, gpus_per_node) for g in per_rank]
    return {
        "world": layout.world, "num_groups": len(plan),
        "creations": world_wide_creations(plan, split=False),  # gloo: one new_group per group
        "nccl_splits": world_wide_creations(plan, split=True),  # NCCL: one split_group per family
        "by_role": dict(Counter(g.role for g in plan)),
        "communicators_per_rank": [min(comms), max(comms)],
        "nccl_buffer_mib_per_rank": [min(lo for lo, _ in ranges), max(hi for _, hi in ranges)],
        "nccl_buffer_assumptions": ASSUMPTIONS, "gpus_per_node": gpus_per_node,
    }


def run_layout(args) -> int:
    from pipeline.distributed.group_plan import groups_of, plan_groups, warmup_order
    from pipeline.distributed.layout import Layout

    cfg = _config(args)
    layout = Layout.of(cfg)
    layout.check(cfg)
    if not 0 <= args.rank < layout.world:
        raise ValueError(f"--rank {args.rank}: the layout has ranks 0..{layout.world - 1}")
    plan = plan_groups(layout, cfg.parallel.p2p_groups)
    s = summarize(layout, plan, args.gpus_per_node)
    pp_rank, dp_rank = layout.coords(args.rank)
    print(f"layout {cfg.model.name}: {layout.schedule} PP{layout.pp} x DP{layout.dp} (EP{layout.ep} inside DP, "
          f"D_e {layout.edp}), {layout.world} ranks, P2P groups: {cfg.parallel.p2p_groups}")
    print(f"start-up: {s['num_groups'] - 1} groups, every one posted on; creations collective over all "
          f"{layout.world} ranks: {s['nccl_splits']} on NCCL (one split_group per family of disjoint groups), "
          f"{s['creations']} on gloo (one new_group per group)")
    print("  by role: " + ", ".join(f"{k} {v}" for k, v in sorted(s["by_role"].items())))
    lo, hi = s["communicators_per_rank"]
    mlo, mhi = s["nccl_buffer_mib_per_rank"]
    print(f"per rank: {lo}..{hi} communicators; NCCL buffers {mlo:,.0f}..{mhi:,.0f} MiB (range over ranks and "
          f"assumptions, {args.gpus_per_node} GPUs per node; {s['nccl_buffer_assumptions']})")
    order = warmup_order(groups_of(plan, args.rank))
    print(f"rank {args.rank} (pp {pp_rank}, dp {dp_rank}): the warm-up connects its {len(order)} groups in this "
          "order:")
    for i, g in enumerate(order[:SHOWN]):
        print(f"  {i + 1:>3}. {g.name if len(g.name) <= 60 else g.name[:57] + '...'} ({len(g.members)} ranks)")
    if len(order) > SHOWN:
        print(f"  ... and {len(order) - SHOWN} more")
    if args.json_out is not None:
        out = dict(s, rank=args.rank, warmup_order=[g.name for g in order],
                   groups=[{"name": g.name, "role": g.role, "members": list(g.members)} for g in plan])
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(out))
    return 0
