"""check-split on the tests' rank processes: the hyper-connections example agrees with its unsplit self under every
schedule and layout, and each stage-boundary bug that other pipelines shipped, injected here into a rank, is
caught and named by stage and micro-batch (pipeline.launch.check_split).

A bug is injected by a worker that patches the runtime inside the rank processes and then runs check-split's own
worker; the unsplit reference in this process is untouched."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rank_pool import launch

from configs import load_config
from pipeline.launch.check_split import run_cases, split_worker
from schedules.registry import names
from pipeline.user_model import ContractError

ROOT = Path(__file__).resolve().parents[2]
HC = f"{ROOT}/examples/hc_model.py:build"


def cases(schedules, layouts):
    return [(s, pp, dp) for pp, dp in layouts for s in schedules]


def check(spec=HC, case_list=(("1f1b", 4, 1),), **kw):
    return run_cases(spec, load_config("tiny"), list(case_list), launcher=launch, timeout_s=240, **kw)


def test_the_hyper_connections_example_agrees_with_one_process_under_every_schedule_and_layout():
    results = check(case_list=cases(names(), [(4, 1), (2, 2)]))
    assert [r.line() for r in results if not r.ok] == []
    assert len(results) == 10
    assert max(r.worst for r in results) < 1e-12  # same kernels on the same micro-batches: only summation order
    assert len({round(r.loss, 12) for r in results}) == 1


def test_under_emulated_cuda_every_case_agrees_and_replays_ok_and_a_hang_is_a_failed_case(monkeypatch):
    """--emulate-cuda: the user's blocks on the runtime's CUDA path (phased F&B pairs with fixed turns, end
    streams), the same numbers, and each case's programs replayed ok; a case whose replay finds a cycle fails with
    it (here: the replay made to report one)."""
    import pipeline.launch.check_split as cs

    results = check(case_list=cases(["1f1b", "dualpipev"], [(4, 1), (2, 2)]), emulate_cuda=True)
    assert [r.line() for r in results if not r.ok] == [] and len(results) == 4
    monkeypatch.setattr(cs, "_cuda_replay", lambda folder: "CUDA replay: deadlock: 4 ranks; rank 0 ...")
    bad = check(case_list=[("1f1b", 4, 1)], emulate_cuda=True)
    assert not bad[0].ok and bad[0].message.startswith("CUDA replay: deadlock")


def test_a_plain_transformer_wrapped_in_our_mhc_agrees_too():
    results = check(f"{ROOT}/examples/plain_transformer.py:build", cases(["dualpipev", "zb1p"], [(4, 1)]),
                    residual="mhc:4")
    results += check(f"{ROOT}/examples/hc_model.py:build_ours", [("dualpipe", 2, 2)])  # the example's branches
    assert all(r.ok for r in results), [r.line() for r in results]


# -- injected boundary bugs -------------------------------------------------------------------------------------
def _patched(attr_owner, name, replacement, rank, world, *args):
    original = getattr(attr_owner, name)
    setattr(attr_owner, name, replacement(original))
    try:
        return split_worker(rank, world, *args)
    finally:
        setattr(attr_owner, name, original)


def expand_every_stage(rank, world, *args):
    """A split that runs the stream entry again on every stage's input (as if it were the hidden state)."""
    from pipeline.runtime.user_stage import UserStage

    def wrap(orig):
        def forward_steps(self, run, inp, labels, env):
            if not self.spec.has_embed:
                inp = self.model.expand(inp[:, 0])
            return orig(self, run, inp, labels, env)
        return forward_steps
    return _patched(UserStage, "forward_steps", wrap, rank, world, *args)


def drop_head_reduction(rank, world, *args):
    """The last stage keeps the head's projection but its stream reduction sees stream 0 only."""
    from pipeline.user_model import UserModel

    def wrap(orig):
        def micro_loss(self, x, labels, microbatches):
            return orig(self, x[:, :1].expand_as(x), labels, microbatches)
        return micro_loss
    return _patched(UserModel, "micro_loss", wrap, rank, world, *args)


def ids_from_hidden_states(rank, world, *args):
    """Later stages 'recover' the token ids from the hidden state instead of receiving the real ones."""
    from pipeline.runtime.user_stage import UserStage

    def wrap(orig):
        def forward_steps(self, run, inp, labels, env):
            if not self.spec.has_embed:
                run.ids = inp[:, 0].argmax(-1)
            return orig(self, run, inp, labels, env)
        return forward_steps
    return _patched(UserStage, "forward_steps", wrap, rank, world, *args)


def swap_two_messages(rank, world, *args):
    """Our runtime, mutated: the sender posts the first two forward activations of a channel in swapped order."""
    from pipeline.runtime.executor import Executor

    def wrap(orig):
        def __init__(self, *a, **kw):
            orig(self, *a, **kw)
            for order in self.send_order.values():
                fwd = [i for i, key in enumerate(order) if key[0].value == "SEND_F"]
                if len(fwd) >= 2:
                    order[fwd[0]], order[fwd[1]] = order[fwd[1]], order[fwd[0]]
        return __init__
    return _patched(Executor, "__init__", wrap, rank, world, *args)


def test_streams_expanded_on_every_stage_are_caught_at_the_second_stage():
    """Nearly invisible at initialisation (the copies of one token are still almost equal: the input moves by
    ~4e-8, the loss by ~1e-9), but some gradients move by O(1); the first difference in data-flow order is the
    second stage's input. Stages by parameter count: the hash-routed block 7 (4 experts) is a stage alone."""
    (r,) = check(worker=expand_every_stage)
    assert not r.ok
    assert r.message.startswith("stage 1 (rank 1, blocks 3-5) micro-batch 0: the state it received differs from the "
                                "unsplit model's state after block 2 (relative error"), r.message


def test_a_dropped_head_reduction_is_caught_at_the_last_stage():
    (r,) = check(worker=drop_head_reduction)
    assert not r.ok
    # the streams are nearly equal at initialisation, so the loss moves below the tolerance; the gradient the head's
    # stage sends back does not (each stream's share of it now goes to stream 0)
    assert r.message.startswith("stage 3 (rank 3, block 7) micro-batch 0: the gradient it sends back differs from "
                                "the unsplit model's gradient of the state after block 6"), r.message


def test_token_ids_taken_from_hidden_states_are_caught_where_the_hash_routed_block_runs():
    (r,) = check(worker=ids_from_hidden_states)
    assert not r.ok
    # block 7 routes by token id: stage 3 is the first whose numbers move; stages 1 and 2 (no such block) agree
    assert r.message.startswith("stage 3 (rank 3, block 7) micro-batch 0: its loss differs"), r.message


def test_two_swapped_messages_at_pp2_are_wrong_numbers_on_gloo_and_a_named_mismatch_under_nccl_rules():
    (r,) = check(case_list=[("1f1b", 2, 1)], worker=swap_two_messages, rules="backend")
    assert not r.ok
    assert r.message.startswith("stage 1 (rank 1, blocks 5-7) micro-batch 0: the state it received differs"), \
        r.message
    # under NCCL's rules (the strict transport) the sender sees the mismatch at once, the receiver at its deadline
    (r,) = check(case_list=[("1f1b", 2, 1)], worker=swap_two_messages, p2p_timeout_s=5)
    assert not r.ok
    assert "NCCL order mismatch on p2p:0>1: its next send to rank 1 is F/s0/mb1" in r.message, r.message
    assert "but rank 1's next receive from it is F/s0/mb0" in r.message, r.message


def test_a_block_returning_one_stream_stops_before_any_rank_starts(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text(f"""
import sys
sys.path.insert(0, {str(ROOT / 'examples')!r})
from torch import nn
from hc_model import build as build_hc


class OneStream(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return self.block(x).sum(1)  # [T, C]: the streams summed away inside a block


def build(seq_len: int = 32):
    model = build_hc(seq_len)
    model.blocks[3] = OneStream(model.blocks[3])
    return model
""")
    with pytest.raises(ContractError) as err:
        check(f"{broken}:build")
    # found by one sequence through every piece (32 tokens) before the unsplit run and before any rank starts
    assert str(err.value) == ("block 3 (OneStream) returned shape [32, 64]; a block maps [T, n, C] -> [T, n, C] = "
                              "[32, 4, 64] (return all n=4 streams)")


def test_the_probe_sees_every_boundary_of_every_micro_batch():
    """What the comparison reads: for 1F1B on 4 ranks, M=8, every stage but the first received 8 states and sent 8
    gradients, every stage but the last sent 8 states, the last computed 8 losses."""
    from pipeline.launch.check_split import case_config
    cfg = case_config(load_config("tiny"), "1f1b", 4, 1)
    got = launch(split_worker, 4, (HC, None, [cfg.model_dump()]), timeout_s=240)
    assert all(r.exitcode == 0 for r in got), [r.error for r in got]
    seen = {}
    for r in got:
        for what, stage, g, t in r.value[0]["records"]:
            seen.setdefault((what, stage), set()).add(g)
            assert torch.isfinite(t).all()
    want = {("in", s) for s in (1, 2, 3)} | {("grad_in", s) for s in (1, 2, 3)} | \
        {("out", s) for s in (0, 1, 2)} | {("grad_out", s) for s in (0, 1, 2)} | {("loss", 3)}
    assert set(seen) == want
    assert all(gs == set(range(8)) for gs in seen.values())


def test_phased_blocks_with_tuple_states_agree_under_every_schedule():
    """Phases that hand a tuple on (state, integer routing, a plain value): the F&B pairs interleave at them and the
    gradients still equal one process's."""
    results = check(f"{ROOT}/tests/pipeline/phased_model.py:build", cases(names(), [(4, 1), (2, 2)]))
    assert [r.line() for r in results if not r.ok] == []
    assert max(r.worst for r in results) < 1e-12


def test_phased_pairs_also_agree_on_plain_gloo():
    """Plain gloo (no strict transport): a pair that hands the turn over while a receive is in flight must see the
    receive complete (the runtime watches P2P completion for phased user models, as for expert parallelism)."""
    results = check(f"{ROOT}/tests/pipeline/phased_model.py:build", cases(["dualpipev", "dualpipe"], [(4, 1)]),
                    rules="backend", p2p_timeout_s=20)
    assert [r.line() for r in results if not r.ok] == []


def test_stages_balanced_by_measured_block_times_agree_and_every_rank_cuts_at_the_same_blocks():
    from pipeline.launch.check_split import case_config

    results = check(f"{ROOT}/tests/pipeline/phased_model.py:build_measured", cases(["dualpipev", "1f1b"], [(4, 1)]))
    assert [r.line() for r in results if not r.ok] == []
    cfg = case_config(load_config("tiny"), "1f1b", 4, 1)
    got = launch(split_worker, 4, (f"{ROOT}/tests/pipeline/phased_model.py:build_measured", None, [cfg.model_dump()]),
                 timeout_s=240)
    assert all(r.exitcode == 0 for r in got), [r.error for r in got]
    plans = [r.value[0]["stages"] for r in got]
    assert all(p == plans[0] for p in plans)  # one partition, whatever each rank would have measured
    blocks = sorted((first, last) for first, last, _ in plans[0].values())
    # the two slow blocks are cut apart, the first alone (by parameter count every stage would hold two blocks:
    # (0, 1) first); how many fast blocks join the second depends on how slow the host measured it, so not asserted
    assert blocks[0] == (0, 0) and blocks[1][0] == 1 and blocks[-1][1] == 7 and len(blocks) == 4, blocks


SIX = '''import sys
sys.path.insert(0, {examples!r})
import hc_model


def build(seq_len: int = 32):
    blocks, hc_model.BLOCKS = hc_model.BLOCKS, 6  # the rank processes are reused: leave the module as it was
    try:
        return hc_model.build(seq_len)
    finally:
        hc_model.BLOCKS = blocks
'''


def test_a_six_block_model_runs_every_case_it_can_fill_and_skips_the_others_in_one_line(tmp_path):
    """Each case is validated under its own schedule and layout: DualPipeV on 4 ranks needs 8 stages, which 6 blocks
    cannot fill (skipped, one line); every other case runs and agrees. A request no case of which fits is one line,
    exit 2."""
    spec = tmp_path / "six.py"
    spec.write_text(SIX.format(examples=str(ROOT / "examples")))
    results = check(f"{spec}:build", cases(names(), [(4, 1)]))
    lines = {r.schedule: r for r in results}
    assert lines["dualpipev"].skipped and lines["dualpipev"].line().endswith("skipped: 6 blocks cannot fill 8 stages")
    assert all(r.ok for s, r in lines.items() if s != "dualpipev"), [r.line() for r in results]
    from _pipeline_helpers import mhcpipe_in_process

    none = mhcpipe_in_process("check-split", f"{spec}:build", "--schedule", "dualpipev", "--layouts", "pp4")
    assert none.returncode == 2, none.stdout + none.stderr
    assert "no case can run this model" in none.stderr and "6 blocks cannot fill 8 stages" in none.stderr
    assert "Traceback" not in none.stderr and len(none.stderr.strip().splitlines()) == 1


def no_tie_sum(rank, world, *args):
    """A runtime that lets each holder of a tied parameter train its own copy (no sum over the holders)."""
    import pipeline.runtime.train as train_mod

    return _patched(train_mod, "join_tie_groups", lambda orig: (lambda *a: []), rank, world, *args)


def test_a_tied_model_agrees_on_every_case_and_a_missing_sum_over_the_holders_is_named():
    """examples/tied_model.py: the output projection is the embedding's parameter (first and last stage; both on
    DualPipe's and DualPipeV's end ranks). Every case agrees; without the sum the first wrong gradient is the tied
    parameter's, named as the unsplit model names it."""
    tied = f"{ROOT}/examples/tied_model.py:build"
    results = check(tied, cases(names(), [(4, 1), (2, 2)]))
    assert [r.line() for r in results if not r.ok] == [] and len(results) == 10
    (bad,) = check(tied, worker=no_tie_sum)
    assert not bad.ok and bad.message.startswith("parameter embed.weight"), bad.line()


META_TIED = '''import sys
sys.path.insert(0, {examples!r})
import plain_transformer


def build(residual: str = "mhc:4", seq_len: int = 32):
    model = plain_transformer.build_meta(residual, seq_len)
    model.head.inner.out.weight = model.embed.weight
    return model
'''


def test_a_model_built_on_the_meta_device_and_tied_agrees_each_rank_holding_only_its_pieces(tmp_path):
    """Built on meta, each rank materialises its own pieces (pipeline.user_materialise) to the values of the whole
    model materialised at once (the unsplit reference), the tied projection on the last stage included."""
    from pipeline.launch.check_split import case_config

    spec = tmp_path / "meta_tied.py"
    spec.write_text(META_TIED.format(examples=str(ROOT / "examples")))
    results = check(f"{spec}:build", cases(["1f1b", "dualpipe", "dualpipev"], [(4, 1), (2, 2)]))
    assert [r.line() for r in results if not r.ok] == [] and len(results) == 6
    cfg = case_config(load_config("tiny"), "1f1b", 4, 1)
    got = launch(split_worker, 4, (f"{spec}:build", None, [cfg.model_dump()]), timeout_s=240)
    held = [sorted({n.split(".")[0] + ("." + n.split(".")[1] if n.startswith("blocks") else "")
                    for n in r.value[0]["grads"]}) for r in got]
    assert held == [["blocks.0", "blocks.1", "embed"], ["blocks.2", "blocks.3"], ["blocks.4", "blocks.5"],
                    ["blocks.6", "blocks.7", "embed", "head"]], held  # the tie by its first holder's name


def test_bf16_and_stage_aligned_recompute_of_a_user_model_agree_with_the_unsplit_model_in_bf16():
    """bf16: autocast around every piece, fp32 parameters, the stream state between blocks in bf16 (what crosses a
    stage boundary is bf16); recompute 'auto': each stage's blocks rerun as one unit in its backward. Compared with
    the unsplit model in bf16, norm-wise (the same kernels on the same micro-batches: only fp32 gradient sums
    differ in order)."""
    from pipeline.launch.check_split import BF16_RTOL, case_config

    plain = f"{ROOT}/examples/plain_transformer.py:build"
    results = check(plain, cases(["zb1p", "dualpipev"], [(4, 1), (2, 2)]), residual="mhc:4", dtype="bfloat16",
                    recompute="auto", rtol=BF16_RTOL)
    assert [r.line() for r in results if not r.ok] == [] and len(results) == 4
    assert max(r.worst for r in results) < 1e-5
    cfg = case_config(load_config("tiny"), "1f1b", 2, 1, dtype="bfloat16")
    got = launch(split_worker, 2, (plain, "mhc:4", [cfg.model_dump()]), timeout_s=240)
    sent = [t for r in got for what, _, _, t in r.value[0]["records"] if what == "out"]
    assert sent and all(t.dtype == torch.bfloat16 for t in sent)
    assert all(g.dtype == torch.float32 for r in got for g in r.value[0]["grads"].values())  # fp32 parameters


def counting_recompute(rank, world, spec, residual, cfg_dict):
    """Block forwards run per step and the counted activation peak, for the config given."""
    import pipeline.user_model as um
    from configs import parse_config
    from pipeline.launch.user_config import build_model, load_builder, user_config
    from pipeline.runtime.train import RankRuntime, make_groups

    calls = {"n": 0}
    original = um.UserModel.run_block

    def counted(self, b, x, ids):
        calls["n"] += 1
        return original(self, b, x, ids)

    um.UserModel.run_block = counted
    try:
        cfg = parse_config(cfg_dict)
        model = build_model(load_builder(spec), cfg.train.seed, residual, cfg.parallel.seq_len)
        cfg = user_config(cfg, model)
        rt = RankRuntime(cfg, rank, torch.device("cpu"), groups=make_groups(cfg, rank, world, torch.device("cpu")),
                         record=False, count_activations=True, model=model)
        stats = rt.step(0)
        blocks = sum(len(sp.blocks) for sp in rt.plan.local())
        rt.close()
    finally:
        um.UserModel.run_block = original
    return {"calls": calls["n"], "blocks": blocks, "act": stats.peak_act_bytes, "loss": stats.loss}


def test_recompute_reruns_each_stage_s_blocks_once_in_its_backward_and_keeps_fewer_activations():
    """GPipe holds all 8 micro-batches' activations before its first backward; with the stage's blocks as one
    recompute unit it holds their inputs and, while one backward runs, that unit's rerun."""
    from pipeline.launch.check_split import case_config

    plain = f"{ROOT}/examples/plain_transformer.py:build"
    out = {}
    for mode in ("off", "auto"):
        cfg = case_config(load_config("tiny"), "gpipe", 2, 1, recompute=mode)
        got = launch(counting_recompute, 2, (plain, "mhc:4", cfg.model_dump()), timeout_s=240)
        assert all(r.exitcode == 0 for r in got), [r.error for r in got]
        out[mode] = [r.value for r in got]
    m = load_config("tiny").parallel.microbatches
    for off, auto in zip(out["off"], out["auto"]):
        assert off["calls"] == off["blocks"] * m and auto["calls"] == 2 * auto["blocks"] * m
    assert out["auto"][0]["loss"] == out["off"][0]["loss"]
    assert out["auto"][0]["act"] < 0.25 * out["off"][0]["act"], (out["auto"][0]["act"], out["off"][0]["act"])


def drop_second_tensor(rank, world, *args):
    """A boundary that carries the streams only: the deferred term arrives as zeros."""
    from pipeline.runtime.boundary import BoundaryLayout

    def wrap(orig):
        def pack(self, state):
            return orig(self, (state[0], *(None for _ in state[1:])))
        return pack

    return _patched(BoundaryLayout, "pack", wrap, rank, world, *args)


def test_a_v4_style_state_of_two_tensors_agrees_everywhere_and_a_dropped_part_is_named():
    """examples/v4_style_model.py carries (streams, deferred fp32 term) between blocks: both cross every stage
    boundary as one message; every schedule x {pp4, pp2xdp2} agrees; a boundary that sends only the streams is
    named at the first stage that receives it, with the part."""
    v4 = f"{ROOT}/examples/v4_style_model.py:build"
    results = check(v4, cases(names(), [(4, 1), (2, 2)]))
    assert [r.line() for r in results if not r.ok] == [] and len(results) == 10
    (bad,) = check(v4, worker=drop_second_tensor)
    assert not bad.ok and bad.message.startswith("stage 1 (rank 1, blocks 2-3) micro-batch 0: the state it received "
                                                 "differs from the unsplit model's state after block 1 (part "
                                                 "'deferred')"), bad.line()
