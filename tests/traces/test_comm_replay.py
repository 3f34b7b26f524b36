"""`traces.analysis.comm_replay` and `mhcpipe check-comm`: a trace's communication replayed under NCCL's rules.

* One shared pipeline group deadlocks a 1F1B exchange (each rank's head waits for the op queued behind the other's
  head) in both views; per-direction groups, or both ops in one batch, do not.
* The k-th send meets the k-th receive: a swapped order is a mismatch, a missing partner is unmatched (and blocks).
* Host waits are dependencies: a cycle through two WAITs deadlocks; without them, or with WAITs that ended after
  the post, it runs; a WAIT binds to the last instance of its op posted before it ended (steps repeat names).
* Collectives: same kinds in the same order run, swapped is a mismatch, a member that never posts is unmatched.
* The group view queues all P2P of a group together, the pair view per peer: a three-rank case only the group
  view deadlocks.
* 10^4 ops replay (10^5 in seconds: bench/trace_scale.py).
* CLI: ok -> exit 0 and `ok:` lines; deadlock -> exit 1, summary first, listing capped; bad input -> one line, 2.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


from mhcpipe.cli import main
from traces.analysis.comm_replay import check_comm, replay
from traces.trace import Span, Trace

ROOT = Path(__file__).resolve().parents[2]


def op(rank: int, name: str, group: str, batch: int, t: float, peer: int | None = None, kind: str | None = None,
       dur: float = 1.0) -> Span:
    """A `~comm` span; P2P ops name their peer."""
    return Span(rank, "comm", kind or name.split("/", 1)[0], None, None, t, dur, peer=peer, name=f"{name}~comm",
                group=group, batch=batch)


def wait(rank: int, opname: str, t: float, dur: float) -> Span:
    return Span(rank, "compute", "WAIT", None, None, t, dur, name=f"WAIT/{opname}")


def one_f_one_b(g01: str, g10: str) -> Trace:
    """pp=2: rank 0 posts [RECV_B mb0] then [SEND_F mb1]; rank 1 [RECV_F mb1] then [SEND_B mb0]."""
    return Trace([op(0, "RECV_B/s1/mb0", g10, 0, 0.0, peer=1), op(0, "SEND_F/s0/mb1", g01, 0 if g01 != g10 else 1,
                                                                    1.0, peer=1),
                  op(1, "RECV_F/s0/mb1", g01, 0, 0.0, peer=0), op(1, "SEND_B/s1/mb0", g10, 0 if g01 != g10 else 1,
                                                                   1.0, peer=0)])


def verdicts(trace: Trace) -> dict[str, bool]:
    return {r.view: r.ok for r in check_comm(trace)}


def test_one_shared_pipeline_group_deadlocks_1f1b_and_names_both_heads():
    for res in check_comm(one_f_one_b("pp:0,1", "pp:0,1")):
        assert not res.ok and res.blocked_ranks == [0, 1] and not res.mismatches and not res.unmatched, res
        assert res.summary() == f"deadlock ({res.view} view): 2 ranks blocked"
        text = "\n".join(res.deadlock)
        assert "RECV_B/s1/mb0 waits for rank 1's SEND_B/s1/mb0, queued behind RECV_F/s0/mb1" in text
        assert "RECV_F/s0/mb1 waits for rank 0's SEND_F/s0/mb1, queued behind RECV_B/s1/mb0" in text
        assert res.deadlock[0].startswith("rank 0 [pp:0,1") and res.deadlock[1].startswith("rank 1 [pp:0,1")


def test_per_direction_groups_run_the_same_order():
    res = check_comm(one_f_one_b("p2p:0>1", "p2p:1>0"))
    assert [r.ok for r in res] == [True, True]
    assert res[0].summary() == "ok: 4 ops in 4 batches on 2 groups (group view)"


def test_the_ops_of_one_batch_run_together():
    # the deadlocking exchange of the first test, but each rank posts both ops in one batch_isend_irecv
    t = Trace([op(0, "RECV_B/s1/mb0", "pp:0,1", 0, 0.0, peer=1), op(0, "SEND_F/s0/mb1", "pp:0,1", 0, 0.1, peer=1),
               op(1, "RECV_F/s0/mb1", "pp:0,1", 0, 0.0, peer=0), op(1, "SEND_B/s1/mb0", "pp:0,1", 0, 0.1, peer=0)])
    assert verdicts(t) == {"group": True, "pair": True}
    assert replay(t).batches == 2


def test_kth_send_meets_kth_receive_so_a_swapped_order_is_a_mismatch():
    t = Trace([op(0, "SEND_F/s0/mb0", "p2p:0>1", 0, 0.0, peer=1), op(0, "SEND_F/s0/mb1", "p2p:0>1", 1, 1.0, peer=1),
               op(1, "RECV_F/s0/mb1", "p2p:0>1", 0, 0.0, peer=0), op(1, "RECV_F/s0/mb0", "p2p:0>1", 1, 1.0, peer=0)])
    for res in check_comm(t):
        assert not res.ok and not res.deadlock and len(res.mismatches) == 2, res
        assert res.mismatches[0] == ("order mismatch on p2p:0>1: send #1 from rank 0 to rank 1 is F/s0/mb0 but "
                                     "receive #1 at rank 1 from rank 0 is F/s0/mb1")
    # batch order, not post time, sets k: the same receives posted in the sends' order match
    ok = Trace([*t.spans[:2], op(1, "RECV_F/s0/mb1", "p2p:0>1", 1, 0.0, peer=0),
                op(1, "RECV_F/s0/mb0", "p2p:0>1", 0, 1.0, peer=0)])
    assert verdicts(ok) == {"group": True, "pair": True}


def test_a_send_without_receive_is_unmatched_and_blocks_its_queue():
    t = Trace([op(0, "SEND_F/s0/mb0", "p2p:0>1", 0, 0.0, peer=1), op(0, "SEND_F/s0/mb1", "p2p:0>1", 1, 1.0, peer=1),
               op(1, "RECV_F/s0/mb0", "p2p:0>1", 0, 0.0, peer=0)])
    res = replay(t)
    assert not res.ok and len(res.unmatched) == 1 and "SEND_F/s0/mb1" in res.unmatched[0], res
    assert res.blocked_ranks == [0] and "never posted" in res.deadlock[0]
    assert res.summary() == "unmatched + deadlock (group view): 1 unmatched; 1 rank blocked"


def host_cycle(waits: list[Span]) -> Trace:
    """Per-direction groups; each rank receives first and sends after. Only the hosts' waits close a cycle:
    rank 1 sends B after waiting for F, rank 0 sends F after waiting for B."""
    return Trace([op(0, "RECV_B/s1/mb0", "p2p:1>0", 0, 0.0, peer=1), op(0, "SEND_F/s0/mb0", "p2p:0>1", 0, 11.0, peer=1),
                  op(1, "RECV_F/s0/mb0", "p2p:0>1", 0, 0.0, peer=0), op(1, "SEND_B/s1/mb0", "p2p:1>0", 0, 6.0, peer=0),
                  *waits])


def test_host_waits_are_dependencies():
    both = [wait(0, "RECV_B/s1/mb0", 1.0, 9.0), wait(1, "RECV_F/s0/mb0", 1.0, 4.0)]
    dead = replay(host_cycle(both))
    assert not dead.ok and dead.blocked_ranks == [0, 1] and not dead.mismatches and not dead.unmatched
    assert any("SEND_F/s0/mb0 waits for its host: posted after WAIT/RECV_B/s1/mb0" in line for line in dead.deadlock)
    assert verdicts(host_cycle([])) == {"group": True, "pair": True}
    assert verdicts(host_cycle(both[:1])) == {"group": True, "pair": True}  # one wait alone closes no cycle
    # waits that ended after the sends were posted did not hold them back
    late = [wait(0, "RECV_B/s1/mb0", 1.0, 20.0), wait(1, "RECV_F/s0/mb0", 1.0, 20.0)]
    assert verdicts(host_cycle(late)) == {"group": True, "pair": True}
    # a zero-length wait at the post instant (CUDA records one per wait) never holds the op's own batch
    t = Trace([op(0, "SEND_F/s0/mb0", "p2p:0>1", 0, 5.0, peer=1), op(1, "RECV_F/s0/mb0", "p2p:0>1", 0, 5.0, peer=0),
               wait(0, "SEND_F/s0/mb0", 5.0, 0.0), wait(1, "RECV_F/s0/mb0", 5.0, 0.0)])
    assert verdicts(t) == {"group": True, "pair": True}


def two_steps(step1_waits: bool) -> Trace:
    """host_cycle's ops twice (step 1 at t+100, same names). Step 0: rank 1 waits for RECV_F before it sends B,
    rank 0 waits for RECV_B after its send F and before step 1's send F. Step 1: both hosts wait (a cycle)."""
    spans = []
    for s, t in ((0, 0.0), (1, 100.0)):
        spans += [op(0, "RECV_B/s1/mb0", "p2p:1>0", s, t, peer=1), op(0, "SEND_F/s0/mb0", "p2p:0>1", s, t + 11, peer=1),
                  op(1, "RECV_F/s0/mb0", "p2p:0>1", s, t, peer=0), op(1, "SEND_B/s1/mb0", "p2p:1>0", s, t + 6, peer=0)]
    spans += [wait(1, "RECV_F/s0/mb0", 1.0, 4.0), wait(0, "RECV_B/s1/mb0", 2.0, 18.0)]
    if step1_waits:
        spans += [wait(0, "RECV_B/s1/mb0", 101.0, 9.0), wait(1, "RECV_F/s0/mb0", 101.0, 4.0)]
    return Trace(spans)


def test_a_wait_binds_to_the_last_instance_posted_before_it_ends():
    # bound to step 1's RECV_F, rank 1's step-0 wait would hold step 0's SEND_B behind step 1 -> a false cycle
    assert verdicts(two_steps(step1_waits=False)) == {"group": True, "pair": True}
    # bound to step 0's (long completed) instances, step 1's waits would lose step 1's real cycle
    assert verdicts(two_steps(step1_waits=True)) == {"group": False, "pair": False}


def coll(rank: int, kind: str, name: str, batch: int, group: str = "ep-F:0,1") -> Span:
    return op(rank, name, group, batch, float(batch), kind=kind)


def test_collectives_in_the_same_order_run_swapped_mismatch_missing_unmatched():
    seq = [("A2A_DISPATCH.counts", "A2A_DISPATCH/s1/mb0/L2.counts"), ("A2A_DISPATCH", "A2A_DISPATCH/s1/mb0/L2"),
           ("A2A_COMBINE", "A2A_COMBINE/s1/mb0/L2")]
    same = [coll(r, k, n, b) for r in (0, 1) for b, (k, n) in enumerate(seq)]
    assert verdicts(Trace(same)) == {"group": True, "pair": True}
    swapped = [coll(0, k, n, b) for b, (k, n) in enumerate(seq)] + \
              [coll(1, k, n, b) for b, (k, n) in enumerate([seq[1], seq[0], seq[2]])]
    res = replay(Trace(swapped))
    assert not res.ok and len(res.mismatches) == 2 and not res.deadlock, res
    assert "A2A_DISPATCH.counts on rank 0" in res.mismatches[0] and "A2A_DISPATCH on rank 1" in res.mismatches[0]
    # a member that never posts: known from meta, or from the other ops it has on the group
    lone = Trace([coll(0, "RG", "RG/s0/dense", 0, "grad:0,1")], meta={"comm_groups": {"grad:0,1": [0, 1]}})
    res = replay(lone)
    assert not res.ok and len(res.unmatched) == 1 and "not by 1" in res.unmatched[0] and res.blocked_ranks == [0]
    short = Trace([coll(0, "RG", "RG/s0/dense", 0, "grad:0,1"), coll(0, "RG", "RG/s0/dense", 1, "grad:0,1"),
                   coll(1, "RG", "RG/s0/dense", 0, "grad:0,1")])
    res = replay(short)
    assert not res.ok and len(res.unmatched) == 1 and res.blocked_ranks == [0]
    assert replay(Trace(lone.spans)).ok  # without meta a one-rank group is all there is


def test_group_view_deadlocks_where_pair_view_does_not():
    # one group over 3 ranks: rank 1 receives from 0 before 2; rank 0 needs 2's send first; rank 2 sends to 1 first
    g = "pp:0,1,2"
    t = Trace([op(1, "RECV_F/s0/mb0", g, 0, 0.0, peer=0), op(1, "RECV_F/s2/mb0", g, 1, 1.0, peer=2),
               op(2, "SEND_F/s2/mb0", g, 0, 0.0, peer=1), op(2, "SEND_B/s2/mb0", g, 1, 1.0, peer=0),
               op(0, "RECV_B/s2/mb0", g, 0, 0.0, peer=2), op(0, "SEND_F/s0/mb0", g, 1, 1.0, peer=1)])
    group, pair = check_comm(t)
    assert (group.view, group.ok, pair.view, pair.ok) == ("group", False, "pair", True), (group, pair)
    assert group.blocked_ranks == [0, 1, 2]
    assert "rank 1 [pp:0,1,2] RECV_F/s0/mb0 waits for rank 0's SEND_F/s0/mb0, queued behind RECV_B/s2/mb0" \
        in group.deadlock


def test_a_long_exchange_replays_every_op():
    """10^4 ops (the time at 10^5: bench/trace_scale.py, bench/results/trace_scale.json)."""
    n = 2_500
    spans = []
    for m in range(n):
        spans += [op(0, f"SEND_F/s0/mb{m}", "pp:0,1", 2 * m, 2.0 * m, peer=1),
                  op(0, f"RECV_B/s1/mb{m}", "pp:0,1", 2 * m + 1, 2.0 * m + 1, peer=1),
                  op(1, f"RECV_F/s0/mb{m}", "pp:0,1", 2 * m, 2.0 * m, peer=0),
                  op(1, f"SEND_B/s1/mb{m}", "pp:0,1", 2 * m + 1, 2.0 * m + 1, peer=0),
                  wait(1, f"RECV_F/s0/mb{m}", 2.0 * m + 0.1, 0.5), wait(0, f"RECV_B/s1/mb{m}", 2.0 * m + 1.1, 0.5)]
    res = check_comm(Trace(spans))
    assert all(r.ok and r.ops == 4 * n for r in res)


# ---- CLI ---------------------------------------------------------------------------------------------------
def cli(capsys, *args: str) -> tuple[int, list[str], list[str]]:
    rc = main(["check-comm", *args])
    out, err = capsys.readouterr()
    return rc, out.splitlines(), err.splitlines()


def test_cli_ok_and_deadlock(tmp_path, capsys):
    good = one_f_one_b("p2p:0>1", "p2p:1>0").save(tmp_path / "good.json")
    rc, out, _ = cli(capsys, str(good), "--json", str(tmp_path / "r.json"))
    assert rc == 0 and out == ["ok: 4 ops in 4 batches on 2 groups (group view)",
                               "ok: 4 ops in 4 batches on 2 groups (pair view)"]
    assert [r["ok"] for r in json.loads((tmp_path / "r.json").read_text())] == [True, True]
    bad = one_f_one_b("pp:0,1", "pp:0,1").save(tmp_path / "bad.json")
    rc, out, _ = cli(capsys, str(bad), "--comm-rules", "nccl")
    assert rc == 1 and out[0] == "deadlock (group view): 2 ranks blocked" and len(out) == 3
    assert "RECV_B/s1/mb0 waits for rank 1's SEND_B/s1/mb0" in out[1]


def test_cli_caps_the_listing(tmp_path, capsys):
    spans = []
    for p in range(15):  # 15 deadlocked pairs, 30 blocked heads
        a, b = 2 * p, 2 * p + 1
        g = f"pp:{a},{b}"
        spans += [op(a, f"RECV_B/s{b}/mb0", g, 0, 0.0, peer=b), op(a, f"SEND_F/s{a}/mb1", g, 1, 1.0, peer=b),
                  op(b, f"RECV_F/s{a}/mb1", g, 0, 0.0, peer=a), op(b, f"SEND_B/s{b}/mb0", g, 1, 1.0, peer=a)]
    path = Trace(spans).save(tmp_path / "t.json")
    rc, out, _ = cli(capsys, str(path), "--comm-rules", "nccl-pair")
    assert rc == 1 and out[0] == "deadlock (pair view): 30 ranks blocked"
    assert len(out) == 22 and out[-1].strip() == "... and 10 more"


def test_cli_bad_input_is_one_line_exit_2(tmp_path, capsys):
    rc, out, err = cli(capsys, str(tmp_path / "missing.json"))
    assert rc == 2 and len(err) == 1 and "missing.json" in err[0] and err[0].startswith("mhcpipe check-comm: error:")
    old = Trace([Span(0, "comm", "SEND_F", 0, 0, 0.0, 1.0, peer=1, name="SEND_F/s0/mb0~comm")])
    old = old.save(tmp_path / "o.json")
    rc, out, err = cli(capsys, str(old))
    assert rc == 2 and len(err) == 1 and "o.json" in err[0] and "group/batch" in err[0] and "--trace-dir" in err[0]
    nocomm = Trace([Span(0, "compute", "F", 0, 0, 0.0, 1.0)]).save(tmp_path / "n.json")
    rc, out, err = cli(capsys, str(nocomm))
    assert rc == 2 and len(err) == 1 and "no communication spans" in err[0]
    (tmp_path / "x.json").write_text('{"a": 1}')
    rc, out, err = cli(capsys, str(tmp_path / "x.json"))
    assert rc == 2 and len(err) == 1 and "x.json" in err[0]


def test_cli_runs_as_a_module(tmp_path):
    path = one_f_one_b("pp:0,1", "pp:0,1").save(tmp_path / "t.json")
    p = subprocess.run([sys.executable, "-m", "mhcpipe", "check-comm", str(path)], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 1 and p.stdout.splitlines()[0] == "deadlock (group view): 2 ranks blocked"
    assert "deadlock (pair view): 2 ranks blocked" in p.stdout
