"""The runtime's communication under NCCL's rules (pipeline.distributed.strict_transport, docs/communication.md).

* The old design (one process group for all of a pipeline's P2P: parallel.p2p_groups 'shared') deadlocks under
  NCCL's rules in every schedule: the strict transport turns that into one line per rank that names every rank's
  blocked queue heads, within the timeout, in the group view and the pair view.
* The new design (one group per direction of each pipeline link) runs every schedule x {pp4 tiny, pp2 dp2 ep2
  tiny MoE} x n in {1, 4} x overlap on/off on plain gloo with the single-process model's loss and gradients
  (under the strict transport: test_pipeline_equivalence).
* The strict transport itself: a receive order that differs from the send order is an error naming both
  messages; collectives that differ across the members of a group are an error at the end of the step.
* Every comm span of a recorded run carries its group, batch and the peer's global rank, and
  `traces.analysis.comm_replay` (mhcpipe check-comm) finds the old design's trace deadlocked and the new one's ok.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from _pipeline_helpers import assert_grads_match, check_ok, merged_grads, single_process_reference, tiny_config
from pipeline.launch.local import variants_worker
from rank_pool import launch

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("gpipe", "1f1b", "zb1p", "dualpipe", "dualpipev")
LAYOUTS = {"pp4": dict(ranks=4), "pp2-dp2-ep2": dict(ranks=2, dp=2, ep=2, moe=True)}
# The deadlock cases block at their first pipeline message (a few ms into step 1), and the ranks of a pool case start
# together: 3 s is far above both, and each deadlock case waits it out once.
DEADLOCK_TIMEOUT_S = 3


def _step_worker(rank, world, cfg_dict, trace_dir=None):
    import torch

    from configs import parse_config
    from pipeline.runtime.train import RankRuntime, make_groups

    cfg = parse_config(cfg_dict)
    groups = make_groups(cfg, rank, world, torch.device("cpu"))
    rt = RankRuntime(cfg, rank, torch.device("cpu"), groups=groups, record=trace_dir is not None)
    rt.align_clocks()
    loss = rt.step(0).loss
    if trace_dir is not None:
        rt.save_trace(Path(trace_dir), world)
    return loss


@pytest.mark.timeout(200)
@pytest.mark.parametrize("kind", KINDS)
def test_the_shared_p2p_group_deadlocks_under_nccl_rules_in_every_schedule(kind):
    """Posting order of the shared design, replayed live under NCCL's rules: every rank fails within the timeout
    with one line naming the op it waited for and every rank's queue heads (what each one's communicator is
    stuck on, and what sits behind it)."""
    cfg = tiny_config(kind, 4, steps=1, timeout_s=DEADLOCK_TIMEOUT_S)
    cfg["parallel"]["p2p_groups"] = "shared"
    results = launch(_step_worker, 4, (cfg,), timeout_s=120, grace_s=20)
    assert all(r.exitcode == 1 for r in results), [(r.rank, r.exitcode, r.error) for r in results]
    timed_out = [f"rank {r.rank}: timed out after {DEADLOCK_TIMEOUT_S} s waiting for " in r.error for r in results]
    for r, t in zip(results, timed_out):
        assert "\n" not in r.error, r.error
        # a rank whose peer already died of its timeout sees the closed connection first: the same report
        closed = rf"rank {r.rank}: \S+ (from|to) rank \d failed after [\d.]+ s: the peer closed"
        assert t or re.match(closed, r.error), r.error
        assert "NCCL-rules queue heads (group view)" in r.error, r.error
    assert any(timed_out), [r.error for r in results]

    def complete(err: str) -> bool:  # every rank's heads: the blocked op, what it waits for, what is behind it
        heads = err.split("queue heads (group view): ", 1)[1].split(" | ")
        return len(heads) == 4 and all("[world] " in h and "waits for rank" in h for h in heads) and \
            "behind it" in err

    # the first ranks to time out see every rank still blocked (a later one may see a peer already gone)
    assert any(complete(r.error) for r in results), [r.error for r in results]


@pytest.mark.timeout(120)
def test_the_shared_p2p_group_deadlocks_in_the_pair_view_too():
    """ProcessGroupNCCL may run P2P on a two-rank communicator per rank pair, shared by both directions: the old
    design deadlocks there as well (rank 0's receive from rank 1 ahead of its send to it, and vice versa)."""
    cfg = tiny_config("1f1b", 4, steps=1, timeout_s=DEADLOCK_TIMEOUT_S, comm_rules="nccl-pair")
    cfg["parallel"]["p2p_groups"] = "shared"
    results = launch(_step_worker, 4, (cfg,), timeout_s=100, grace_s=20)
    assert all(r.exitcode == 1 for r in results), [(r.rank, r.exitcode, r.error) for r in results]
    errs = " ".join(r.error for r in results)
    assert all("(pair view)" in r.error for r in results), errs
    assert "[world|0-1] RECV_B/s1/mb0 waits for rank 1's send of B/s1/mb0" in errs, errs


def _plain_gloo_grid(layout: str) -> list[dict]:
    out = []
    for kind in KINDS:
        overlaps = (True, False) if kind in ("dualpipe", "dualpipev") else (True,)  # only DualPipe has F&B pairs
        for n in (1, 4):
            for ov in overlaps:
                out.append(tiny_config(kind, n=n, overlap=ov, steps=1, comm_rules="backend", dtype="float64",
                                       **LAYOUTS[layout]))
    return out


@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_plain_gloo_runs_every_schedule_with_the_single_process_results(layout):
    """The channel groups on plain gloo (train.comm_rules 'backend', what a CPU run without the strict transport
    does): every schedule, n in {1, 4}, overlap on and off, gives the single-process model's loss and gradients
    (float64, 1e-9). The same grid under NCCL's rules is test_pipeline_equivalence's (3 steps, recompute too)."""
    variants = _plain_gloo_grid(layout)
    results = launch(variants_worker, 4, (variants, True), timeout_s=380)
    check_ok(results)
    for i, v in enumerate(variants):
        n = v["model"]["residual"]["n"]
        want_losses, want_grads, params = single_process_reference(v, 1)
        what = f"{layout} {v['parallel']['schedule']} n={n} overlap={v['parallel']['overlap']}"
        assert_grads_match(merged_grads(results, i), want_grads, params, 1e-9, what)
        for r in results:
            loss = r.value[i]["stats"][0]["loss"]
            assert abs(loss - want_losses[0]) <= 1e-9 * abs(want_losses[0]), (what, r.rank, loss, want_losses)


def _strict_transport(rank, world, p2p_groups="channel", timeout_s=10.0):
    import torch

    from pipeline.distributed.comm import Comms
    from pipeline.distributed.layout import Layout, build_groups
    from pipeline.distributed.p2p import Transport
    from pipeline.observability.recorder import Recorder
    from pipeline.distributed.strict_transport import StrictTransport

    groups = build_groups(Layout(2, 1, 1, "1f1b"), rank, "cpu", p2p_groups)
    comms = Comms(rank, Recorder(rank, torch.device("cpu")), timeout_s=timeout_s)
    strict = StrictTransport(rank, world, timeout_s)
    comms.strict = strict
    return Transport(rank, torch.device("cpu"), comms, groups=groups, strict=strict)


def _send_first_worker(rank, world, p2p_groups):
    """Both ranks post a send to the other, then a receive from it, as two batches: gloo buffers the sends and
    completes; on one NCCL communicator each send waits for a receive queued behind the peer's own send."""
    import torch

    from pipeline.distributed.warmup import warm_up

    tr = _strict_transport(rank, world, p2p_groups, timeout_s=DEADLOCK_TIMEOUT_S)
    if p2p_groups == "channel":  # as the runtime does: its channels are connected before anything is posted
        warm_up(tr.groups, torch.device("cpu"), DEADLOCK_TIMEOUT_S, tr.strict)
    x = torch.randn(4, 2, 8)
    peer = 1 - rank
    (s,) = tr.post([(True, f"SEND_F/s{rank}/mb0", peer, x)])
    (h,) = tr.post([(False, f"RECV_F/s{peer}/mb0", peer, torch.empty_like(x))])
    tr.wait(h)
    # the send too: a rank that returns with its send still queued tears its groups down under it (the peer then
    # waits for a send that never runs), as a process leaving with NCCL work in flight would
    tr.wait(s)
    return "completed"


@pytest.mark.timeout(120)
def test_a_send_completes_only_while_its_receive_runs():
    """NCCL's rendezvous rule, alone: sends at the head of both ranks' queues on one communicator deadlock
    (each waits for a receive behind the other's send); on one group per direction they complete."""
    shared = launch(_send_first_worker, 2, ("shared",), timeout_s=60, grace_s=15)
    assert all(r.exitcode == 1 for r in shared), [(r.rank, r.exitcode, r.error) for r in shared]
    errs = " ".join(r.error for r in shared)  # the first rank to time out sees both heads before the other exits
    assert "[world] SEND_F/s0/mb0 waits for rank 1 to run the receive of F/s0/mb0" in errs, errs
    assert "[world] SEND_F/s1/mb0 waits for rank 0 to run the receive of F/s1/mb0" in errs, errs
    check_ok(launch(_send_first_worker, 2, ("channel",), timeout_s=60))


def _first_posts_worker(rank, world, warm):
    """Rank 0 posts a receive from rank 1 (channel 1>0), then sends to it (0>1); rank 1 receives that send, then
    sends back. gloo runs it; on NCCL both first posts connect, each waiting for the other's post on a
    communicator the peer reaches only after this rank's next op: a hang, unless every channel was connected at
    start-up (pipeline.distributed.warmup)."""
    import torch

    from pipeline.distributed.warmup import warm_up

    tr = _strict_transport(rank, world, timeout_s=DEADLOCK_TIMEOUT_S)
    walked = warm_up(tr.groups, torch.device("cpu"), DEADLOCK_TIMEOUT_S, tr.strict) if warm else []
    x = torch.full((4, 2, 8), float(rank))
    if rank == 0:
        (r,) = tr.post([(False, "RECV_B/s1/mb0", 1, torch.empty_like(x))])
        (s,) = tr.post([(True, "SEND_F/s0/mb0", 1, x)])
    else:
        (got,) = tr.post([(False, "RECV_F/s0/mb0", 0, torch.empty_like(x))])
        tr.wait(got)
        (s,) = tr.post([(True, "SEND_B/s1/mb0", 0, x)])
        r = got
    tr.wait(r)
    tr.wait(s)
    return walked


@pytest.mark.timeout(120)
def test_first_posts_connect_lazily_and_the_warm_up_connects_them_first():
    """NCCL's lazy connection, alone: a first post blocks until the peer posts on that communicator. The order
    above hangs under that rule (each rank's heads name the connecting op); after the start-up warm-up, which
    walks every group in one global order, it completes."""
    cold = launch(_first_posts_worker, 2, (False,), timeout_s=60, grace_s=15)
    assert all(r.exitcode == 1 for r in cold), [(r.rank, r.exitcode, r.error) for r in cold]
    errs = " ".join(r.error for r in cold)
    assert "the first op to rank 1 on p2p:1>0 (RECV_B/s1/mb0) blocked" in errs, errs
    assert "connects: waits for rank 1's first op on this communicator" in errs, errs
    warm = launch(_first_posts_worker, 2, (True,), timeout_s=60)
    check_ok(warm)
    assert warm[0].value == warm[1].value == ["p2p:0>1", "p2p:1>0", "world"], warm[0].value


def _mismatch_worker(rank, world):
    """Rank 0 sends F/s0/mb0 then F/s0/mb1; rank 1 receives them the other way round, on one channel."""
    import torch

    tr = _strict_transport(rank, world)
    x = torch.randn(4, 2, 8)
    if rank == 0:
        ops = [(True, "SEND_F/s0/mb0", 1, x), (True, "SEND_F/s0/mb1", 1, x)]
    else:
        ops = [(False, "RECV_F/s0/mb1", 0, torch.empty_like(x)), (False, "RECV_F/s0/mb0", 0, torch.empty_like(x))]
    handles = [tr.post([op])[0] for op in ops]
    for h in handles:
        tr.wait(h)
    return "no error"


@pytest.mark.timeout(120)
def test_a_receive_order_unlike_the_send_order_is_an_error_naming_both_messages():
    """NCCL matches the k-th send with the k-th receive of a pair: the wrong tensor (same shape) or a hang. The
    strict transport checks each match and names both messages."""
    results = launch(_mismatch_worker, 2, (), timeout_s=60, grace_s=15)
    errs = " ".join(r.error or "" for r in results)
    assert "NCCL order mismatch on p2p:0>1: its next send to rank 1 is F/s0/mb0" in errs, errs
    assert "rank 1's next receive from it is F/s0/mb1" in errs, errs


def _collective_worker(rank, world, swapped):
    """Two all-reduces of 6 elements each; rank 1 posts them in the other order when `swapped` (gloo sums flat
    buffers, so it completes; NCCL-wise the shapes [2, 3] and [3, 2] differ)."""
    import torch
    import torch.distributed as dist

    from pipeline.distributed.comm import Comms
    from pipeline.observability.recorder import Recorder
    from pipeline.distributed.strict_transport import StrictTransport

    comms = Comms(rank, Recorder(rank, torch.device("cpu")), timeout_s=10.0)
    comms.strict = StrictTransport(rank, world, 10.0)
    shapes = [(2, 3), (3, 2)]
    if swapped and rank == 1:
        shapes.reverse()
    hs = [comms.post(dist.all_reduce, torch.ones(s), group=dist.group.WORLD, group_name="world", name=f"RG/{s}",
                     kind="RG", stage=None, mb=None, peer="world group") for s in shapes]
    for h in hs:
        comms.wait(h)
    comms.strict.check_collectives()
    return "ok"


@pytest.mark.timeout(120)
def test_collectives_in_another_order_on_one_member_are_an_error():
    same = launch(_collective_worker, 2, (False,), timeout_s=60)
    check_ok(same)
    swapped = launch(_collective_worker, 2, (True,), timeout_s=60, grace_s=15)
    errs = " ".join(r.error or "" for r in swapped)
    mismatch = "collective order mismatch on world in step 0: its collective #1 is all_reduce torch.float32"
    assert f"{mismatch}[3]" in errs or f"{mismatch}[2]" in errs, errs


def _trace_pair(tmp_path: Path) -> tuple[Path, Path]:
    """pp2 x dp2 x ep2 (global ranks differ from pipeline ranks): a traced step of the new design under the
    strict transport, and of the old one on plain gloo (which completes it: its sends are buffered)."""
    new = tiny_config("dualpipev", 2, moe=True, dp=2, ep=2, steps=1)
    old = tiny_config("dualpipev", 2, moe=True, dp=2, ep=2, steps=1, comm_rules="backend")
    old["parallel"]["p2p_groups"] = "shared"
    for name, cfg in (("new", new), ("old", old)):
        check_ok(launch(_step_worker, 4, (cfg, str(tmp_path / name)), timeout_s=120))
    return tmp_path / "new" / "trace.json", tmp_path / "old" / "trace.json"


@pytest.mark.timeout(300)
def test_comm_spans_carry_group_batch_and_global_peer_and_check_comm_reads_them(tmp_path):
    from traces.analysis.comm_replay import check_comm
    from traces.formats.io import load_trace

    new_path, old_path = _trace_pair(tmp_path)
    trace = load_trace(new_path)
    comm = [s for s in trace.spans if s.stream == "comm"]
    assert comm and all(s.group is not None and s.batch is not None for s in comm)
    groups = trace.meta["comm_groups"]
    p2p = [s for s in comm if s.kind.startswith(("SEND_", "RECV_"))]
    assert {s.group for s in p2p} == {"p2p:0>2", "p2p:2>0", "p2p:1>3", "p2p:3>1"}
    for s in p2p:  # the peer is the global rank at the other end of the span's one-direction channel
        src, dst = map(int, s.group.split(":")[1].split(">"))
        assert (s.rank, s.peer) == ((src, dst) if s.kind.startswith("SEND_") else (dst, src)), s
        assert sorted(groups[s.group]) == sorted((src, dst))
    sends = {(s.rank, s.peer, s.name.split("/", 1)[1]) for s in p2p if s.kind.startswith("SEND_")}
    recvs = {(s.peer, s.rank, s.name.split("/", 1)[1]) for s in p2p if s.kind.startswith("RECV_")}
    assert sends == recvs  # every send's peer has the matching receive from it
    assert {s.group.split(":")[0] for s in comm} >= {"ep-F", "ep-B"}
    batches = {}
    for s in sorted(comm, key=lambda s: s.start):  # batch numbers rise in posting order, per rank and group
        batches.setdefault((s.rank, s.group), []).append(s.batch)
    assert all(b == sorted(b) for b in batches.values())
    assert all(r.ok for r in check_comm(trace)), [r.problems for r in check_comm(trace)]
    old = check_comm(load_trace(old_path))
    assert [r.ok for r in old] == [False, False] and all(r.deadlock for r in old)
    out = subprocess.run([sys.executable, "-m", "mhcpipe", "check-comm", str(old_path), "--json",
                          str(tmp_path / "cc.json")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and out.stdout.startswith("deadlock (group view)"), out.stdout + out.stderr
    assert json.loads((tmp_path / "cc.json").read_text())[0]["ok"] is False
    ok = subprocess.run([sys.executable, "-m", "mhcpipe", "check-comm", str(new_path)], cwd=ROOT,
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and ok.stdout.startswith("ok: "), ok.stdout + ok.stderr
