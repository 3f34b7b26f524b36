"""Writes the two-rank example of docs/cuda_program.md in both stream flavours (kept so the example can be re-made
after a format change; the JSON files are the example, read by the tests and by `mhcpipe check-comm --cuda`)."""
import json
import sys
from pathlib import Path


def k(stream, name, at=""):
    return {"op": "kernel", "stream": stream, "name": name, "at": at}


def post(stream, ev, comm_stream, i, comm, kind, peer, name, at):
    return [{"op": "record", "stream": stream, "event": ev, "at": at},
            {"op": "wait_event", "stream": comm_stream, "event": ev, "at": at},
            {"op": "nccl", "stream": comm_stream, "id": i, "comm": comm, "members": [0, 1],
             "ops": [{"kind": kind, "peer": peer, "name": name}], "storages": [100 + i], "at": at}]


def end(stream, i, ev, at):
    return [{"op": "wait_nccl", "stream": stream, "id": i, "at": at},
            {"op": "record", "stream": stream, "event": ev, "at": at}]


def streams(flags):
    return [{"op": "stream", "stream": s, "flags": flags, "priority": 0, "role": role}
            for s, role in ((1, "comm"), (2, "end"), (3, "end"), (4, "end"))]


def rank0(flags):
    return (streams(flags) + [k(0, "F/s0/mb0", "F/s0/mb0")]
            + post(0, 1, 1, 0, "p2p:0>1", "send", 1, "SEND_F/s0/mb0", "F/s0/mb0") + end(2, 0, 2, "F/s0/mb0")
            + post(0, 3, 1, 1, "p2p:1>0", "recv", 1, "RECV_B/s1/mb0", "F/s0/mb0") + end(3, 1, 4, "F/s0/mb0")
            + [k(0, "F/s0/mb1", "F/s0/mb1")]
            + post(0, 5, 1, 2, "p2p:0>1", "send", 1, "SEND_F/s0/mb1", "F/s0/mb1") + end(4, 2, 6, "F/s0/mb1")
            + [{"op": "wait_nccl", "stream": 0, "id": 1, "at": "B/s0/mb0"}, k(0, "B/s0/mb0", "B/s0/mb0"),
               {"op": "host_wait", "event": 6, "at": "B/s0/mb0"}])


def rank1(flags):
    return (streams(flags)
            + post(0, 1, 1, 0, "p2p:0>1", "recv", 0, "RECV_F/s0/mb0", "") + end(2, 0, 2, "")
            + [{"op": "wait_nccl", "stream": 0, "id": 0, "at": "F/s1/mb0"}, k(0, "F/s1/mb0", "F/s1/mb0")]
            + post(0, 3, 1, 1, "p2p:0>1", "recv", 0, "RECV_F/s0/mb1", "F/s1/mb0") + end(3, 1, 4, "F/s1/mb0")
            + [k(0, "B/s1/mb0", "B/s1/mb0")]
            + post(0, 5, 1, 2, "p2p:1>0", "send", 0, "SEND_B/s1/mb0", "B/s1/mb0") + end(4, 2, 6, "B/s1/mb0")
            + [{"op": "wait_nccl", "stream": 0, "id": 1, "at": "F/s1/mb1"}, k(0, "F/s1/mb1", "F/s1/mb1"),
               {"op": "host_wait", "event": 6, "at": "F/s1/mb1"}])


def write(folder: Path, flags: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for r, prog in enumerate((rank0(flags), rank1(flags))):
        doc = {"format": "mhcpipe.cuda-program", "version": 1, "rank": r, "world": 2}
        text = json.dumps(doc)[:-1] + ', "program": [\n' + ",\n".join(json.dumps(i) for i in prog) + "\n]}\n"
        (folder / f"cuda_program_rank{r}.json").write_text(text)


if __name__ == "__main__":
    here = Path(sys.argv[0]).resolve().parent
    write(here / "blocking", "blocking")
    write(here / "non_blocking", "non-blocking")
