"""The F&B pair really overlaps, measured on its own trace: 4 gloo ranks, pp=2 x dp=2 with the MoE experts over
EP=2, DualPipeV; one job trains the same model with overlap and with `--no-overlap`, one step of each in turn.

* Overlapped, a communication span of one half (its all-to-all) runs while the other half computes; serial, never.
* The forward output's send is posted when the forward half ends, not after the backward half; serial, after.
* Each half waits only for its own receive: no wait for the backward half's receive before the forward began.
* The exposed communication is a measurement: WAIT spans, matched to their ops (traces.analysis.comm_overlap).
"""
from __future__ import annotations

import re
import threading
from collections import defaultdict

import pytest

from _pipeline_helpers import check_ok, tiny_config
from pipeline.launch.local import interleaved_worker
from rank_pool import launch
from traces.analysis.comm_overlap import comm_overlap, total
from traces.trace import Trace

PIECE = re.compile(r"^(F|B)/s(\d+)/mb(\d+)/L\d+\.\w+$")


def _overlaps(a, b) -> bool:
    return a.start < b.end and b.start < a.end


def _pairs(trace: Trace) -> list[dict]:
    """Per F&B span: its halves' compute spans (pieces or whole F/B), comm spans and waits, on its rank."""
    by_rank = defaultdict(list)
    for s in trace.spans:
        by_rank[s.rank].append(s)
    out = []
    for r, spans in by_rank.items():
        for fb in (s for s in spans if s.kind == "FB"):
            f, b = (fb.stage, fb.mb), fb.partner
            inside = [s for s in spans if fb.start <= s.start <= fb.end and s is not fb]
            half = {"F": [], "B": []}
            for s in inside:
                if s.stream != "compute" or s.kind in ("WAIT", "FB", "RC"):
                    continue
                side = s.kind.split(".")[0]
                if side in half and (s.stage, s.mb) == (f if side == "F" else b):
                    half[side].append(s)
            comm = {side: [s for s in inside if s.stream == "comm" and s.kind.startswith("A2A")
                           and (s.stage, s.mb) == (f if side == "F" else b)] for side in "FB"}
            out.append({"rank": r, "fb": fb, "f": f, "b": b, "half": half, "a2a": comm, "spans": spans})
    return out


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    root = tmp_path_factory.mktemp("overlap")
    cfgs = [tiny_config("dualpipev", 2, moe=True, dp=2, ep=2, steps=3, overlap=ov, timeout_s=60)
            for ov in (True, False)]
    dirs = [str(root / "overlap"), str(root / "serial")]
    results = launch(interleaved_worker, 4, (cfgs, dirs), timeout_s=280)
    check_ok(results)
    return {name: Trace.load(root / name / "trace.json") for name in ("overlap", "serial")}


@pytest.mark.timeout(300)
def test_comm_of_one_half_runs_under_the_other_halfs_compute(traces):
    counts = {}
    for name, trace in traces.items():
        pairs = [p for p in _pairs(traces[name]) if p["a2a"]["F"] and p["a2a"]["B"]]
        assert pairs, f"{name}: no F&B pair with all-to-alls in both halves"
        hits = 0
        for p in pairs:
            for side, other in (("F", "B"), ("B", "F")):
                hits += any(_overlaps(c, s) for c in p["a2a"][side] for s in p["half"][other])
        counts[name] = hits
    assert counts["overlap"] > 0, "overlapped pairs: no all-to-all of one half ran while the other half computed"
    assert counts["serial"] == 0, f"serial pairs overlapped {counts['serial']} times: the check cannot tell them apart"


@pytest.mark.timeout(300)
def test_forward_send_does_not_wait_for_the_backward_half(traces):
    for name, trace in traces.items():
        checked = 0
        for p in _pairs(trace):
            sends = [s for s in p["spans"] if s.kind == "SEND_F" and (s.stage, s.mb) == p["f"]
                     and p["fb"].start <= s.start]
            if not sends or not p["half"]["F"] or not p["half"]["B"]:
                continue
            send = min(sends, key=lambda s: s.start)
            f_end = max(s.end for s in p["half"]["F"])
            b_end = max(s.end for s in p["half"]["B"])
            if name == "overlap":
                assert send.start <= f_end, \
                    f"rank {p['rank']} {p['fb'].label}: SEND_F {send.start - f_end:.0f} us after the forward half"
                if b_end > f_end:
                    assert send.start < b_end, f"rank {p['rank']} {p['fb'].label}: SEND_F waited for the backward half"
            else:  # the serial baseline posts the pair's sends after it: the check must see the difference
                assert send.start >= b_end
            checked += 1
        assert checked >= 2, f"{name}: only {checked} pairs with a remote forward send"


class _LateGradients:
    """A transport for one rank alone in which the output-grad receive (RECV_B) of each F&B pair's backward half
    arrives only once that pair's forward half has started computing: a pair that waits for its backward half's
    receive before its forward half begins never ends."""

    def __init__(self, rank, shape, gates: dict):
        import torch

        from pipeline.distributed.loopback import LoopbackTransport

        self.inner = LoopbackTransport(rank, torch.device("cpu"), shape, torch.float32)
        self.gates = gates  # RECV_B name -> the event its pair's forward half sets

    def post(self, ops, labels=None):
        handles = self.inner.post(ops, labels)
        for h in handles:
            if h.name in self.gates:
                h.done = False
        return handles

    def poll(self, h):
        return h.done or self.gates[h.name].is_set()

    def wait(self, h, deadline_s=None):
        from pipeline.distributed.errors import PipelineError

        if not h.done and not self.gates[h.name].wait(5.0):
            raise PipelineError(f"{h.name} was waited for before its pair's forward half began")
        h.done = True
        return h.tensor


@pytest.mark.timeout(60)
def test_each_half_waits_only_for_its_own_receive():
    import torch

    from configs import parse_config
    from pipeline.data import make_batch
    from pipeline.runtime.train import RankRuntime

    cfg = parse_config(tiny_config("dualpipev", 2, steps=1))
    rt = RankRuntime(cfg, 1, torch.device("cpu"), record=False)
    specs = {sp.stage: sp for sp in rt.plan.stages}
    gates, by_forward = {}, {}
    for a in rt.executor.actions:
        nxt = specs[a.b_stage].next if a.kind.value == "FB" else None
        if nxt is not None and specs[nxt].rank != 1:  # the backward half receives its output-grad
            gates[f"RECV_B/s{nxt}/mb{a.b_mb}"] = by_forward[(a.stage, a.mb)] = threading.Event()
    assert gates, "no F&B pair whose backward half receives"
    for st in rt.stages.values():
        steps = st.forward_steps

        def marked(run, *args, steps=steps):
            gate = by_forward.get((run.stage, run.mb))
            if gate is not None:
                gate.set()  # this pair's forward half is computing
            yield from steps(run, *args)

        st.forward_steps = marked
    shape = (cfg.parallel.tokens_per_microbatch, cfg.model.residual.n, cfg.model.hidden)
    rt.use_transport(_LateGradients(1, shape, gates))
    rt.executor.run_step(make_batch(cfg, 0))
    assert all(g.is_set() for g in gates.values())


@pytest.mark.timeout(300)
def test_exposed_communication_is_measured(traces):
    for name, trace in traces.items():
        o = comm_overlap(trace)
        assert o is not None and set(o) == {0, 1, 2, 3}
        for r, x in o.items():
            assert x.unmatched_wait_us == 0.0, f"{name} rank {r}: WAIT spans without their communication op"
            assert {"A2A_DISPATCH", "A2A_COMBINE", "RG"} <= set(x.by_kind), x.by_kind
        fb = total(o, fb=True)
        assert fb.ops > 0 and 0.0 <= fb.hidden_pct <= 100.0
    # serial pairs wait for every all-to-all right after posting it: almost nothing of it is hidden
    serial = total(comm_overlap(traces["serial"]), fb=True)
    assert serial.hidden_pct < 30.0, serial
