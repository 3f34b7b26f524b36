"""What-if replay (traces.analysis.whatif) against the simulator it must agree with, and its inputs.

* With the lowered schedule, re-timing a simulated trace (F, B, comm, FB halves) gives exactly the makespan
  schedules.simulate computes with those costs; without it (receive posts read off the trace) never less, and
  the same when nothing is scaled.
* Removing recorded delays (`gap=0`) from a trace with delays gives the simulator's step with the shorter costs.
* mHC's share: with recorded mHC kernel parts, or measured A/B against a baseline trace, `mhc=0` lands on the
  step without them.
* Bad factors and unknown kinds are one-line errors (exit 2).
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from mhcpipe.cli import main
from schedules import Durations, build, lower_comms, simulate
from traces.trace import Span, Trace
from traces.analysis.path_report import to_text, whatif_sections
from traces.analysis.whatif import parse_scales, whatif
from test_traces_critical_path import KINDS, close, random_durations, with_delays


def scaled(d: Durations, f: float = 1.0, iw: float = 1.0, comm: float = 1.0) -> Durations:
    per = {s: {"F": v["F"] * f, "I": v["I"] * iw, "W": v["W"] * iw} for s, v in d.per_stage.items()}
    return Durations(per_stage=per, p2p_latency=d.p2p_latency * comm)


@pytest.mark.parametrize("kind,p,m", KINDS)
def test_with_the_schedule_the_replay_is_the_simulator(kind, p, m):
    s = build(kind, p, m)
    d = random_durations(s, np.random.default_rng(2))
    t = simulate(s, d).trace
    low = lower_comms(s)
    # B scales a full backward (and the backward half of an F&B pair); I and W scale ZB's split ones
    bw = {"B": 0.6, "I": 0.6, "W": 0.6}
    for scales, want in (({"F": 0.5}, scaled(d, f=0.5)), ({"comm": 3.0}, scaled(d, comm=3.0)),
                         ({**bw, "F": 1.5}, scaled(d, f=1.5, iw=0.6))):
        w = whatif(t, scales, schedule=low)
        assert close(w.step_us, simulate(s, want).makespan), scales
        assert close(w.replay_step_us, w.measured_step_us) and w.reproduction_error_pct < 1e-9
        loose = whatif(t, scales)
        assert loose.step_us >= w.step_us - 1e-9 * w.step_us
    assert close(whatif(t, {}).step_us, simulate(s, d).makespan)


@pytest.mark.parametrize("kind,p,m", KINDS)
def test_removing_the_recorded_delays_gives_the_step_with_the_shorter_costs(kind, p, m):
    s = build(kind, p, m)
    d = random_durations(s, np.random.default_rng(4), latency=0.0)
    t = with_delays(simulate(s, d).trace, frac=0.25)
    w = whatif(t, {"gap": 0.0}, schedule=lower_comms(s))
    short = Durations(per_stage={k: {x: y * 0.75 for x, y in v.items()} for k, v in d.per_stage.items()})
    assert close(w.step_us, simulate(s, short).makespan)
    assert w.step_us < w.measured_step_us and close(w.replay_step_us, w.measured_step_us)


def with_parts(trace: Trace, share: float) -> Trace:
    """Every forward gets a recorded mHC kernel part (`F/s3/mb7/L1.post_res`) of `share` of its time."""
    parts = [Span(x.rank, "compute", "F.post_res", x.stage, x.mb, x.end - share * x.duration, share * x.duration,
                  name=f"F/s{x.stage}/mb{x.mb}/L1.post_res") for x in trace.spans if x.kind == "F"]
    return Trace(trace.spans + parts, trace.meta)


def test_mhc_zero_removes_the_recorded_mhc_parts():
    s = build("1f1b", 4, 8)
    d = random_durations(s, np.random.default_rng(6))
    t = with_parts(simulate(s, d).trace, 0.4)
    w = whatif(t, {"mhc": 0.0}, schedule=lower_comms(s))
    assert "post_res" in w.mhc_source
    assert close(w.step_us, simulate(s, scaled(d, f=0.6)).makespan)
    assert close(w.before.parts["mhc"], w.before.parts["post_res"]) and w.after.parts.get("post_res", 0.0) == 0.0


def test_mhc_zero_against_a_baseline_lands_on_the_baseline():
    s = build("dualpipev", 4, 8)
    d = random_durations(s, np.random.default_rng(8))
    base = simulate(s, d).trace
    heavy = simulate(s, scaled(d, f=3.0, iw=2.5)).trace  # "mHC": every op slower, transfers the same
    w = whatif(heavy, {"mhc": 0.0}, baseline=base, schedule=lower_comms(s), baseline_name="base.json")
    assert "A/B" in w.mhc_source and "base.json" in w.mhc_source
    assert close(w.step_us, base.makespan())
    # the baseline's own recorded step is reported beside the prediction (and printed)
    assert close(w.baseline_step_us, base.makespan()) and w.to_dict()["baseline_step_us"] == w.baseline_step_us
    assert "baseline's measured step" in to_text(whatif_sections(w.to_dict()), [])
    assert whatif(heavy, {"mhc": 0.0}, schedule=lower_comms(s)).baseline_step_us is None
    half = whatif(heavy, {"mhc": 0.5}, baseline=base, schedule=lower_comms(s))
    assert base.makespan() < half.step_us < heavy.makespan()


def test_parse_scales():
    assert parse_scales(["comm=0.5", "mhc=0", "comm=0.5"]) == {"comm": 0.25, "mhc": 0.0}
    for bad, msg in (("comm=-1", ">= 0"), ("comm", "KIND=FACTOR"), ("comm=x", "not a number"), ("F=nan", "finite")):
        with pytest.raises(ValueError, match=msg):
            parse_scales([bad])


def test_whatif_command_and_its_one_line_errors(tmp_path, capsys):
    s = build("zb1p", 4, 8)
    t = simulate(s, random_durations(s, np.random.default_rng(9))).trace
    src = t.save(tmp_path / "t.json")
    out = str(tmp_path / "w.json")
    assert main(["whatif", str(src), "--scale", "comm=0.5", "--scale", "F=0.8", "--json", out]) == 0
    d = json.loads((tmp_path / "w.json").read_text())
    assert d["step_us"] < d["measured_step_us"] and close(d["replay_step_us"], d["measured_step_us"])
    assert d["critical_path_after"]["length_us"] <= d["critical_path_before"]["length_us"]
    capsys.readouterr()
    for args, msg in ((["--scale", "comm=-0.5"], "--scale 'comm=-0.5'"), (["--scale", "bogus=0.5"], "unknown kind"),
                      (["--scale", "F"], "KIND=FACTOR")):
        assert main(["whatif", str(src), *args]) == 2
        err = capsys.readouterr().err
        assert msg in err and len(err.strip().splitlines()) == 1, err


def test_a_pair_recorded_as_one_span_splits_by_its_ranks_lone_ops():
    """DualPipe's F&B pairs (FB spans): F=0.5 shrinks only their forward half, by the lone F / B costs."""
    s = build("dualpipe", 4, 8)
    d = random_durations(s, np.random.default_rng(10))
    t = simulate(s, d).trace
    assert any(x.kind == "FB" for x in t.spans)
    w = whatif(t, {"F": 0.0}, schedule=lower_comms(s))
    assert close(w.step_us, simulate(s, scaled(d, f=0.0)).makespan)
