"""The CUDA-program replay (traces.analysis.cuda_replay, `mhcpipe check-comm --cuda`): each rule of
docs/cuda_program.md on a small hand-built program, the documented two-rank example, and forged files."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from traces.analysis.cuda_replay import Rules, replay_programs
from traces.formats.cuda_program import Program, load_programs, write_program
from traces.trace import TraceError

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "docs" / "examples" / "cuda_program"


def _stream(s, flags="non-blocking", role="end"):
    return {"op": "stream", "stream": s, "flags": flags, "priority": 0, "role": role}


def _nccl(i, comm, kind, name, peer=None, stream=0, members=(0, 1), storages=()):
    op = {"kind": kind, "name": name, **({"peer": peer} if peer is not None else {})}
    return {"op": "nccl", "stream": stream, "id": i, "comm": comm, "members": list(members), "ops": [op],
            "storages": list(storages)}


def _run(*programs, **rules):
    progs = [Program(r, len(programs), list(p), f"rank{r}") for r, p in enumerate(programs)]
    return replay_programs(progs, Rules(**rules))


def _warm(rank: int, comms: str = "ab", coll: str = "") -> list[dict]:
    """Two ranks connected on each P2P communicator (and collective one) in one order, as the warm-up does."""
    out = []
    for i, c in enumerate(comms):
        out += [_nccl(100 + i, c, "send" if rank == 0 else "recv", f"W/{c}", peer=1 - rank),
                {"op": "host_wait", "id": 100 + i}]
    for i, c in enumerate(coll):
        out += [_nccl(200 + i, c, "all_reduce", f"W/{c}"), {"op": "host_wait", "id": 200 + i}]
    return out + [{"op": "mark", "name": "warm-up done"}]


def test_a_send_completes_only_while_its_receive_runs():
    """Rank 1 waits on its compute stream for a receive that rank 0 sends only after waiting for rank 1's send:
    a cross-rank cycle of stream-ordered waits (each rank's receive needs the other's send, posted behind it)."""
    r0 = [_nccl(0, "a", "recv", "RECV_X", peer=1), {"op": "wait_nccl", "stream": 0, "id": 0},
          _nccl(1, "b", "send", "SEND_Y", peer=1)]
    r1 = [_nccl(0, "b", "recv", "RECV_Y", peer=0), {"op": "wait_nccl", "stream": 0, "id": 0},
          _nccl(1, "a", "send", "SEND_X", peer=0)]
    res = _run(_warm(0) + r0, _warm(1) + r1)
    assert not res.ok and res.cycle
    text = "\n".join(res.cycle)
    assert "RECV_X" in text and "RECV_Y" in text and "SEND_" in text
    # the same with the sends first: ok
    ok = _run(_warm(0) + [r0[2], r0[0], r0[1]], _warm(1) + [r1[2], r1[0], r1[1]])
    assert ok.ok, ok.lines()


def test_a_collective_waits_for_every_member_and_a_missing_one_is_named():
    r0 = [_nccl(0, "g", "all_reduce", "AR/0", members=(0, 1)), {"op": "host_wait", "id": 0}]
    assert _run(r0, [_nccl(0, "g", "all_reduce", "AR/0", members=(0, 1))]).ok
    res = _run(r0, [])
    assert not res.ok
    assert any("never meets its partner on rank" in p and "1" in p for p in res.problems), res.lines()


def test_the_first_op_on_a_communicator_connects_and_blocks_the_host():
    """Rank 0 connects on A then B, rank 1 on B then A: each host waits for the other's (host-side cycle)."""
    r0 = [_nccl(0, "A", "send", "SEND_A", peer=1), _nccl(1, "B", "recv", "RECV_B", peer=1)]
    r1 = [_nccl(0, "B", "send", "SEND_B", peer=0), _nccl(1, "A", "recv", "RECV_A", peer=0)]
    res = _run(r0, r1)
    assert not res.ok and any("connects" in c for c in res.cycle), res.lines()
    # connected once beforehand (a warm-up in one order): ok, and no connection inside the step
    warm = [_nccl(10, "A", "all_reduce", "W/A"), _nccl(11, "B", "all_reduce", "W/B")]
    warm_p2p0 = [_nccl(12, "A", "send", "W/A>", peer=1), _nccl(13, "B", "recv", "W/B<", peer=1)]
    warm_p2p1 = [_nccl(12, "A", "recv", "W/A<", peer=0), _nccl(13, "B", "send", "W/B>", peer=0)]
    mark = [{"op": "mark", "name": "warm-up done"}]
    assert _run(warm + warm_p2p0 + mark + r0, warm + warm_p2p1 + mark + r1).ok
    late = _run(warm + mark + r0, warm + mark + r1)
    assert any("after the warm-up" in p for p in late.problems), late.lines()


def test_blocking_wait_turns_a_stream_wait_into_a_host_wait():
    """An early receive waited on a side stream is fine; under TORCH_NCCL_BLOCKING_WAIT the host blocks on it
    before posting the send its peer needs first."""
    r0 = [_stream(1), _nccl(0, "a", "recv", "RECV_EARLY", peer=1), {"op": "wait_nccl", "stream": 1, "id": 0},
          _nccl(1, "b", "send", "SEND_FIRST", peer=1)]
    r1 = [_nccl(0, "b", "recv", "RECV_FIRST", peer=0), {"op": "wait_nccl", "stream": 0, "id": 0},
          _nccl(1, "a", "send", "SEND_LATE", peer=0)]
    r0, r1 = _warm(0) + r0, _warm(1) + r1
    assert _run(r0, r1).ok
    res = _run(r0, r1, blocking_wait=True)
    assert not res.ok and res.cycle, res.lines()


def test_an_event_never_recorded_does_not_hold_a_stream_and_a_recorded_one_does():
    prog = [_stream(1), {"op": "wait_event", "stream": 1, "event": 7}, {"op": "kernel", "stream": 1, "name": "K"},
            {"op": "record", "stream": 1, "event": 8}, {"op": "host_wait", "event": 8}]
    assert _run(prog).ok
    held = [_stream(1), _nccl(0, "a", "recv", "RECV", peer=0, members=(0,)), {"op": "wait_nccl", "stream": 1, "id": 0},
            {"op": "record", "stream": 1, "event": 3}, {"op": "wait_event", "stream": 0, "event": 3},
            {"op": "record", "stream": 0, "event": 4}, {"op": "host_wait", "event": 4}]
    res = _run(held)
    assert not res.ok  # the receive has no sender: the event, the compute stream and the host wait behind it


def test_launch_order_mode_needs_launches_of_other_communicators_to_finish_first():
    """A receive posted early on one communicator, then a send on another that the peer needs first: fine when
    NCCL kernels of one device run concurrently, a cycle when they progress in launch order."""
    r0 = [_nccl(0, "a", "recv", "RECV_EARLY", peer=1), _nccl(1, "b", "send", "SEND_FIRST", peer=1)]
    r1 = [_nccl(0, "b", "recv", "RECV_FIRST", peer=0), {"op": "wait_nccl", "stream": 0, "id": 0},
          _nccl(1, "a", "send", "SEND_LATE", peer=0)]
    r0, r1 = _warm(0) + r0, _warm(1) + r1
    assert _run(r0, r1).ok
    res = _run(r0, r1, launch_order=True)
    assert not res.ok and any("launch order" in c for c in res.cycle), res.lines()


@pytest.mark.parametrize("after,hazard", [
    ([], True),  # released right after the post: the allocator may hand it out while NCCL reads it
    ([{"op": "host_wait", "id": 0}], False),  # the host saw the op end
    ([{"op": "wait_nccl", "stream": 0, "id": 0}], False),  # its allocation stream is ordered behind the op
    ([_stream(1), {"op": "wait_nccl", "stream": 1, "id": 0}], True),  # another stream waited: not enough
])
def test_a_storage_released_before_its_op_is_known_done_is_a_hazard(after, hazard):
    prog = [_nccl(0, "g", "all_to_all", "A2A_DISPATCH/s0/mb0/L1", members=(0,), storages=[5]), *after,
            {"op": "release", "storage": 5}, {"op": "host_wait", "id": 0}]
    res = _run(prog)
    assert res.ok is not hazard, res.lines()
    if hazard:
        assert any("A2A_DISPATCH/s0/mb0/L1" in p and "released" in p for p in res.problems)


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mhcpipe", "check-comm", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_the_documented_example_blocking_streams_deadlock_and_non_blocking_ones_do_not():
    bad = _cli("--cuda", EXAMPLE / "blocking")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    out = bad.stdout
    assert out.startswith("deadlock: 2 ranks")
    for part in ("rank 0 stream 3 (end, blocking): wait for RECV_B/s1/mb0", "kernel F/s0/mb1", "kernel B/s1/mb0",
                 "RECV_F/s0/mb1 (NCCL on p2p:0>1)", "legacy default stream waits for earlier work"):
        assert part in out, out
    good = _cli("--cuda", EXAMPLE / "non_blocking")
    assert good.returncode == 0, good.stdout + good.stderr
    assert good.stdout.startswith("ok: 2 ranks") and "launch order only" in good.stdout


def test_the_example_files_are_what_their_generator_writes(tmp_path):
    """docs/examples/cuda_program/make_example.py is the example's source; the files must be its output."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_example", EXAMPLE / "make_example.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for flavour, flags in (("blocking", "blocking"), ("non_blocking", "non-blocking")):
        mod.write(tmp_path / flavour, flags)
        for f in (EXAMPLE / flavour).iterdir():
            assert json.loads(f.read_text()) == json.loads((tmp_path / flavour / f.name).read_text()), f


@pytest.mark.parametrize("text,field", [
    ("{not json", "not a CUDA program file"),
    ('{"format": "other"}', "field 'format'"),
    ('{"format": "mhcpipe.cuda-program", "version": 1, "rank": 0, "world": 1, "program": [{"op": "exec"}]}',
     "field 'op'"),
    ('{"format": "mhcpipe.cuda-program", "version": 1, "rank": 0, "world": 1, "program": '
     '[{"op": "nccl", "stream": 0, "id": 0, "comm": "g", "members": [0], "ops": [{"kind": "send", "name": "S"}], '
     '"storages": []}]}', "needs 'peer'"),
])
def test_a_forged_program_is_refused_in_one_line(tmp_path, text, field):
    (tmp_path / "cuda_program_rank0.json").write_text(text)
    with pytest.raises(TraceError, match=field):
        load_programs(tmp_path)
    r = _cli("--cuda", tmp_path)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and field.split("'")[0] in r.stderr


def test_programs_of_a_run_must_all_be_there(tmp_path):
    write_program(tmp_path / "cuda_program_rank1.json", 1, 2, [])
    with pytest.raises(TraceError, match="every rank 0..1 must be there"):
        load_programs(tmp_path)
