"""`mhcpipe tune` (costmodel/answers/tune.py, mhcpipe/tune_cli.py) and the data-parallel step terms it adds
(costmodel/pricing/data_parallel.py). Properties, never predicted numbers: the pruned search finds the front that
simulating everything finds, its bounds are lower bounds, its shared pricing equals predict's, the best layout
fits and is no slower than the preset's own, the written YAML loads, passes the runtime's layout rules and
predicts the reported time, and bad input is one line naming the flag.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import replace

import pytest

from configs import load_config, load_config_data
from costmodel.pricing.data_parallel import fewest_ep_ranks_per_node, grad_sync, reductions, ring_allreduce_us
from costmodel.physics.hardware import Link, get_hardware
from costmodel.answers.predict import predict
from costmodel.answers.tune import Tuner, options_of, tune
from costmodel.answers.tune_front import GIB, pareto
from costmodel.answers.tune_space import Candidate, candidates
from mhcpipe.cli import main

HW = get_hardware("h800")
SPACE = dict(microbatch_sizes=(1,), recompute=("off", "auto"))
REL = 1e-9


@pytest.fixture(scope="module")
def p3b():
    return load_config("paper-3b"), load_config_data("paper-3b")[0]


@pytest.fixture(scope="module")
def tuned(p3b):
    """paper-3b on 32 GPUs, 64 sequences: the preset's layout (dualpipe pp=4, EP 8) has dp=8 and fits 40 GiB."""
    cfg, data = p3b
    return tune(cfg, data, HW, 32, 40.0, 64, **SPACE)


def step_by_predict(cfg, cand: Candidate):
    """A layout's step priced the plain way: predict() of the whole config (it simulates one replica's pipeline
    of M / D micro-batches; D is the data-parallel ranks the distributed optimizer shards over), plus
    data_parallel.grad_sync."""
    pred = predict(cfg, HW, options=options_of(cand, HW), ladder=False)
    pr = pred.pricers["mhc"]
    sync = grad_sync(cfg, HW, pred.schedule, pred.mhc, pr.layout, {s: m.params for s, m in pr.stage_mem.items()})
    return pred, sync


def test_pruned_search_finds_the_exhaustive_front_and_its_bounds_hold(p3b):
    cfg, data = p3b
    budget = 20.0
    result = tune(cfg, data, HW, 8, budget, 32, **SPACE)
    assert result.counts["bounded out"] > 0 and result.counts["over the memory budget"] > 0  # both prunings ran
    tuner = Tuner(cfg, data, HW)
    every = [tuner.memory(c) for c in candidates(cfg, 8, 32, **SPACE)]
    fits = [tuner.evaluate(e) for e in every if e.memory_bytes <= budget * GIB]
    weaker = 0
    for e in fits:
        floor, cheap, exact = tuner.floor_bound(e), tuner.bound(e, exact=False), tuner.bound(e)
        assert floor <= cheap * (1 + REL) and cheap <= exact * (1 + REL), e.cand.label()
        assert exact <= e.step_us * (1 + REL), e.cand.label()
        weaker += floor < cheap * (1 - 1e-6)
    assert weaker > len(fits) / 2  # the floor prices no co-running: weaker for most layouts
    want = [(e.step_us, e.memory_bytes) for e in pareto(fits)]
    got = [(e.step_us, e.memory_bytes) for e in result.front]
    assert len(got) == len(want) > 1
    for (ts, ms), (tw, mw) in zip(got, want):
        assert ts == pytest.approx(tw, rel=REL) and ms == pytest.approx(mw, rel=REL)
    assert all(e.memory_bytes <= budget * GIB for e in result.front)
    assert all(a.step_us < b.step_us and a.memory_bytes > b.memory_bytes
               for a, b in zip(result.front, result.front[1:]))


def test_shared_pricing_and_cheap_memory_equal_predict(p3b):
    """Candidates of every schedule, hp off and an uneven split: the tuner's pipeline time and its
    simulation-free memory are predict's."""
    cfg, data = p3b
    tuner = Tuner(cfg, data, HW)
    pool = candidates(cfg, 8, 32, **SPACE)
    picks = {(c.schedule, c.hp, c.uneven): c for c in pool if c.ep > 1 and c.recompute == "auto"}
    assert {k[0] for k in picks} == {"gpipe", "1f1b", "zb1p", "dualpipe", "dualpipev"}
    assert any(not k[1] for k in picks) and any(k[2] for k in picks)
    for cand in picks.values():
        cheap = tuner.memory(cand).memory_bytes
        ev = tuner.evaluate(tuner.memory(cand))
        pred, sync = step_by_predict(tuner.config(cand), cand)
        assert ev.pipeline_us == pytest.approx(pred.mhc.makespan, rel=REL), cand.label()
        assert ev.step_us == pytest.approx(sync.end_us, rel=REL)
        # one meaning of "step": predict's own iteration is tune's step (pipeline + exposed gradient all-reduce)
        if cand.dp > 1:
            assert pred.summary["iteration_us"]["mhc"] == pytest.approx(ev.step_us, rel=REL), cand.label()
        assert cheap == pytest.approx(pred.summary["memory_gib"]["mhc"] * GIB, rel=REL)


def test_best_fits_and_is_no_slower_than_the_presets_layout(p3b, tuned):
    cfg, _ = p3b
    ref_cfg = load_config("paper-3b", {"parallel": {"data_parallel": 8, "microbatches": 64}})
    ref_cand = Candidate("dualpipe", 4, 8, 8, 1, 64, "auto")
    pred, sync = step_by_predict(ref_cfg, ref_cand)
    ref_mem = pred.summary["memory_gib"]["mhc"]
    assert ref_mem <= 40.0  # the preset's layout is in the space and fits: the property applies
    assert tuned.reference is not None and tuned.reference.cand == ref_cand
    assert tuned.reference.step_us == pytest.approx(sync.end_us, rel=REL)
    best = tuned.best
    assert best.cand.hp and best.memory_gib <= 40.0 and all(e.memory_gib <= 40.0 for e in tuned.front)
    assert best.step_us <= sync.end_us * (1 + REL)


def test_written_yaml_loads_runs_and_predicts_the_reported_time(p3b, tuned, tmp_path, capsys):
    from configs import load_config as load
    from pipeline.__main__ import add_run_arguments
    from pipeline.launch.run_args import config_from_args

    out = tmp_path / "best.yaml"
    argv = ["tune", "--preset", "paper-3b", "--hardware", "h800", "--gpus", "32", "--memory-gib", "40",
            "--global-batch", "64", "--microbatch-sizes", "1", "--recompute", "off,auto", "--splits", "even",
            "-o", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    best = tuned.best
    assert f"step {best.step_us / 1e3:,.1f} ms" in printed
    cfg = load(str(out))
    par = cfg.parallel
    k = best.cand
    assert (par.schedule, par.ranks, par.data_parallel, par.expert_parallel, par.microbatches,
            par.microbatch_size) == (k.schedule, k.pp, k.dp, k.ep, k.microbatches, k.microbatch_size)
    assert par.microbatch_size * par.microbatches == 64  # the global batch is kept
    pred, sync = step_by_predict(cfg, k)
    assert pred.mhc.makespan == pytest.approx(best.pipeline_us, rel=REL)
    assert sync.end_us == pytest.approx(best.step_us, rel=REL)
    assert pred.summary["memory_gib"]["mhc"] == pytest.approx(best.memory_gib, rel=REL)
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    runnable = config_from_args(parser.parse_args(["--config", str(out)]), par.ranks * par.data_parallel)
    assert runnable.parallel == par  # the runtime's layout rules (EP inside dp, world = pp x dp) accept it


def test_ring_allreduce_and_ep_placement():
    link = Link(name="x", bandwidth=100e9, latency_us=2.0, efficiency=0.5)
    assert ring_allreduce_us(link, 1, 1e9) == 0.0
    assert ring_allreduce_us(link, 2, 1e9) == pytest.approx(2 * 2.0 + 1e9 / 50e9 * 1e6, rel=REL)
    assert ring_allreduce_us(link, 8, 1e9) == pytest.approx(14 * 2.0 + 2 * 7 / 8 * 1e9 / 50e9 * 1e6, rel=REL)
    assert fewest_ep_ranks_per_node(2, 8, 8, 8) == 8  # every EP group fills one node
    assert fewest_ep_ranks_per_node(2, 6, 6, 8) == 2  # pipeline rank 1's group is ranks 6-11: 6,7 | 8..11
    assert fewest_ep_ranks_per_node(1, 16, 16, 8) == 8


@pytest.mark.parametrize("schedule, pp, dp, holders", [("1f1b", 4, 1, 1), ("1f1b", 4, 4, 1), ("dualpipe", 4, 1, 2),
                                                       ("dualpipe", 4, 2, 2), ("dualpipev", 2, 4, 1)])
def test_grad_sync_follows_the_runtimes_groups(p3b, schedule, pp, dp, holders):
    M = 8 * dp
    cfg = load_config("paper-3b", {"parallel": {"schedule": schedule, "ranks": pp, "data_parallel": dp,
                                                "microbatches": M, "expert_parallel": 1}})
    cand = Candidate(schedule, pp, dp, 1, 1, M, "auto")
    pred, sync = step_by_predict(cfg, cand)
    pr = pred.pricers["mhc"]
    reds = reductions(cfg, HW, pred.schedule, pr.layout, {s: m.params for s, m in pr.stage_mem.items()})
    chunks = len(pred.schedule.pipelines[0])
    if dp * holders == 1:
        assert not reds and not sync.buckets and sync.exposed_us == 0.0
        return
    # EP 1: the experts' group (their own bucket, as the runtime makes it) spans the same dp x holders ranks
    assert {r.chunk for r in reds} == set(range(chunks))
    assert all(r.k == dp * holders and len(r.ranks) == holders for r in reds)
    total = sum(pr.stage_mem[s].params for s in range(pred.schedule.num_stages)) * 4 / holders
    assert sum(r.nbytes for r in reds) == pytest.approx(total, rel=REL)  # every parameter reduced once
    for b in sync.buckets:
        assert b.start >= b.posted and b.end > b.start
    assert sync.exposed_us > 0.0  # the last chunk's reduction starts at its rank's last action
    assert sync.end_us == pytest.approx(max(b.end for b in sync.buckets), rel=REL)


@pytest.mark.parametrize("argv, starts", [
    (["--preset", "paper-27b", "--gpus", "48", "--memory-gib", "10", "--global-batch", "1280"],
     "--memory-gib 10: no layout fits; the smallest needs "),
    (["--preset", "paper-27b", "--gpus", "48", "--global-batch", "7"], "--global-batch 7: "),
    (["--preset", "paper-27b", "--gpus", "97", "--global-batch", "1280"], "--gpus 97: "),
    (["--preset", "paper-27b", "--gpus", "0"], "--gpus 0: must be >= 1"),
    (["--preset", "nope", "--gpus", "8"], "--preset nope: unknown preset"),
    (["--preset", "tiny", "--gpus", "4", "--recompute", "some"], "--recompute 'some': "),
    (["--preset", "tiny", "--gpus", "4", "-o", "best.txt"], "-o/--output 'best.txt': "),
])
def test_bad_input_is_one_line_naming_the_flag(argv, starts, capsys):
    assert main(["tune", "--hardware", "h800", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"mhcpipe tune: error: {starts}"), err
    if "smallest needs" in err:
        gib = float(err.split("smallest needs ")[1].split(" GiB")[0])
        assert 10 < gib < math.inf
    if "--gpus 97" in starts:
        assert "96" in err  # what would fit


def test_balanced_splits_are_searched_priced_as_predict_and_written(p3b, tuned, tmp_path, capsys):
    """`--splits even,balanced` (the CLI's default): the search over both cuts is never slower than over the even
    one; a balanced candidate's price is predict's for the config it writes (parallel.stage_split = its cut)."""
    cfg, data = p3b
    both = tune(cfg, data, HW, 32, 40.0, 64, splits=("even", "balanced"), **SPACE)
    assert both.best.step_us <= tuned.best.step_us * (1 + REL)
    assert any(e.cand.split == "balanced" for e in both.front)
    tuner = Tuner(cfg, data, HW)
    for cand in [c for c in candidates(cfg, 32, 64, splits=("balanced",), **SPACE)
                 if c.recompute == "auto" and c.hp][:4]:
        ev = tuner.evaluate(tuner.memory(cand))
        written = tuner.config(cand)
        assert written.parallel.stage_split is not None and sum(written.parallel.stage_split) == cfg.model.num_blocks
        pred, sync = step_by_predict(written, replace(cand, split="even"))  # the written cut, no re-cut
        assert sync.end_us == pytest.approx(ev.step_us, rel=REL), cand.label()
        assert pred.summary["memory_gib"]["mhc"] * GIB == pytest.approx(ev.memory_bytes, rel=REL)
    out = tmp_path / "best.yaml"
    assert main(["tune", "--preset", "paper-3b", "--hardware", "h800", "--gpus", "32", "--memory-gib", "40",
                 "--global-batch", "64", "--microbatch-sizes", "1", "--recompute", "off,auto", "-o", str(out)]) == 0
    assert f"step {both.best.step_us / 1e3:,.1f} ms" in capsys.readouterr().out


@pytest.mark.parametrize("gpus_per_node", [8, 3])
def test_allreduce_links_are_the_nodes_their_members_span(gpus_per_node):
    """A group's link is intra-node exactly when one node holds every member: checked against the members' node
    set for dense and per-expert-rank groups on layouts whose groups straddle nodes (3 GPUs per node)."""
    from costmodel.answers.predict import residual_spec_of
    from costmodel.pricing.options import Options
    from costmodel.pricing.pricer import Pricer
    from costmodel.pricing.stage_split import resolve_layout
    from schedules.build import build

    hw = HW.model_copy(update={"gpus_per_node": gpus_per_node})
    seen = set()
    for schedule, pp in (("dualpipe", 4), ("1f1b", 3)):
        for dp, ep in ((2, 1), (2, 2), (4, 2), (6, 3), (8, 4), (8, 8)):
            cfg = load_config("paper-27b", {"parallel": {"schedule": schedule, "ranks": pp, "data_parallel": dp,
                                                         "microbatches": 8 * dp, "expert_parallel": ep}})
            s = build(schedule, pp, 8)
            layout = resolve_layout(cfg, s, True)
            pr = Pricer(cfg, hw, residual_spec_of(cfg), layout, Options())
            reds = reductions(cfg, hw, s, layout, {st: m.params for st, m in pr.stage_mem.items()})
            assert reds
            for red in reds:
                if red.group == "dense":
                    groups = [[p * dp + d for p in red.ranks for d in range(dp)]]
                else:
                    groups = [[p * dp + b * ep + e for p in red.ranks for b in range(dp // ep)] for e in range(ep)]
                links = [hw.intra if len({r // gpus_per_node for r in g}) == 1 else hw.inter for g in groups]
                want = min(links, key=lambda lk: lk.bandwidth * lk.efficiency)
                assert red.link is want, (schedule, pp, dp, ep, red)
                seen.add((red.group, want.name))
    assert len(seen) == 4  # dense and expert groups, each on both kinds of link


def test_shared_prices_keep_apart_layouts_whose_messages_take_another_share_of_the_nic():
    """DeepSeek-V3's stage-boundary messages share the NIC with its all-to-alls (Pricer.nic_bytes follows the
    layout): 1F1B PP16 cut by cost and DualPipeV PP16 cut evenly end in a last stage of the same blocks but not the
    same share, so it must not share prices (before the share was in SharedPricer's key, whichever was priced first
    set both: `tune --preset deepseek-v3` reported a zb1p PP32 layout 3.8% faster than predict prices it)."""
    from costmodel.pricing.pricer import Pricer
    from schedules.ir import Action, Kind

    cfg, data = load_config("deepseek-v3"), load_config_data("deepseek-v3")[0]
    tuner = Tuner(cfg, data, HW)
    pool = candidates(cfg, 2048, 15360, schedules=("1f1b", "dualpipev"), microbatch_sizes=(1,), recompute=("4",),
                      hp=(True,), splits=("even", "balanced"), distributed_optimizer=(True,))
    picks = [c for c in pool if c.ep == 64 and c.pp == 16
             and (c.schedule, c.split) in (("1f1b", "balanced"), ("dualpipev", "even"))]
    assert [c.schedule for c in picks] == ["1f1b", "dualpipev"]
    pricers = [tuner._prep(c) for c in picks]  # the 1F1B layout's pricer first: it prices the shared key first
    last = [max(layout) for _, layout, _ in pricers]
    assert pricers[0][2].stage_key[last[0]] == pricers[1][2].stage_key[last[1]]  # the case this is about
    assert pricers[0][2].nic_bytes != pricers[1][2].nic_bytes
    for (_, layout, pr), st in zip(pricers, last):
        fresh = Pricer(pr.cfg, HW, pr.spec, layout, pr.opt)
        for kind in (Kind.F, Kind.B, Kind.I, Kind.W):
            got, want = pr.compute_time(Action(kind, st, 0)), fresh.compute_time(Action(kind, st, 0))
            assert got == want, (pr.cfg.parallel.schedule, kind)


def test_every_front_layout_of_a_v3_search_is_priced_as_predict_prices_its_written_config():
    """The whole search as `mhcpipe tune --preset deepseek-v3 --gpus 2048` runs it (every schedule, b, recompute
    choice, stream, split and optimizer sharding): each Pareto layout's pipeline is predict's on the config tune
    writes for it, to the last bit (shared prices, cached cuts and reused pricers change nothing)."""
    cfg, data = load_config("deepseek-v3"), load_config_data("deepseek-v3")[0]
    space = dict(schedules=("gpipe", "1f1b", "zb1p", "dualpipe", "dualpipev"), microbatch_sizes=(1, 2, 4),
                 recompute=("off", "auto", "1", "2", "4", "8"), hp=(True, False), allow_uneven=True,
                 splits=("even", "balanced"), distributed_optimizer=(False, True))
    result = tune(cfg, data, HW, 2048, 80, 15360, **space)
    assert len(result.front) > 3
    for ev in result.front:
        pred = predict(result.tuner.config(ev.cand), HW, ladder=False)
        assert ev.pipeline_us == pred.mhc.makespan, ev.cand.label()


def test_layouts_share_a_simulation_only_when_the_engine_reads_the_same_prices(p3b):
    """Tuner.evaluate reuses a simulation for layouts whose prices are the same (an hp twin of a schedule without
    F&B pairs, a distributed-optimizer twin): every layout of a pool evaluated through one tuner equals the same
    layout evaluated alone, and the pool holds both twins whose prices differ and twins that share a run."""
    cfg, data = p3b
    pool = [c for c in candidates(cfg, 8, 32, schedules=("1f1b", "zb1p", "dualpipev"), microbatch_sizes=(1,),
                                  recompute=("off", "auto"), hp=(True, False), distributed_optimizer=(False, True))
            if c.ep > 1]
    shared = Tuner(cfg, data, HW)
    got = {c: shared.evaluate(shared.memory(c)) for c in pool}
    assert len(shared._sims) < len(pool)  # some layouts did share a run
    differ = 0
    for c, ev in got.items():
        alone = Tuner(cfg, data, HW)
        want = alone.evaluate(alone.memory(c))
        assert (ev.pipeline_us, ev.step_us, ev.memory_bytes) == (want.pipeline_us, want.step_us, want.memory_bytes), \
            c.label()
        twin = replace(c, hp=not c.hp)
        differ += c.schedule != "dualpipev" and twin in got and got[twin].pipeline_us != ev.pipeline_us
    assert differ  # an hp twin without pairs that prices differently: a key without the prices would fail


def test_shared_stage_memory_is_each_stages_own():
    """shared_stage_memories keys a stage's memory on what it holds (its dense and MoE blocks, first or last), not
    on where it sits: one table filled by layouts that cut DeepSeek-V3's 61 blocks (the first 3 dense) differently
    gives every stage what memory.stage_memory computes for it alone."""
    from costmodel.answers.predict import residual_spec_of
    from costmodel.physics.memory import stage_memory
    from costmodel.pricing.shared_pricer import shared_stage_memories

    cfg = load_config("deepseek-v3")
    spec = residual_spec_of(cfg)
    shared: dict = {}
    for sizes in ([1, 2, 2, 56], [2, 2, 2, 55], [4, 2, 2, 53], [57, 2, 2]):  # middle stages dense, mixed, MoE
        edges = [0]
        for n in sizes:
            edges.append(edges[-1] + n)
        layout = {st: (range(edges[st], edges[st + 1]), st == 0, st == len(sizes) - 1) for st in range(len(sizes))}
        for recompute in (True, False):
            got = shared_stage_memories(shared, cfg, spec, layout, recompute)
            for st, (blocks, first, last) in layout.items():
                assert got[st] == stage_memory(cfg, spec, st, blocks, first, last, recompute), (sizes, st)
