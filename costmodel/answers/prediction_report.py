"""The readable table `mhcpipe predict` prints, and the JSON it writes."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from costmodel.answers.predict import Prediction

KIND_ORDER = ("F", "I", "W", "B", "FB")


def _ms(us: float) -> str:
    return f"{us / 1e3:,.2f} ms"


def _mb(b: float) -> str:
    return f"{b / 1e6:,.1f} MB"


def _col(text: str, width: int = 14) -> str:
    """Right-aligned, and never run into its left neighbour when wider than the column."""
    return " " + f"{text:>{width - 1}}"


def format_table(pred: Prediction) -> str:
    s = pred.summary
    sch = s["schedule"]
    lines = [
        f"mhcpipe predict: {s['config']} on {s['hardware']} ({pred.hardware.description or pred.hardware.name})",
        f"  layout: {sch['kind']}, PP={sch['ranks']}, M={sch['microbatches']}, EP={sch['ep']}, "
        f"T={sch['tokens_per_microbatch']} tokens/micro-batch; residual {s['residual']} vs residual (n=1)",
        "",
        f"  {'':<34}{'baseline':>14}{'mHC':>14}{'delta':>12}",
    ]
    ib, im = s["iteration_us"]["baseline"], s["iteration_us"]["mhc"]
    gs = s.get("grad_sync_us", {})
    if gs.get("mhc") is not None:  # D > 1: the step is the pipeline, then what the gradient all-reduce adds
        lines.append(f"  {'step (pipeline + exposed grad AR)':<34}{_col(_ms(ib))}{_col(_ms(im))}"
                     f"{100 * (im / ib - 1):>11.2f}%")
        pb, pm = s["pipeline_us"]["baseline"], s["pipeline_us"]["mhc"]
        lines.append(f"  {'  pipeline (one replica)':<34}{_col(_ms(pb))}{_col(_ms(pm))}{100 * (pm / pb - 1):>11.2f}%")
        lines.append(f"  {'  exposed gradient all-reduce':<34}{_col(_ms(gs['baseline']['exposed']))}"
                     f"{_col(_ms(gs['mhc']['exposed']))}   (DP={s['data_parallel']}; busiest rank "
                     f"{gs['mhc']['busiest_rank'] / 1e3:,.1f} ms in all)")
    else:
        lines.append(f"  {'iteration (makespan)':<34}{_col(_ms(ib))}{_col(_ms(im))}{100 * (im / ib - 1):>11.2f}%")
    if "rank_busy_max_over_mean" in s:
        bm = s["rank_busy_max_over_mean"]
        lines.append(f"  {'busiest rank / mean rank (compute)':<34}{bm['baseline']:>14.3f}{bm['mhc']:>14.3f}   "
                     f"(blocks per stage {s['stage_blocks']}; "
                     + ("cut by cost: train it with parallel.stage_split)" if s.get("split") == "balanced" else
                        "the config's parallel.stage_split)" if s.get("split") == "config" else
                        "--split balanced cuts by cost)"))
    tp, mfu = s["tokens_per_s_per_gpu"], s["mfu_pct"]
    lines.append(f"  {'tokens/s per GPU':<34}{tp['baseline']:>14,.0f}{tp['mhc']:>14,.0f}"
                 f"{100 * (tp['mhc'] / tp['baseline'] - 1) if tp['baseline'] else 0:>11.2f}%   "
                 f"({s['gpus']:,} GPUs, {s['tokens_per_step']:,} tokens per step)")
    lines.append(f"  {'MFU, causal attention as computed':<34}{mfu['baseline']:>13.1f}%{mfu['mhc']:>13.1f}%   "
                 f"(of the dense bf16 peak; {s['model_tflop_per_token'] * 1e3:,.2f} GFLOP per token: 3 x the "
                 "forward's matmuls)")
    if "mfu_palm_pct" in s:
        palm = s["mfu_palm_pct"]
        lines.append(f"  {'MFU, PaLM convention':<34}{palm['baseline']:>13.1f}%{palm['mhc']:>13.1f}%   "
                     f"({s['model_tflop_per_token_palm'] * 1e3:,.2f} GFLOP per token: the full attention score "
                     "matrix, PaLM App. B)")
    ob, om = s["op_us"]["baseline"], s["op_us"]["mhc"]
    for k in KIND_ORDER:
        if k in ob:
            lines.append(f"  {'mean ' + k + ' action':<34}{_col(_ms(ob[k]))}{_col(_ms(om[k]))}"
                         f"{100 * (om[k] / ob[k] - 1) if ob[k] else 0:>11.2f}%")
    bd = s["boundary"]
    lines.append(f"  {'stage-boundary message':<34}{_col(_mb(bd['bytes_baseline']))}{_col(_mb(bd['bytes_mhc']))}"
                 f"{bd['bytes_mhc'] / bd['bytes_baseline']:>11.1f}x")
    lines.append(f"  {'  time per message':<34}{_col(_ms(bd['us_baseline']))}{_col(_ms(bd['us_mhc']))}   "
                 f"({bd['link']})")
    ec = s["exposed_comm_us"]
    lines.append(f"  {'P2P on the critical path':<34}{_col(_ms(ec['baseline']))}{_col(_ms(ec['mhc']))}")
    bub = s["bubble"]
    lines.append(f"  {'bubble (idle share of rank-time)':<34}{bub['baseline_pct']:>13.1f}%{bub['mhc_pct']:>13.1f}%")
    mem = s["memory_gib"]
    lines.append(f"  {'peak memory per rank':<34}{mem['baseline']:>10.1f} GiB{mem['mhc']:>10.1f} GiB"
                 f"   (no recompute: {mem['mhc_no_recompute']:.1f} GiB; "
                 f"device {pred.hardware.memory_bytes / 2**30:.0f} GiB)")
    t = s["memory_terms_gib"]
    lines.append(f"    mHC rank {t['rank']} = states {t['model_states']:.1f} + activations {t['activations']:.1f} "
                 "+ transient "
                 f"and buffers {t['transient_and_buffers']:.1f} + reserve {t['reserve']:.1f} GiB"
                 f" ({'distributed' if pred.config.train.distributed_optimizer else 'replicated'} optimizer)")
    lr = s["recompute_block"]
    how = {"auto": "mode auto: Eq. 20 within the stage", "block": "mode block: the config's block size",
           "off": "mode off: mHC intermediates kept"}[s["recompute_mode"]]
    lines.append(f"  {'recompute block L_r (sub-layers)':<34}{'':>14}{(', '.join(map(str, lr)) or 'off'):>14}"
                 f"   ({how})")
    lines.append(f"  pricing: {s['pricing']}")
    lines.append("")
    if s["fb_stage_overhead_pct"] is not None:  # like for like with the paper's 6.7% first (costmodel.md §5)
        fb = s["fb_stage_us"]
        lines.append(f"  mHC overhead: {s['fb_stage_overhead_pct']:.2f}% of the overlapped F&B stage (the measure of "
                     f"DeepSeek's 6.7%); {s['step_overhead_pct']:.2f}% of the step")
        lines.append("    F&B stage = every pair as the step runs it: "
                     f"{fb['baseline'] / 1e3:,.1f} ms per rank baseline, "
                     f"{fb['mhc'] / 1e3:,.1f} ms mHC")
        pair = s.get("fb_pair_us", {}).get("baseline")
        if pair:
            order = ("the runtime's issue order (--fb-order runtime, the default: what this runtime runs)"
                     if s.get("fb_order", "runtime") == "runtime" else
                     "DeepSeek-V3 Fig. 4's order (--fb-order deepseek: backward first, weight gradients in place; "
                     "not what this runtime runs)")
            lines.append(f"    one F&B pair (baseline, mean): {pair['priced'] / 1e3:,.2f} ms in {order}, "
                         f"{pair['exposed_comm'] / 1e3:,.2f} ms of it all-to-all with no compute under it; "
                         f"with its communication fully hidden (max of compute and communication, the bound any "
                         f"order approaches) {pair['hidden_bound'] / 1e3:,.2f} ms")
    else:
        lines.append(f"  mHC overhead: {s['step_overhead_pct']:.2f}% of the step (no overlapped F&B stage in "
                     f"{s['schedule']['kind']})")
    b = s["breakdown_pp"]
    if b is None:
        lines.append("    split into kernel traffic, recompute and n-fold boundary traffic: add --breakdown (two more "
                     "simulations)")
    else:
        lines.append(f"    = kernel traffic {b['kernel_traffic']:+.2f} pp + recompute {b['recompute']:+.2f} pp "
                     f"+ n-fold boundary traffic {b['exposed_comm']:+.2f} pp"
                     + (f" + gradient sync {b['gradient_sync']:+.2f} pp" if gs.get("mhc") is not None else "")
                     + " of the step")
        lines.append(f"    (bubble change {bub['change_pp']:+.2f} pp of the step is part of these terms)")
    for w in s["warnings"]:
        lines.append(f"  WARNING: {w}")
    return "\n".join(lines)


def write_json(pred: Prediction, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = dict(pred.summary)
    data["memory_per_rank"] = {name: [vars(r) | {"total_bytes": r.total_bytes} for r in ranks]
                               for name, ranks in pred.memory.items()}
    path.write_text(json.dumps(data, indent=1, default=str))
    return path
