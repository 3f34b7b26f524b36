"""Which pipeline action each posted op carried, per process group in posting order (for Flight Recorder).

Flight Recorder (torch.distributed) numbers each process group's collectives (collective_seq_id) and P2P ops
(p2p_seq_id) but cannot know that "nccl:send 0->1, p2p seq 12" was `SEND_F/s0/mb3`. Every post of the runtime
goes through `note` (Comms.launch for channels, all-to-alls and gradient reductions; `collective` for the
blocking ones; the start-up warm-up), so the k-th entry of a kind on a group here is the k-th there.
pipeline/observability/fr_setup.py writes it next to the dumps; traces/formats/flight_recorder.py joins the two.
"""
from __future__ import annotations

import json
import threading
from collections import deque
from pathlib import Path

MAX_ENTRIES = 16000  # newest kept; Flight Recorder's own buffer keeps fewer (2,000 by our setting)


def pg_name(group) -> str:
    """torch's name of a process group (what Flight Recorder's entries carry), or '' when it has none."""
    return str(getattr(group, "group_name", "") or "")


class OpLedger:
    """Per process group, in posting order: ("coll", k, names) for its k-th collective (k from 1, as Flight
    Recorder's collective_seq_id) and ("p2p", k, names) for its k-th P2P batch. Bounded: the newest entries."""

    def __init__(self, max_entries: int = MAX_ENTRIES):
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], int] = {}
        self._entries: deque = deque(maxlen=max_entries)
        self._labels: dict[str, str] = {}

    def note(self, group, kind: str, names: list[str], label: str | None = None) -> None:
        name = pg_name(group)
        with self._lock:
            k = self._counts.get((name, kind), 0) + 1
            self._counts[(name, kind)] = k
            self._entries.append((name, kind, k, list(names)))
            if label and name not in self._labels:
                self._labels[name] = label

    def to_dict(self, rank: int) -> dict:
        with self._lock:
            return {"rank": rank, "group_labels": dict(self._labels),
                    "ops": [{"pg": n, "kind": k, "seq": s, "names": names} for n, k, s, names in self._entries]}

    def write(self, folder: Path, rank: int) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"actions_rank{rank}.json"
        path.write_text(json.dumps(self.to_dict(rank)) + "\n")
        return path


LEDGER = OpLedger()  # one per process: every runtime of it posts through the same process groups


def note(group, kind: str, names: list[str], label: str | None = None) -> None:
    LEDGER.note(group, kind, names, label)


