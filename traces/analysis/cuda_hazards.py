"""Rule 8 of the CUDA-program replay (docs/cuda_program.md): a storage the host released before it knew every NCCL
launch using it done, while the stream that allocated it is not ordered behind that launch either, may be handed to
another kernel by the caching allocator. A static pass over one rank's program in host order: which NCCL launches
each stream's latest work, each event and the host are known to come after."""
from __future__ import annotations

from collections import defaultdict

from traces.formats.cuda_program import LEGACY, Program


def hazards(prog: Program) -> list[str]:
    """Rule 8 on one rank's program: storages released before the host knew every NCCL launch using them done."""
    cover: dict[object, set[int]] = defaultdict(set)  # stream -> NCCL launches its latest work is ordered after
    flags: dict[object, str] = {LEGACY: "legacy"}
    events: dict[int, frozenset] = {}
    launch_cover: dict[int, frozenset] = {}
    host: set[int] = set()
    users: dict[int, list[tuple[int, str]]] = defaultdict(list)
    out = []

    def on(s) -> set[int]:
        c = cover[s]
        if flags.get(s) == "legacy":
            for b, f in flags.items():
                if f == "blocking":
                    c |= cover[b]
        elif flags.get(s) == "blocking":
            c |= cover[LEGACY]
        return c

    for i, ins in enumerate(prog.instructions):
        op = ins["op"]
        if op == "stream":
            flags[ins["stream"]] = ins["flags"]
        elif op == "kernel":
            on(ins["stream"])
        elif op == "record":
            events[ins["event"]] = frozenset(on(ins["stream"]))
        elif op == "wait_event":
            on(ins["stream"]).update(events.get(ins["event"], ()))
        elif op == "nccl":
            k = ins["id"]
            comm_stream = f"nccl:{ins['comm']}"
            c = cover[comm_stream]
            c |= on(ins["stream"])
            c.add(k)
            launch_cover[k] = frozenset(c)
            name = ", ".join(o["name"] for o in ins["ops"])
            for sid in ins["storages"]:
                users[sid].append((k, name))
        elif op == "wait_nccl":
            on(ins["stream"]).update(launch_cover.get(ins["id"], ()))
        elif op == "host_wait":
            host |= events.get(ins["event"], frozenset()) if "event" in ins else launch_cover.get(ins["id"], set())
        elif op == "release":  # safe once the host saw the op end, or once the stream that allocated the
            alloc = ins.get("stream", LEGACY)  # storage (where the allocator reuses it) is ordered behind it
            for k, name in users.pop(ins["storage"], []):
                if k not in host and k not in cover[alloc]:
                    at = f" during {ins['at']}" if ins.get("at") else ""
                    out.append(f"rank {prog.rank}: a tensor {name} uses was released (instruction {i}{at}) before "
                               "the host knew the op done: the caching allocator may hand its memory to another "
                               "kernel while NCCL still uses it")
    return out
