"""Every trace analysis (critical-path, overlap, whatif, view's Perfetto export, compare) gives the output recorded in
tests/traces/data/analysis_golden.json.gz on the suite's traces and the third-party ones (issue 58: speed work must
not change a result). The record was checked against 33aec06's code, before that work (analysis_outputs.py says
what differs and why). Exit codes, printed text and digests exactly; JSON numbers within 1e-9 relative, so a sum
in another order on another CPU does not fail it. A deliberate change rewrites the record
(`.venv/bin/python tests/traces/analysis_outputs.py --write`) and says why in its commit."""
from __future__ import annotations

import gzip
import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import analysis_outputs as A

pytestmark = pytest.mark.timeout(300)


def _diff(want, got, where: str = "") -> str | None:
    """The first difference, as a line naming where it is; None if they agree."""
    if isinstance(want, float) or isinstance(got, float):
        if isinstance(want, (int, float)) and isinstance(got, (int, float)) and not isinstance(want, bool):
            if want == got or (math.isfinite(want) and math.isfinite(got)
                               and abs(want - got) <= 1e-9 * max(abs(want), abs(got), 1e-6)):
                return None
        return f"{where}: {want!r} recorded, {got!r} now"
    if isinstance(want, dict) and isinstance(got, dict):
        if set(want) != set(got):
            return f"{where}: keys {sorted(set(want) ^ set(got))[:5]} differ"
        for k in want:
            d = _diff(want[k], got[k], f"{where}.{k}")
            if d:
                return d
        return None
    if isinstance(want, list) and isinstance(got, list):
        if len(want) != len(got):
            return f"{where}: {len(want)} items recorded, {len(got)} now"
        for i, (a, b) in enumerate(zip(want, got)):
            d = _diff(a, b, f"{where}[{i}]")
            if d:
                return d
        return None
    if want != got:
        if isinstance(want, str) and isinstance(got, str):
            i = next((k for k, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
            return f"{where}: text differs at character {i}: {want[max(0, i - 60):i + 60]!r} recorded, " \
                   f"{got[max(0, i - 60):i + 60]!r} now"
        return f"{where}: {want!r} recorded, {got!r} now"
    return None


@pytest.fixture(scope="module")
def recorded():
    with gzip.open(A.GOLDEN, "rt") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def present():
    return A.outputs()


def test_every_analysis_output_is_the_recorded_one(recorded, present):
    shared_here = A.SHARED.is_dir()
    compared = 0
    for subject, commands in recorded.items():
        if subject.startswith("shared/") and not (A.SHARED / subject.split("/", 1)[1]).exists():
            continue  # a third-party file absent on this machine
        assert subject in present, f"{subject}: recorded, but no longer produced"
        for cmd, want in commands.items():
            d = _diff(want, present[subject].get(cmd), f"{subject} / {cmd}")
            assert d is None, d
            compared += 1
    assert compared >= 4 * (len(A.FIXTURES) + len(A.KINDS) + 1) + 1
    new = [s for s in present if s not in recorded]
    assert not new, f"not in the record: {new}; record them (analysis_outputs.py --write)"
    if shared_here:
        assert any(s.startswith("shared/") for s in recorded)


def test_the_diff_sees_a_changed_number_and_tolerates_summation_order(recorded):
    cp = recorded["measured_dualpipev_tiny"]["critical-path"]
    assert cp["rc"] == 0 and cp["json"]["makespan_us"] > 0
    moved = json.loads(json.dumps(cp))
    moved["json"]["makespan_us"] *= 1 + 1e-12  # another summation order
    assert _diff(cp, moved) is None
    moved["json"]["makespan_us"] *= 1 + 1e-6
    assert "makespan_us" in _diff(cp, moved)
    moved = json.loads(json.dumps(cp))
    moved["json"]["path"] = moved["json"]["path"][1:]
    assert "items recorded" in _diff(cp, moved)
