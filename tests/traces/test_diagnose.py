"""Stream-collapse diagnostics: layer_stats, the training-time collector, merging and summarising runs, and
`mhcpipe diagnose` end to end (through mhcpipe.cli's error handling)."""
from __future__ import annotations

import json
import math

import pytest
import torch
from matplotlib.image import imread

import mhcpipe.cli as cli
from kernels import MHCConfig, MHCSublayer
from kernels.diagnostics import View, amax_gain, composite, layer_stats, mhc_view
from kernels.sinkhorn import sinkhorn
from pipeline.observability.diagnostics_log import DiagnosticsLog
from pipeline.observability.diagnose import SCHEMA, load, summary

F64 = torch.float64
T, N, C = 6, 4, 5


def _view(res: torch.Tensor, read: torch.Tensor | None = None, write: torch.Tensor | None = None) -> View:
    t, n = res.shape[:2]
    ones = torch.ones(t, n, dtype=res.dtype)
    return View(read=ones if read is None else read, write=ones if write is None else write, res=res)


def _perm(order: list[int]) -> torch.Tensor:
    """Permutation matrix sending stream j to stream order[j] (H[i, j] = 1 iff i = order[j])."""
    m = torch.zeros(len(order), len(order), dtype=F64)
    m[order, range(len(order))] = 1.0
    return m


# -- layer_stats ------------------------------------------------------------------------------------------------
def test_identity_res_is_distance_zero_gain_one():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, N, C, generator=g, dtype=F64) * torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=F64)[:, None]
    s = layer_stats(x, _view(torch.eye(N, dtype=F64).expand(T, N, N)))
    assert s["res_identity_dist"] == 0.0 and s["gain_fwd"] == 1.0 and s["gain_bwd"] == 1.0
    assert s["res_mean"] == torch.eye(N, dtype=F64).tolist()
    rms = x.pow(2).mean(dim=(0, 2)).sqrt()
    assert torch.allclose(torch.tensor(s["stream_rms"], dtype=F64), rms, rtol=1e-13, atol=0)
    assert math.isclose(s["imbalance"], float(rms.max() / rms.min()), rel_tol=1e-13)
    assert s["read_share"] == [0.25] * 4 and s["write_share"] == [0.25] * 4
    json.dumps(s)  # plain floats and lists


def test_permutation_res_keeps_gain_one_but_is_far_from_identity():
    x = torch.ones(T, N, C)
    cycle = _perm([1, 2, 3, 0])  # every stream moves: P - I has four +1 and four -1 entries
    s = layer_stats(x, _view(cycle.expand(T, N, N)))
    assert s["gain_fwd"] == 1.0 and s["gain_bwd"] == 1.0
    assert math.isclose(s["res_identity_dist"], math.sqrt(8), rel_tol=1e-14)
    swap = _perm([1, 0, 2, 3])
    assert math.isclose(layer_stats(x, _view(swap.expand(T, N, N)))["res_identity_dist"], 2.0, rel_tol=1e-14)
    assert s["imbalance"] == 1.0


def test_read_concentrated_on_one_stream_and_signed_hc_weights():
    x = torch.randn(T, N, C, dtype=F64)
    read = torch.zeros(T, N, dtype=F64)
    read[:, 2] = torch.linspace(0.5, 3.0, T, dtype=F64)
    read[0, 2] = -2.0  # HC weights can be negative: the share uses |w|
    write = torch.tensor([1.0, -1.0, 2.0, 0.0], dtype=F64).expand(T, N)
    s = layer_stats(x, _view(torch.eye(N, dtype=F64).expand(T, N, N), read, write))
    assert s["read_share"] == [0.0, 0.0, 1.0, 0.0]
    assert s["write_share"] == pytest.approx([0.25, 0.25, 0.5, 0.0], abs=1e-15)


def test_gains_are_token_max_and_res_mean_token_mean():
    res = torch.stack([torch.eye(N, dtype=F64), 2.0 * torch.eye(N, dtype=F64)])
    res[1, 0, 1] = -1.0  # row 0 of token 1: |2| + |-1| = 3; column 1: 1 + 2 = 3
    res[0, 3, 2] = 0.5  # token 0: row 3 sums 1.5, column 2 sums 1.5
    s = layer_stats(torch.ones(2, N, 1), _view(res))
    assert s["gain_fwd"] == 3.0 and s["gain_bwd"] == 3.0
    assert torch.allclose(torch.tensor(s["res_mean"], dtype=F64), res.mean(0), rtol=0, atol=1e-15)
    want = float(torch.linalg.matrix_norm(res - torch.eye(N, dtype=F64)).mean())
    assert math.isclose(s["res_identity_dist"], want, rel_tol=1e-14)


def test_zero_stream_is_infinite_imbalance_and_bad_shapes_are_errors():
    x = torch.ones(T, N, C)
    x[:, 3] = 0
    assert layer_stats(x, _view(torch.eye(N).expand(T, N, N)))["imbalance"] == math.inf
    with pytest.raises(ValueError, match=r"x must be \[T, N, C\]"):
        layer_stats(torch.ones(T, N + 1, C), _view(torch.eye(N).expand(T, N, N)))
    with pytest.raises(ValueError, match=r"view.res must be \[T, N, N\]"):
        layer_stats(x, View(torch.ones(T, N), torch.ones(T, N), torch.ones(T, N, N + 1)))
    with pytest.raises(ValueError, match=r"view.write"):
        layer_stats(x, View(torch.ones(T, N), torch.ones(T + 1, N), torch.ones(T, N, N)))


def test_xhc_shaped_view_zero_write_on_inactive_streams():
    """N = 16, k = 4 active streams: write is 0 on inactive streams, res the k x k block embedded in I."""
    big, active = 16, [0, 1, 5, 9]
    g = torch.Generator().manual_seed(2)
    block = sinkhorn(torch.randn(T, 4, 4, generator=g, dtype=F64), 20, "exp", 0.0)
    res = torch.eye(big, dtype=F64).repeat(T, 1, 1)
    res[:, torch.tensor(active)[:, None], torch.tensor(active)] = block
    write = torch.zeros(T, big, dtype=F64)
    write[:, active] = torch.rand(T, 4, generator=g, dtype=F64) + 0.1
    s = layer_stats(torch.randn(T, big, C, generator=g, dtype=F64), _view(res, write=write))
    assert [i for i in range(big) if s["write_share"][i] > 0] == active
    assert math.isclose(sum(s["write_share"]), 1.0, rel_tol=1e-14) and s["read_share"] == [1 / 16] * 16
    want = float(torch.linalg.matrix_norm(block - torch.eye(4, dtype=F64)).mean())  # inactive part is exact I
    assert math.isclose(s["res_identity_dist"], want, rel_tol=1e-12)
    assert math.isclose(s["gain_fwd"], float(amax_gain(block).forward.max()), rel_tol=1e-14)


@pytest.mark.parametrize("variant", ["hc", "mhc", "mhc-lite"])
def test_mhc_view_of_real_coefficients(variant):
    torch.manual_seed(3)
    m = MHCSublayer(MHCConfig(variant=variant, n=4, backend="reference"), torch.nn.Identity(), 8, layer_index=1)
    x = torch.randn(7, 4, 8)
    co = m.coefficients(x)
    view = mhc_view(co)
    assert view.read is co.h_pre and view.write is co.h_post and view.res is co.h_res
    s = layer_stats(x, view)
    assert math.isclose(sum(s["read_share"]), 1.0, rel_tol=1e-12)
    if variant == "hc":  # HC's static init reads stream (layer mod n) = 1 and keeps H_res near the identity
        assert max(range(4), key=lambda i: s["read_share"][i]) == 1 and s["res_identity_dist"] < 0.1
    else:  # doubly stochastic (Sinkhorn to fp32 precision; mhc-lite exactly): single-layer gains 1
        assert s["gain_fwd"] == pytest.approx(1.0, abs=1e-5) and s["gain_bwd"] == pytest.approx(1.0, abs=1e-3)


# -- the collector -----------------------------------------------------------------------------------------------
def test_every_and_final_step():
    with pytest.raises(ValueError, match="--diagnostics-every"):
        DiagnosticsLog(0, rank=0)
    log = DiagnosticsLog(3, rank=0)
    assert [s for s in range(10) if log.wants(s, 4, 4)] == [0, 3, 6, 9]
    assert [s for s in range(10) if log.wants_step(s)] == [0, 3, 6, 9]
    assert not log.wants(3, 5, 4)  # only the first micro-batch the stage sees
    log.final_step(7)
    assert [s for s in range(8) if log.wants(s, 0, 0)] == [0, 3, 6, 7] and log.wants_step(7)


def _hc_like(t: int, n: int, g: torch.Generator) -> torch.Tensor:
    """Unconstrained per-token H_res near the identity: composite gains grow with depth."""
    return torch.eye(n, dtype=F64) + 0.4 * torch.randn(t, n, n, generator=g, dtype=F64)


def test_stage_composite_equals_kernels_composite():
    g = torch.Generator().manual_seed(5)
    log = DiagnosticsLog(1, rank=0)
    hs = [_hc_like(T, N, g) for _ in range(5)]
    x = torch.randn(T, N, C, generator=g, dtype=F64)
    for layer, h in enumerate(hs[:3]):
        log.sublayer(0, 0, layer, x, _view(h))
    log.sublayer(0, 0, 1, x, _view(torch.eye(N, dtype=F64).expand(T, N, N)))  # recompute re-run: ignored
    log.stage_end(0, 0, 3, 2 * x)
    for layer, h in enumerate(hs[3:], start=3):
        log.sublayer(0, 1, layer, x.float(), _view(h.float()))
    log.stage_end(0, 1, 5, x)
    rec = log.record()
    assert [lay["layer"] for lay in rec["steps"][0]["layers"]] == [0, 1, 2, 3, 4]
    s0, s1 = rec["steps"][0]["stages"]
    for st, stack in ((s0, torch.stack(hs[:3])), (s1, torch.stack([h.float() for h in hs[3:]]))):
        gain = amax_gain(composite(stack))
        assert gain.forward.max() > 1.5  # a real product, not an identity that would pass trivially
        assert math.isclose(st["gain_fwd_max"], float(gain.forward.max()), rel_tol=1e-12)
        assert math.isclose(st["gain_bwd_max"], float(gain.backward.max()), rel_tol=1e-12)
        assert math.isclose(st["gain_fwd_mean"], float(gain.forward.mean()), rel_tol=1e-12)
        assert math.isclose(st["gain_bwd_mean"], float(gain.backward.mean()), rel_tol=1e-12)
    assert (s0["first_layer"], s0["last_layer"], s0["layers"], s0["tokens"]) == (0, 2, 3, T)
    assert s0["exit"]["layer"] == 3 and s0["exit"]["stream_rms"] == pytest.approx(
        (2 * x).pow(2).mean(dim=(0, 2)).sqrt().tolist(), rel=1e-13)
    with pytest.raises(ValueError, match="depth order"):
        log.sublayer(0, 0, 7, x, _view(hs[0]))  # stage 0 already closed


def _write_run(d, ranks: dict[int, list[tuple[int, list[int]]]], steps: list[int], kind: str, seed: int = 0):
    """Synthetic run: ranks {rank: [(stage, [layers])]}; per step, views from `kind` ('hc' or 'mhc')."""
    for rank, stages in ranks.items():
        g = torch.Generator().manual_seed(seed)  # same seed on every rank: a DualPipe copy sees the same layers
        log = DiagnosticsLog(2, rank=rank)
        log.final_step(steps[-1])
        for step in steps:
            for stage, layers in stages:
                x = torch.randn(T, N, C, generator=g, dtype=F64)
                for layer in layers:
                    x[:, 0] *= 1.0 + 0.1 * step * (kind == "hc")  # collapse: stream 0 grows with training
                    if kind == "hc":
                        h = _hc_like(T, N, g)
                    else:
                        h = sinkhorn(torch.randn(T, N, N, generator=g, dtype=F64) * 3, 20, "exp", 0.0)
                    read = torch.rand(T, N, generator=g, dtype=F64)
                    log.sublayer(step, stage, layer, x, _view(h, read, 2 * read))
                log.stage_end(step, stage, layers[-1] + 1, x)
        log.save(d)


def test_save_load_round_trip_and_model_composite(tmp_path):
    _write_run(tmp_path / "hc_4", {0: [(0, [0, 1, 2])], 1: [(1, [3, 4, 5])]}, [0, 2, 3], "hc")
    data = json.loads((tmp_path / "hc_4" / "diagnostics_rank1.json").read_text())
    assert data["schema"] == SCHEMA and data["rank"] == 1 and [s["step"] for s in data["steps"]] == [0, 2, 3]
    (run,) = load([tmp_path / "hc_4"])
    assert run.label == "hc_4" and run.ranks == [0, 1] and run.streams == N
    sd = run.steps[-1]
    assert [lay["layer"] for lay in sd.layers] == list(range(6)) and sd.missing_layers == []
    assert sd.layers[4] == data["steps"][2]["layers"][1]  # the stats as saved, ranks merged in depth order
    assert [d for d, _ in sd.depth_imbalance] == list(range(7))  # + the stack output (exit of stage 1)
    means = torch.tensor([lay["res_mean"] for lay in sd.layers], dtype=F64)
    for depth in range(1, 7):
        gain = amax_gain(composite(means[:depth]))
        assert math.isclose(sd.gain_fwd[depth - 1], float(gain.forward), rel_tol=1e-12)
        assert math.isclose(sd.gain_bwd[depth - 1], float(gain.backward), rel_tol=1e-12)
    assert sd.gain_bwd[-1] > 1.5


def test_merge_of_ranks_and_of_a_duplicated_stage(tmp_path):
    # DualPipe-like: stage 1 lives on rank 1 and rank 2; rank 2's copy saw a different micro-batch.
    _write_run(tmp_path / "mhc_4", {0: [(0, [0, 1])], 1: [(1, [2, 3])]}, [0, 4], "mhc", seed=1)
    dup = tmp_path / "dup"
    _write_run(dup, {2: [(1, [2, 3]), (0, [0, 1])]}, [0, 4], "mhc", seed=9)
    (dup / "diagnostics_rank2.json").rename(tmp_path / "mhc_4" / "diagnostics_rank2.json")
    (run,) = load([tmp_path / "mhc_4"])
    assert run.ranks == [0, 1, 2]
    sd = run.steps[-1]
    assert [lay["layer"] for lay in sd.layers] == [0, 1, 2, 3] and [s["stage"] for s in sd.stages] == [0, 1]
    r1 = json.loads((tmp_path / "mhc_4" / "diagnostics_rank1.json").read_text())["steps"][-1]
    assert sd.layers[2] == r1["layers"][0] and sd.stages[1] == r1["stages"][0]  # rank 1's copy, once
    assert len(sd.gain_fwd) == 4


def test_summary_deep_half_trend_and_missing(tmp_path):
    log = DiagnosticsLog(1, rank=0)
    swap, eye = _perm([1, 0, 2, 3]), torch.eye(N, dtype=F64)
    for step, scale in ((0, 1.0), (1, 5.0)):
        x = torch.ones(T, N, C, dtype=F64)
        for layer, h in enumerate([swap, swap, eye, eye]):
            x[:, 0] = scale * (layer + 1)  # stream 0 grows with depth: imbalance = scale * (layer + 1)
            read = torch.zeros(T, N, dtype=F64)
            read[:, layer % N] = 1.0
            log.sublayer(step, 0, layer, x, _view(h.expand(T, N, N), read))
        log.stage_end(step, 0, 4, x)
    log.save(tmp_path / "r")
    s = summary(load([tmp_path / "r"])[0])
    assert s["steps_logged"] == [0, 1] and s["layers"] == 4 and s["missing_layers"] == []
    last, first = s["last"], s["first"]
    assert last["res_identity_dist_deep"] == 0.0 and first["res_identity_dist_deep"] == 0.0  # deep half = eye
    assert last["imbalance_max"] == 20.0 and first["imbalance_max"] == 4.0
    assert last["imbalance_out"] == 20.0  # the stage exit at depth 4 (state leaving the last sub-layer)
    assert last["read_share_max"] == 1.0 and last["read_share_min"] == 0.0
    assert last["write_share_max"] == 0.25 and last["gain_fwd"] == 1.0 and last["gain_bwd"] == 1.0
    assert last["stage_gain_bwd_max"] == 1.0
    # A rank file that is missing: the gap is reported.
    data = json.loads((tmp_path / "r" / "diagnostics_rank0.json").read_text())
    for st in data["steps"]:
        st["layers"] = [lay for lay in st["layers"] if lay["layer"] != 1]
    (tmp_path / "r" / "diagnostics_rank0.json").write_text(json.dumps(data))
    assert summary(load([tmp_path / "r"])[0])["missing_layers"] == [1]


# -- the CLI -----------------------------------------------------------------------------------------------------
@pytest.fixture
def mhcpipe(monkeypatch, capsys):
    """Run `mhcpipe ARGS` in this process (the CLI registers the named command's module only)."""

    def run(*args) -> tuple[int, str, str]:
        rc = cli.main([str(a) for a in args])
        out = capsys.readouterr()
        return rc, out.out, out.err
    return run


def test_cli_end_to_end(mhcpipe, tmp_path):
    runs = tmp_path / "runs"
    _write_run(runs / "hc_4", {0: [(0, [0, 1, 2])], 1: [(1, [3, 4, 5])]}, [0, 2, 5], "hc")
    _write_run(runs / "mhc_4", {0: [(0, [0, 1, 2])], 1: [(1, [3, 4, 5])]}, [0, 2, 5], "mhc")
    (runs / "empty").mkdir()  # a child without diagnostics is skipped
    rc, out, err = mhcpipe("diagnose", runs, "-o", tmp_path / "d.png", "--json", tmp_path / "s.json")
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["run", "N", "L", "steps"]
    assert lines[2].startswith("hc_4 ") and lines[3].startswith("mhc_4 ") and "0->5" in lines[2]
    img = imread(tmp_path / "d.png")
    assert (tmp_path / "d.png").stat().st_size > 10_000 and img.shape[0] > 500 and img.shape[1] > 800
    sums = json.loads((tmp_path / "s.json").read_text())
    assert [s["label"] for s in sums] == ["hc_4", "mhc_4"]
    hc, mhc = (s["last"] for s in sums)
    assert hc["gain_bwd"] > mhc["gain_bwd"] and mhc["stage_gain_fwd_max"] < 1 + 1e-9
    assert sums[0]["last"]["imbalance_max"] > sums[0]["first"]["imbalance_max"]  # the collapse trend
    rc, out, err = mhcpipe("diagnose", runs / "hc_4", runs / "mhc_4", "-o", tmp_path / "e.png",
                           "--label", "HC", "--label", "mHC")
    assert rc == 0 and out.splitlines()[2].startswith("HC ") and out.splitlines()[3].startswith("mHC ")


def _one_line_error(res, *needles: str) -> None:
    rc, out, err = res
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for n in needles:
        assert n in err, err


def test_cli_bad_inputs(mhcpipe, tmp_path):
    png = tmp_path / "x.png"
    _one_line_error(mhcpipe("diagnose", tmp_path / "nope", "-o", png), "does not exist", "nope")
    (tmp_path / "bare").mkdir()
    _one_line_error(mhcpipe("diagnose", tmp_path / "bare", "-o", png), "diagnostics_rank", "--diagnostics-every")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "diagnostics_rank0.json").write_text('{"schema": "mhcpipe.diagnostics/1", "steps": [')
    _one_line_error(mhcpipe("diagnose", broken, "-o", png), str(broken / "diagnostics_rank0.json"), "JSON")
    other = tmp_path / "other"
    other.mkdir()
    (other / "diagnostics_rank3.json").write_text(json.dumps({"schema": "mhcpipe.diagnostics/0", "steps": []}))
    _one_line_error(mhcpipe("diagnose", other, "-o", png), "diagnostics_rank3.json", "schema", SCHEMA)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "diagnostics_rank0.json").write_text(json.dumps({"schema": SCHEMA, "steps": [{"step": 0}]}))
    _one_line_error(mhcpipe("diagnose", bad, "-o", png), "diagnostics_rank0.json", "malformed")
    _write_run(tmp_path / "ok", {0: [(0, [0, 1])]}, [0], "mhc")
    _one_line_error(mhcpipe("diagnose", tmp_path / "ok", "-o", png, "--label", "a", "--label", "b"), "--label")
    assert not png.exists()
