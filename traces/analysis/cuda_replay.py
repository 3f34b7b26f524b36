"""Replay every rank's CUDA program (traces.formats.cuda_program) under CUDA's and NCCL's rules: would this run
hang on the GPUs, and where?

The rules (each with its source in docs/cuda_program.md §Rules):
1. A stream runs its work in issue order; a stream's event wait holds the stream until the event's last record
   before the wait completed (an event never recorded does not hold it).
2. The legacy default stream (stream 0) and *blocking* streams order each other both ways: work on the legacy
   stream starts only after everything issued before it on every blocking stream of the device, and work on a
   blocking stream only after everything issued before it on the legacy stream. Non-blocking streams (and NCCL's
   own streams) take no part in it.
3. An NCCL launch runs on its communicator's stream, in issue order per communicator, after the work issued
   before it on the stream it was posted from (ProcessGroupNCCL orders its stream behind the current one).
4. A send or receive completes only while its peer's matching op runs (no buffering; on one communicator the
   k-th send from a to b meets the k-th receive at b from a); a collective completes once every member runs it.
   A launch of several ops (a batch) completes when all of them have.
5. The first op between two ranks on a communicator connects them: the posting host blocks until the peer's
   host posts there too (all-to-all: every member); the first collective of another kind on a communicator
   connects all its members the same way.
6. A host wait (a synchronize, an event query polled until true, a host read) blocks the host until its target
   completed. With `blocking_wait` (TORCH_NCCL_BLOCKING_WAIT=1) every stream-ordered wait for an NCCL launch
   blocks the host too.
7. With `launch_order` (the conservative reading of NCCL's warning about several communicators on one device,
   NCCL_LAUNCH_ORDER_IMPLICIT), an NCCL launch starts only after every NCCL launch issued before it on the device
   completed.
8. A storage the host released while an NCCL launch that reads or writes it is not known complete to the host
   (no host wait ordered after it) may be handed to another kernel by the caching allocator: a hazard, reported
   even when nothing hangs.

The replay is a fixpoint: hosts issue until they block, streams start their heads when the rules allow, NCCL
launches complete when their partners run. If work is left when nothing moves, the wait-for edges of what is
stuck are followed until one repeats: that cycle, across ranks and streams, each step named by its pipeline action,
is the deadlock.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from traces.analysis.cuda_hazards import hazards
from traces.formats.cuda_program import LEGACY, P2P_KINDS, Program
from traces.nccl_rules import COLLECTIVE, CONNECT, RENDEZVOUS, connection
from traces.trace import TraceError

MAX_CYCLE = 40


@dataclass(frozen=True)
class Rules:
    blocking_wait: bool = False  # TORCH_NCCL_BLOCKING_WAIT: stream-ordered waits for NCCL block the host
    launch_order: bool = False  # NCCL launches of one device progress only in launch order


@dataclass(eq=False, slots=True)
class _Item:
    rank: int
    stream: object  # int: a CUDA stream; str "nccl:<comm>": a communicator's stream
    kind: str  # kernel | record | wait_event | wait_nccl | post | nccl
    issue: int  # position in the rank's host order
    text: str
    after: "_Item | None" = None  # what it waits for besides its stream's order
    started: bool = False
    done: bool = False
    partners: list = field(default_factory=list)  # nccl: the launches its ops need running (None: never posted)
    missing: list = field(default_factory=list)  # nccl: descriptions of partners never posted


@dataclass
class CudaReplayResult:
    ok: bool
    ranks: int
    instructions: int
    launches: int
    communicators: int
    rules: Rules
    cycle: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # unmatched ops, connects inside a step, hazards

    def summary(self) -> str:
        mode = ", ".join(k for k, v in (("blocking wait", self.rules.blocking_wait),
                                        ("launch order", self.rules.launch_order)) if v) or "default rules"
        if self.ok:
            return (f"ok: {self.ranks} ranks, {self.instructions} instructions, {self.launches} NCCL launches on "
                    f"{self.communicators} communicators ({mode})")
        what = "deadlock" if self.cycle else "problems"
        return f"{what}: {self.ranks} ranks, {self.instructions} instructions ({mode})"

    def lines(self) -> list[str]:
        out = [self.summary()]
        if self.cycle:
            out.append("  wait cycle (each line waits for the next, for the reason after it; the last for the first):")
            out += [f"    {c}" for c in self.cycle]
        out += [f"  {p}" for p in self.problems]
        return out

    def to_dict(self) -> dict:
        return {"ok": self.ok, "ranks": self.ranks, "instructions": self.instructions, "launches": self.launches,
                "communicators": self.communicators, "blocking_wait": self.rules.blocking_wait,
                "launch_order": self.rules.launch_order, "cycle": self.cycle, "problems": self.problems}


class _Rank:
    def __init__(self, prog: Program):
        self.prog = prog
        self.r = prog.rank
        self.pc = 0
        self.flags: dict[object, str] = {LEGACY: "legacy"}
        self.roles: dict[object, str] = {LEGACY: "compute"}
        self.queues: dict[object, list[_Item]] = defaultdict(list)
        self.heads: dict[object, int] = defaultdict(int)
        self.events: dict[int, _Item] = {}
        self.nccl: dict[int, _Item] = {}
        self.launches: list[_Item] = []  # NCCL launches in issue order (rule 7)
        self.first_open = 0  # index into launches of the oldest not done
        self.blocked_on: object = None  # what the host waits for: an _Item, or ("connect", key, peers)
        self.after_warmup = False

    def head(self, s) -> _Item | None:
        q = self.queues[s]
        i = self.heads[s]
        return q[i] if i < len(q) else None

    def stream_name(self, s) -> str:
        if isinstance(s, str):
            return f"{s} stream"
        if s == LEGACY:
            return "stream 0 (legacy default, compute)"
        return f"stream {s} ({self.roles.get(s, '?')}, {self.flags.get(s, '?')})"


class _Replay:
    def __init__(self, programs: list[Program], rules: Rules):
        self.rules = rules
        self.ranks = [_Rank(p) for p in programs]
        self.counters: dict[tuple, int] = defaultdict(int)
        self.p2p: dict[tuple, _Item] = {}  # (comm, src, dst, seq, kind) -> launch
        self.coll: dict[tuple, dict[int, _Item]] = defaultdict(dict)  # (comm, seq) -> rank -> launch
        self.pending_partners: list[tuple[_Item, tuple]] = []
        self.arrived: dict[tuple, set[int]] = defaultdict(set)
        self.connected: set[tuple] = set()
        self.problems: list[str] = []
        self.running: list[_Item] = []
        self.comms: set[str] = set()

    # -- host --------------------------------------------------------------------------------------------
    def advance_host(self, rk: _Rank) -> bool:
        moved = False
        prog = rk.prog.instructions
        while rk.pc < len(prog):
            blocked = rk.blocked_on
            if blocked is not None:
                if not self._host_free(rk):
                    return moved
                rk.blocked_on = None
                if isinstance(blocked, tuple):  # connected now: post the launch that waited for it
                    self._issue(rk, prog[rk.pc])
                rk.pc += 1
                moved = True
                continue
            if self._issue(rk, prog[rk.pc]):
                rk.pc += 1
            moved = True  # issued, or blocked after arriving at a connection (which may free a peer)
        return moved

    def _host_free(self, rk: _Rank) -> bool:
        b = rk.blocked_on
        if isinstance(b, _Item):
            return b.done
        if isinstance(b, tuple) and b[0] == "connect":
            return all(k in self.connected for k in b[1])
        return True

    def _issue(self, rk: _Rank, ins: dict) -> bool:
        """Issue one instruction; False when it leaves the host blocked (rk.blocked_on says on what)."""
        op, at = ins["op"], ins.get("at") or ""
        where = f" [during {at}]" if at else ""
        if op == "stream":
            rk.flags[ins["stream"]] = ins["flags"]
            rk.roles[ins["stream"]] = ins["role"]
            return True
        if op == "mark":
            if ins["name"] == "warm-up done":
                rk.after_warmup = True
            return True
        if op == "release":
            return True
        if op == "kernel":
            self._push(rk, ins["stream"], "kernel", f"kernel {ins['name']}")
            return True
        if op == "record":
            rk.events[ins["event"]] = self._push(rk, ins["stream"], "record", f"event {ins['event']} record{where}")
            return True
        if op == "wait_event":
            self._push(rk, ins["stream"], "wait_event", f"wait for event {ins['event']}{where}",
                       after=rk.events.get(ins["event"]))
            return True
        if op == "wait_nccl":
            target = self._launch(rk, ins["id"])
            self._push(rk, ins["stream"], "wait_nccl", f"wait for {target.text.split(' (')[0]}{where}", after=target)
            if self.rules.blocking_wait:
                rk.blocked_on = target
                return False
            return True
        if op == "host_wait":
            target = rk.events.get(ins["event"]) if "event" in ins else self._launch(rk, ins["id"])
            if target is None:
                return True
            rk.blocked_on = target
            return False
        if op == "nccl":
            return self._post(rk, ins, where)
        raise TraceError(f"{rk.prog.source}: instruction {rk.pc}: unknown op {op!r}")

    def _launch(self, rk: _Rank, k: int) -> _Item:
        item = rk.nccl.get(k)
        if item is None:
            raise TraceError(f"{rk.prog.source}: instruction {rk.pc} waits for NCCL launch {k}, which no earlier "
                             "instruction posted")
        return item

    def _push(self, rk: _Rank, s, kind: str, text: str, after: _Item | None = None) -> _Item:
        if s != LEGACY and not isinstance(s, str) and s not in rk.flags:
            raise TraceError(f"{rk.prog.source}: instruction {rk.pc} uses stream {s}, which no 'stream' "
                             "instruction declared")
        item = _Item(rk.r, s, kind, rk.pc, text, after)
        rk.queues[s].append(item)
        return item

    def _post(self, rk: _Rank, ins: dict, where: str) -> bool:
        comm, r = ins["comm"], rk.r
        names = ", ".join(o["name"] for o in ins["ops"])
        keys = []
        for o in ins["ops"]:
            if o["kind"] in P2P_KINDS:
                keys.append(connection(comm, r, o["peer"]))
            elif o["kind"] == "all_to_all":
                keys += [connection(comm, r, m) for m in ins["members"] if m != r]
            else:
                keys.append(connection(comm, r))
        if rk.blocked_on is None:
            new = [k for k in keys if k not in self.connected]
            for k in new:
                self.arrived[k].add(r)
                need = set(ins["members"]) if k[1] == "coll" else set(k[1:])
                if need <= self.arrived[k]:
                    self.connected.add(k)
            if new and rk.after_warmup:
                peers = sorted({p for k in new for p in ((k[1], k[2]) if k[1] != "coll" else ins["members"])
                                if p != r})
                self.problems.append(f"rank {r} connects to rank(s) {', '.join(map(str, peers))} on {comm} at "
                                     f"{names} after the warm-up: a host-blocking rendezvous inside a step "
                                     "(the warm-up must make every connection a step uses)")
            if any(k not in self.connected for k in keys):
                rk.blocked_on = ("connect", tuple(keys), names)
                return False
        self.comms.add(comm)
        post = self._push(rk, ins["stream"], "post", f"post of {names}{where}")
        item = self._push(rk, f"nccl:{comm}", "nccl", f"{names} (NCCL on {comm})", after=post)
        rk.nccl[ins["id"]] = item
        rk.launches.append(item)
        for o in ins["ops"]:
            kind = o["kind"]
            if kind in P2P_KINDS:
                src, dst = (r, o["peer"]) if kind == "send" else (o["peer"], r)
                seq = self.counters[(comm, src, dst, kind)]
                self.counters[(comm, src, dst, kind)] += 1
                self.p2p[(comm, src, dst, seq, kind)] = item
                other = "recv" if kind == "send" else "send"
                self.pending_partners.append((item, ("p2p", (comm, src, dst, seq, other), o["peer"], o["name"])))
            else:
                seq = self.counters[(comm, "coll", r)]
                self.counters[(comm, "coll", r)] += 1
                self.coll[(comm, seq)][r] = item
                for m in ins["members"]:
                    if m != r:
                        self.pending_partners.append((item, ("coll", (comm, seq), m, o["name"])))
        return True

    # -- streams -------------------------------------------------------------------------------------------
    def advance_streams(self, rk: _Rank) -> bool:
        moved = False
        for s in list(rk.queues):
            while True:
                item = rk.head(s)
                if item is None:
                    break
                if item.started:
                    if not item.done:
                        break
                    rk.heads[s] += 1
                    moved = True
                    continue
                if self._blocker(rk, item) is not None:
                    break
                item.started = True
                moved = True
                if item.kind == "nccl":
                    self.running.append(item)
                    break
                item.done = True
        return moved

    def _blocker(self, rk: _Rank, item: _Item):
        """What keeps a stream's head from starting: (thing, why), or None."""
        if item.after is not None and not item.after.done:
            why = {"post": "the NCCL launch waits for its posting stream's earlier work",
                   "wait_event": "waits for the event's record", "wait_nccl": "waits for the NCCL launch to end",
                   "nccl": "waits for its posting stream"}.get(item.kind, "waits for")
            return item.after, why
        flag = rk.flags.get(item.stream) if not isinstance(item.stream, str) else "nccl"
        if flag == "legacy":
            for s, f in rk.flags.items():
                if f == "blocking":
                    h = rk.head(s)
                    if h is not None and h.issue < item.issue and not h.done:
                        return h, "the legacy default stream waits for earlier work of every blocking stream"
        elif flag == "blocking":
            h = rk.head(LEGACY)
            if h is not None and h.issue < item.issue and not h.done:
                return h, "a blocking stream waits for earlier work of the legacy default stream"
        if item.kind == "nccl" and self.rules.launch_order:
            while rk.first_open < len(rk.launches) and rk.launches[rk.first_open].done:
                rk.first_open += 1
            first = rk.launches[rk.first_open]
            if first is not item and first.issue < item.issue:
                return first, "NCCL launches of one device progress in launch order (launch_order)"
        return None

    def resolve_partners(self) -> None:
        """Bind each launch's ops to the partner launches (now that every rank issued what it could)."""
        left = []
        for item, (what, key, peer, name) in self.pending_partners:
            other = self.p2p.get(key) if what == "p2p" else self.coll.get(key, {}).get(peer)
            if other is None:
                left.append((item, (what, key, peer, name)))
            else:
                item.partners.append(other)
        self.pending_partners = left

    def complete(self) -> bool:
        self.resolve_partners()
        moved, still = False, []
        waiting = {id(i) for i, _ in self.pending_partners}
        for item in self.running:
            if id(item) not in waiting and all(p.started for p in item.partners):
                item.done = True
                moved = True
            else:
                still.append(item)
        self.running = still
        return moved

    # -- the whole replay ----------------------------------------------------------------------------------
    def run(self) -> CudaReplayResult:
        moved = True
        while moved:
            moved = False
            for rk in self.ranks:
                moved |= self.advance_host(rk)
            for rk in self.ranks:
                moved |= self.advance_streams(rk)
            moved |= self.complete()
        stuck = [rk for rk in self.ranks if rk.pc < len(rk.prog.instructions) or
                 any(rk.head(s) is not None for s in rk.queues)]
        cycle = self._cycle(stuck) if stuck else []
        if stuck and not cycle:
            self.problems[:0] = self._unmatched()
        for rk in self.ranks:
            self.problems += hazards(rk.prog)
        cut = [rk.r for rk in self.ranks if not rk.prog.complete]
        if cut:
            self.problems.append(f"the run stopped early (a timeout or a dead peer): the programs of rank(s) "
                                 f"{', '.join(map(str, cut))} end where each one stopped")
        total = sum(len(rk.prog.instructions) for rk in self.ranks)
        launches = sum(len(rk.launches) for rk in self.ranks)
        return CudaReplayResult(not stuck and not self.problems, len(self.ranks), total, launches, len(self.comms),
                                self.rules, cycle, self.problems)

    def _unmatched(self) -> list[str]:
        out = []
        for rk in self.ranks:
            b = rk.blocked_on
            if isinstance(b, tuple):
                for k in b[1]:
                    if k not in self.connected:
                        others = sorted(set(range(len(self.ranks)) if k[1] == "coll" else k[1:]) - self.arrived[k]
                                        - {rk.r})
                        out.append(f"rank {rk.r}: {b[2]} never meets its partner on rank(s) "
                                   f"{', '.join(map(str, others))} (its first op on {k[0]} waits for them to post "
                                   "there, and they never do)")
        for item, (what, key, peer, name) in self.pending_partners:
            if not item.done:
                out.append(f"rank {item.rank}: {name} never meets its partner on rank {peer} (no matching "
                           f"{'op' if what == 'p2p' else 'collective'} posted there)")
        return out or ["stuck without a wait cycle (a program that ends while work is queued)"]

    def _waits(self, node) -> list[tuple[object, str]]:
        """What a stuck node (a rank's host, ("host", r), or an _Item) waits for, with why."""
        if isinstance(node, tuple):
            rk = self.ranks[node[1]]
            b = rk.blocked_on
            if b is None and rk.pc >= len(rk.prog.instructions) and not rk.prog.complete:
                last = self._last_open(rk)
                return [(last, "the run stopped here: the host was blocked on its last work")] if last else []
            if isinstance(b, _Item):
                return [(b, "the host waits for it")]
            if isinstance(b, tuple):
                out = []
                for k in b[1]:
                    if k in self.connected:
                        continue
                    comm = k[0]
                    peers = [p for p in ((k[1], k[2]) if k[1] != "coll" else range(len(self.ranks)))
                             if p != rk.r and p not in self.arrived[k]]
                    out += [(("host", p), f"{CONNECT} (rank {p}, {comm}: {b[2]})") for p in peers]
                return out
            return []
        item = node
        rk = self.ranks[item.rank]
        q = rk.queues[item.stream]
        i = q.index(item)
        if i > rk.heads[item.stream]:
            return [(q[i - 1], "stream order")]
        if item.started:  # a running NCCL launch
            out = []
            for what, key, peer, name in (v for it, v in self.pending_partners if it is item):
                out.append((("host", peer), f"its partner for {name} is not posted yet on rank {peer}"))
            out += [(p, f"{RENDEZVOUS}; {COLLECTIVE}") for p in item.partners if not p.started]
            return out
        b = self._blocker(rk, item)
        return [b] if b is not None else []

    @staticmethod
    def _last_open(rk: _Rank) -> _Item | None:
        """The latest-issued work of a rank that has not completed."""
        open_items = [i for s, q in rk.queues.items() for i in q[rk.heads[s]:] if not i.done]
        return max(open_items, key=lambda i: i.issue) if open_items else None

    def _describe(self, node) -> str:
        if isinstance(node, tuple):
            rk = self.ranks[node[1]]
            ins = rk.prog.instructions[rk.pc] if rk.pc < len(rk.prog.instructions) else {"op": "end"}
            at = f" during {ins['at']}" if ins.get("at") else ""
            return f"rank {node[1]} host at instruction {rk.pc} ({ins['op']}{at})"
        rk = self.ranks[node.rank]
        return f"rank {node.rank} {rk.stream_name(node.stream)}: {node.text}"

    def _cycle(self, stuck: list[_Rank]) -> list[str]:
        starts = [("host", rk.r) for rk in stuck if rk.pc < len(rk.prog.instructions)]
        starts += [("host", rk.r) for rk in stuck if rk.pc >= len(rk.prog.instructions) and not rk.prog.complete]
        starts += [rk.head(s) for rk in stuck for s in rk.queues if rk.head(s) is not None]
        for start in starts:
            path, seen, why = [], {}, []
            node = start
            while node is not None and self._key(node) not in seen:
                seen[self._key(node)] = len(path)
                path.append(node)
                nxt = self._waits(node)
                if not nxt:
                    node = None
                    break
                node, reason = nxt[0]
                why.append(reason)
            if node is None:
                continue
            first = seen[self._key(node)]
            lines = self._lines(path[first:], why[first:])
            if len(lines) > MAX_CYCLE:
                lines = lines[:MAX_CYCLE] + [f"... and {len(lines) - MAX_CYCLE} more"]
            return lines
        return []

    def _lines(self, loop: list, reasons: list[str]) -> list[str]:
        """One line per step of the cycle; a run of one stream's work held only by stream order is one line
        (its latest item, and how many earlier ones it sits behind)."""
        out, i = [], 0
        while i < len(loop):
            j = i
            while j + 1 < len(loop) and reasons[j] == "stream order":
                j += 1
            if j > i:
                out.append(f"{self._describe(loop[i])}  --[stream order: behind {j - i} earlier item(s) of the "
                           "stream]-->")
            out.append(f"{self._describe(loop[j])}  --[{reasons[j]}]-->")
            i = j + 1
        return out

    @staticmethod
    def _key(node):
        return node if isinstance(node, tuple) else id(node)


def replay_programs(programs: list[Program], rules: Rules = Rules()) -> CudaReplayResult:
    """Replay all ranks' programs (one run, ranks 0..world-1) under `rules`."""
    return _Replay(programs, rules).run()
