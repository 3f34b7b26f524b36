"""Monotone physics (issue 32 item 3): more of a hardware resource never makes anything slower.

For the presets tiny-moe, paper-3b and paper-27b on the h800, a pair of hardware specs that differ in one
resource only (the second has more of it): HBM bandwidth, intra-node (NVLink) bandwidth, inter-node bandwidth,
more SMs left to compute (a smaller all-to-all carve-out `comm_sms`), or a shorter kernel launch gap. With more of
the resource, no step makespan and no F&B pair priced alone (every pair kind, baseline and mHC) may rise; the
only slack is float noise (1e-9 relative). Guards costmodel/pricing/fb_overlap.py's fixed issue order (restoring the
greedy
W back-filling fails the intra-node case and the cliff test; see overlap.py, "Monotone physics").
"""
from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from configs import load_config
from costmodel.physics.hardware import get_hardware
from costmodel.pricing.fb_overlap import TimedOp, overlap
from costmodel.answers.predict import predict, residual_spec_of
from costmodel.pricing.options import Options

REL = 1e-9
PRESETS = ("tiny-moe", "paper-3b", "paper-27b")


@functools.lru_cache(maxsize=None)
def _cfg(preset):
    return load_config(preset, {})


def _spec(hw0, what: str, f: float):
    """(hardware, options) with `f` times the resource `what` (f > 1: more of it)."""
    if what == "hbm":
        return hw0.model_copy(update={"hbm_bandwidth": hw0.hbm_bandwidth * f}), Options()
    if what == "intra":
        return hw0.model_copy(update={"intra": hw0.intra.with_bandwidth(hw0.intra.bandwidth * f)}), Options()
    if what == "inter":
        return hw0.model_copy(update={"inter": hw0.inter.with_bandwidth(hw0.inter.bandwidth * f)}), Options()
    if what == "launch":  # f times the issue rate: launch gap / f
        return hw0.model_copy(update={"launch_us": hw0.launch_us / f}), Options()
    if what == "compute_sms":  # SMs left to compute while an all-to-all runs: carve-out comm_sms / f
        return hw0, Options(comm_sms=int(hw0.comm_sms / f))
    raise ValueError(what)


def _times(preset: str, hw, opts) -> dict:
    cfg = _cfg(preset)
    pred = predict(cfg, hw, residual_spec_of(cfg), opts, ladder=False)
    out = {("step", name): pred.summary["iteration_us"][name] for name in ("baseline", "mhc")}
    for name in ("baseline", "mhc"):
        for key, res in pred.pricers[name].results.items():
            if key[0] == "FB":
                out[(name,) + key] = res.makespan
    return out


def _check(preset: str, what: str, f_lo: float, f_hi: float) -> None:
    hw0 = get_hardware("h800")
    lo = _times(preset, *_spec(hw0, what, f_lo))
    hi = _times(preset, *_spec(hw0, what, f_hi))
    rises = {k: (lo[k], hi[k]) for k in hi if k in lo and hi[k] > lo[k] * (1 + REL)}
    assert not rises, f"{preset}: more {what} ({f_lo:g}x -> {f_hi:g}x) made these slower: {rises}"


factor = st.floats(0.5, 2.0, allow_nan=False)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("what", ["hbm", "intra", "inter", "launch"])
@settings(max_examples=4, deadline=None)
@given(a=factor, b=factor)
def test_more_bandwidth_or_faster_launch_never_slows_a_step_or_a_pair(preset, what, a, b):
    lo, hi = sorted((a, b))
    _check(preset, what, lo, hi)


@pytest.mark.parametrize("preset", PRESETS)
@settings(max_examples=4, deadline=None)
@given(a=st.integers(0, 40), b=st.integers(0, 40))
def test_a_smaller_comm_sm_carve_out_never_slows_a_step_or_a_pair(preset, a, b):
    """Direction: fewer SMs taken by the all-to-all = more SMs left to compute."""
    hw0 = get_hardware("h800")
    more, fewer = max(a, b), min(a, b)
    lo = _times(preset, hw0, Options(comm_sms=more))
    hi = _times(preset, hw0, Options(comm_sms=fewer))
    rises = {k: (lo[k], hi[k]) for k in hi if k in lo and hi[k] > lo[k] * (1 + REL)}
    assert not rises, f"{preset}: comm_sms {more} -> {fewer} made these slower: {rises}"


def test_the_issue_32_cliff_is_gone():
    """paper-27b on the h800: the baseline pair F1/B10 got 3.6% slower from 160 to 165 GB/s NVLink (a W lost its
    back-filled gap); now every pair and step falls with more bandwidth over 140..260 GB/s."""
    hw0 = get_hardware("h800")
    prev = None
    for gbs in (140, 160, 165, 170, 200, 230, 240, 250, 260):
        t = _times("paper-27b", hw0.model_copy(update={"intra": hw0.intra.with_bandwidth(gbs * 1e9)}), Options())
        if prev is not None:
            assert all(t[k] <= prev[k] * (1 + REL) for k in t), gbs
        prev = t


@settings(max_examples=60, deadline=None)
@given(gap=st.floats(0.5, 10), w=st.floats(0.1, 20), shrink=st.floats(0.0, 1.0))
def test_a_shorter_dispatch_never_slows_a_pair(gap, w, shrink):
    """A pair whose forward waits on a dispatch while the backward has a W left: a shorter dispatch never makes
    the pair longer (the greedy back-fill made it longer whenever the W stopped fitting the shrunken wait)."""
    def pair(d):
        f = [TimedOp("f.a", "model", "compute", 5), TimedOp("f.dispatch", "a2a", "comm", d),
             TimedOp("f.experts", "model", "compute", 5), TimedOp("f.combine", "a2a", "comm", 3, output=True)]
        b = [TimedOp("b.dgrad", "model", "compute", 1, output=True),
             TimedOp("b.wgrad", "model", "compute", w, (-1,), deferrable=True)]
        return overlap([f, b], "streams").makespan
    assert pair(gap * shrink) <= pair(gap) * (1 + REL)


@functools.lru_cache(maxsize=None)
def _v3_small():
    """deepseek-v3 (MLA, FP8 with its quantisation passes, node-limited routing over 8 nodes, the NIC shared by P2P
    and all-to-all, MTP) with 32 micro-batches per replica, so that it simulates in about a second."""
    return load_config("deepseek-v3", {"parallel": {"microbatches": 128 * 32}})


@pytest.mark.parametrize("what", ["hbm", "intra", "inter", "launch"])
def test_v3_scale_physics_is_monotone_too(what):
    """The new physics at DeepSeek-V3 scale under the same rule: more of a resource, nothing slower."""
    hw0 = get_hardware("h800")
    cfg = _v3_small()

    def times(f: float) -> dict:
        hw, opts = _spec(hw0, what, f)
        pred = predict(cfg, hw, residual_spec_of(cfg), opts, ladder=False)
        out = {("step", n): pred.summary["iteration_us"][n] for n in ("baseline", "mhc")}
        for n in ("baseline", "mhc"):
            out.update({(n,) + k: r.makespan for k, r in pred.pricers[n].results.items() if k[0] == "FB"})
        return out

    for lo_f, hi_f in ((0.7, 1.0), (1.0, 1.6)):
        lo, hi = times(lo_f), times(hi_f)
        rises = {k: (lo[k], hi[k]) for k in hi if k in lo and hi[k] > lo[k] * (1 + REL)}
        assert not rises, f"deepseek-v3: more {what} ({lo_f:g}x -> {hi_f:g}x) made these slower: {rises}"
