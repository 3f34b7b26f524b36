"""Memory as Megatron-LM counts it (costmodel/physics/memory.py): model states against an independent implementation of
Megatron's weight-and-optimizer formula (megatron/training/theoretical_memory_usage.py: 18 bytes per parameter,
6 + 12/d with the distributed optimizer), what the distributed optimizer saves, the GPU reserve, `tune` under
both optimizer choices and its ties (costmodel/answers/tune.py TIE_PCT).
"""
from __future__ import annotations

import dataclasses
import json

import pytest

from configs import CONFIG_DIR, load_config, load_config_data, stage_blocks
from costmodel.physics import memory as M
from costmodel.pricing.data_parallel import GradSync
from costmodel.physics.hardware import get_hardware
from costmodel.answers.predict import predict
from costmodel.answers.tune import Tuner, tune
from costmodel.answers.tune_front import TIE_PCT, Evaluated, ties_of
from costmodel.answers.tune_space import Candidate, candidates
from mhcpipe.cli import main
from schedules.build import build

HW = get_hardware("h800")
REL = 1e-9


def megatron_block_params(cfg, block: int, ep: int) -> tuple[float, float]:
    """(dense, routed-expert) parameters of one block on one rank, Megatron's terms: attention 2C^2 (1 + g/a) q/C
    (= 4Cq without GQA), SwiGLU MLP 2C (3/2 F), two RMSNorms 2C; MoE: 2C (3/2 F_e E) routed (split over EP here)
    and 2C (3/2 F_shared) shared."""
    m = cfg.model
    C, q = m.hidden, m.num_heads * m.head_dim
    attn = 2 * C * C * 2 * q / C
    a = m.mla
    if a is not None:  # Megatron's multi-latent-attention term: the q and kv latents with their norms, the
        h = m.num_heads  # up-projections, the shared rotary key, the output projection
        q_term = a.q_lora_rank * (C + h * (a.qk_nope_head_dim + a.qk_rope_head_dim) + 1)
        kv_term = a.kv_lora_rank * (C + h * (a.qk_nope_head_dim + a.v_head_dim) + 1)
        attn = q_term + kv_term + C * a.qk_rope_head_dim + a.v_head_dim * h * C
    norms = 2 * C
    if m.moe is None or block < m.moe.first_dense_blocks:
        return attn + norms + 2 * C * 1.5 * m.mlp_hidden, 0.0
    e = m.moe
    shared = 2 * C * 1.5 * e.expert_hidden * e.num_shared
    return attn + norms + shared, 2 * C * 1.5 * e.expert_hidden * e.num_experts / ep


def megatron_state_bytes(cfg, dp: int, distributed: bool) -> list[float]:
    """Megatron's weight-and-optimizer bytes per pipeline rank of `cfg`'s layout (DualPipe: both copies of its
    two stages); embedding on the first stage of a pipeline, final norm + untied head on the last; 18 bytes per
    parameter, or 6 + 12/d, d = D for the dense part and D / EP for the routed experts (the expert-data-parallel
    group; Megatron's own formula has one d and no EP)."""
    p, m = cfg.parallel, cfg.model
    ep = p.expert_parallel
    s = build(p.schedule, p.ranks, p.microbatches_per_replica)
    per_stage = {}
    for chain in s.pipelines:
        for pos, (st, blocks) in enumerate(zip(chain, stage_blocks(m.num_blocks, len(chain)))):
            dense = experts = 0.0
            for b in blocks:
                d, e = megatron_block_params(cfg, b, ep)
                dense, experts = dense + d, experts + e
            if pos == 0:
                dense += m.vocab_size * m.hidden
            if pos == len(chain) - 1:
                dense += m.vocab_size * m.hidden + m.hidden
                for _ in range(m.mtp_depth):  # Megatron's MTP block: a layer, the 2C -> C projection, two norms
                    d, e = megatron_block_params(cfg, m.num_blocks, ep)
                    dense, experts = dense + d + 2 * m.hidden * m.hidden + 2 * m.hidden, experts + e
            per_stage[st] = (dense, experts)

    def per_param(d: int) -> float:
        return 6 + 12 / max(1, d) if distributed else 18

    out = []
    for r in range(s.num_ranks):
        dense = sum(per_stage[st][0] for st in s.stages_of(r))
        experts = sum(per_stage[st][1] for st in s.stages_of(r))
        out.append(per_param(dp) * dense + per_param(dp // ep) * experts)
    return out


@pytest.mark.parametrize("distributed", [False, True])
@pytest.mark.parametrize("preset", ["paper-27b", "deepseek-v3"])
def test_model_states_match_megatrons_formula(preset, distributed):
    if not (CONFIG_DIR / f"{preset}.yaml").exists():
        pytest.skip(f"configs/{preset}.yaml is not there (yet)")
    base = load_config(preset)
    p = base.parallel
    ep = p.expert_parallel
    dp = 2 * ep  # expert-DP 2: both divisors at work
    M_ = dp * p.microbatches_per_replica
    cfg = load_config(preset, {"parallel": {"data_parallel": dp, "microbatches": M_},
                               "train": {"distributed_optimizer": distributed}})
    if cfg.train.dtype != "bfloat16":
        pytest.skip("Megatron's 18 / 6 + 12/d row is bf16 parameters with fp32 gradients")
    pred = predict(cfg, HW, ladder=False)
    want = megatron_state_bytes(cfg, dp, distributed)
    got = [r.model_state_bytes for r in pred.memory["mhc"]]
    assert len(got) == len(want)
    for r, (g, w) in enumerate(zip(got, want)):
        # ours also counts the router (C x E per MoE block) and the mHC coefficients: a little above Megatron's
        assert g == pytest.approx(w, rel=0.03), (preset, distributed, r)
        assert g >= w


def test_distributed_optimizer_saves_12_bytes_times_1_minus_1_over_dp():
    dp = 16
    over = {"parallel": {"data_parallel": dp, "microbatches": dp * 12, "expert_parallel": 1}}
    on = load_config("paper-27b", {**over, "train": {"distributed_optimizer": True}})
    off = load_config("paper-27b", {**over, "train": {"distributed_optimizer": False}})
    p_on, p_off = predict(on, HW, ladder=False), predict(off, HW, ladder=False)
    pr = p_off.pricers["mhc"]
    for r_on, r_off in zip(p_on.memory["mhc"], p_off.memory["mhc"]):
        params = sum(pr.stage_mem[s].params for s in p_off.schedule.stages_of(r_off.rank))
        assert r_off.model_state_bytes == pytest.approx(18 * params, rel=REL)
        assert r_off.model_state_bytes - r_on.model_state_bytes == pytest.approx(12 * (1 - 1 / dp) * params, rel=REL)
        # nothing else moves: activations, buffers and the reserve are the optimizer's business of no one
        assert r_off.total_bytes - r_on.total_bytes == pytest.approx(
            r_off.model_state_bytes - r_on.model_state_bytes, rel=REL)


def test_experts_shard_over_dp_over_ep():
    dp, ep = 16, 8
    cfg = load_config("paper-27b", {"parallel": {"data_parallel": dp, "microbatches": dp * 12, "expert_parallel": ep},
                                    "train": {"distributed_optimizer": True}})
    pred = predict(cfg, HW, ladder=False)
    pr = pred.pricers["mhc"]
    for r in pred.memory["mhc"]:
        mine = [pr.stage_mem[s] for s in pred.schedule.stages_of(r.rank)]
        experts = sum(s.expert_params for s in mine)
        dense = sum(s.params for s in mine) - experts
        assert experts > 0 and dense > 0
        assert r.model_state_bytes == pytest.approx((6 + 12 / dp) * dense + (6 + 12 / (dp // ep)) * experts, rel=REL)


def test_fp32_states_follow_megatrons_fp32_row():
    cfg = load_config("tiny", {"train": {"dtype": "float32"}})
    st = M.stage_memory(cfg, M.ResidualSpec("mhc", 4), 0, range(0, 2), True, False)
    assert M.model_state_bytes(cfg, [st], dp=4) == pytest.approx(16 * st.params, rel=REL)
    cfg_on = cfg.model_copy(update={"train": cfg.train.model_copy(update={"distributed_optimizer": True})})
    assert M.model_state_bytes(cfg_on, [st], dp=4) == pytest.approx((8 + 8 / 4) * st.params, rel=REL)


def test_reserve_is_its_own_term_on_gpus_only():
    cfg = load_config("paper-27b")  # EP 8 inside one node: no RDMA buffer
    pred = predict(cfg, HW, ladder=False)
    for r in pred.memory["mhc"]:
        fixed = M.CUDA_CONTEXT_BYTES + M.NCCL_BUFFER_BYTES + M.DEEPEP_NVL_BYTES
        dynamic = r.activation_bytes + r.transient_bytes + r.buffer_bytes
        assert r.reserve_bytes == pytest.approx(fixed + M.FRAGMENTATION * dynamic, rel=REL)
        assert r.total_bytes == pytest.approx(r.model_state_bytes + dynamic + r.reserve_bytes, rel=REL)
    assert pred.summary["memory_gib"]["mhc"] * 2**30 == pytest.approx(max(r.total_bytes for r in pred.memory["mhc"]))
    pr = pred.pricers["mhc"]
    s = pred.schedule
    spread = M.rank_memory(cfg, pr.spec, pr.stage_mem, s.stages_of(0), 0, s.actions[0], hw=HW, ep_per_node=4)
    inside = M.rank_memory(cfg, pr.spec, pr.stage_mem, s.stages_of(0), 0, s.actions[0], hw=HW)
    assert spread.reserve_bytes - inside.reserve_bytes == pytest.approx(M.DEEPEP_RDMA_BYTES)  # EP over 2 nodes
    cpu = HW.model_copy(update={"host_cores": 2})
    none = M.rank_memory(cfg, pr.spec, pr.stage_mem, s.stages_of(0), 0, s.actions[0], hw=cpu)
    assert none.reserve_bytes == 0.0
    assert M.rank_memory(cfg, pr.spec, pr.stage_mem, s.stages_of(0), 0, s.actions[0]).reserve_bytes == 0


@pytest.fixture(scope="module")
def p3b():
    return load_config("paper-3b"), load_config_data("paper-3b")[0]


SPACE = dict(microbatch_sizes=(1,), recompute=("off", "auto"))


@pytest.fixture(scope="module")
def tuned_both(p3b):
    """paper-3b on 32 h800s, 40 GiB, global batch 64, both optimizer choices: the search two tests read."""
    cfg, data = p3b
    return tune(cfg, data, HW, 32, 40.0, 64, **SPACE)


def test_tune_under_both_optimizer_choices(p3b, tuned_both, tmp_path, capsys):
    cfg, data = p3b
    runs = {z: tune(cfg, data, HW, 32, 40.0, 64, distributed_optimizer=(z,), **SPACE) for z in (False, True)}
    both = tuned_both
    for z, res in runs.items():
        assert res.best is not None and all(e.cand.distributed_optimizer is z for e in res.front)
        assert all(e.memory_gib <= 40.0 for e in res.front)
    off, on = runs[False].best, runs[True].best
    assert on.step_us <= off.step_us * (1 + REL)  # the same steps, less memory: at least as many layouts fit
    assert both.best.step_us == pytest.approx(min(on.step_us, off.step_us), rel=REL)
    # one layout, both ways: the step is the same, the memory is the 12(1 - 1/d) bytes per parameter less
    tuner = Tuner(cfg, data, HW)
    k = off.cand
    m_off = tuner.memory(k).memory_bytes
    m_on = tuner.memory(dataclasses.replace(k, distributed_optimizer=True)).memory_bytes
    assert m_on < m_off
    # the written YAML carries the choice and predicts the reported memory
    out = tmp_path / "best.yaml"
    argv = ["tune", "--preset", "paper-3b", "--hardware", "h800", "--gpus", "32", "--memory-gib", "40",
            "--global-batch", "64", "--microbatch-sizes", "1", "--recompute", "off,auto",
            "--distributed-optimizer", "on", "--splits", "even", "-o", str(out), "--json", str(tmp_path / "t.json")]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    written = load_config(str(out))
    assert written.train.distributed_optimizer is True
    assert predict(written, HW, ladder=False).summary["memory_gib"]["mhc"] == pytest.approx(on.memory_gib, rel=REL)
    assert "dist-opt" in printed


def _ev(step_ms: float, gib: float, hp: bool = True) -> Evaluated:
    ev = Evaluated(Candidate("1f1b", 1, 1, 1, 1, 1, "off", hp), gib * 2**30)
    ev.sync = GradSync((), step_ms * 1e3, step_ms * 1e3)
    ev.pipeline_us = step_ms * 1e3
    return ev


def test_ties_are_the_front_within_the_error_band_most_headroom_first():
    best = _ev(100.0, 70.0)
    close = _ev(101.5, 60.0)  # within 2%, more headroom
    closer = _ev(100.5, 65.0)
    dominated = _ev(101.0, 66.0)  # slower and bigger than `closer`: not a tie worth listing
    far = _ev(102.5, 40.0)  # outside the band
    ties = ties_of([far, dominated, close, best, closer], best)
    assert ties == [close, closer, best]
    assert TIE_PCT == 2.0
    assert ties_of([best], best) == [best] and ties_of([], None) == []


def test_tune_reports_ties(p3b, tuned_both, capsys):
    cfg, data = p3b
    res = tuned_both
    assert res.best in res.ties
    assert all(e.step_us <= res.best.step_us * (1 + TIE_PCT / 100) and e.cand.hp for e in res.ties)
    assert [e.memory_bytes for e in res.ties] == sorted(e.memory_bytes for e in res.ties)
    # exact: the exhaustive runnable front's layouts in the band are the ties
    tuner = Tuner(cfg, data, HW)
    every = [tuner.evaluate(tuner.memory(c)) for c in candidates(cfg, 32, 64, hp=(True,), **SPACE)]
    fits = [e for e in every if e.memory_gib <= 40.0]
    want = ties_of(fits, min(fits, key=lambda e: (e.step_us, e.memory_bytes)))
    assert [(round(e.step_us, 3), round(e.memory_bytes)) for e in res.ties] == \
        [(round(e.step_us, 3), round(e.memory_bytes)) for e in want]
    assert main(["tune", "--preset", "paper-3b", "--hardware", "h800", "--gpus", "32", "--memory-gib", "40",
                 "--global-batch", "64", "--microbatch-sizes", "1", "--recompute", "off,auto"]) == 0
    printed = capsys.readouterr().out
    if len(res.ties) > 1:
        assert f"tied within +-{TIE_PCT:g}% of the best" in printed
    else:
        assert f"no other runnable layout within +-{TIE_PCT:g}%" in printed


def test_tune_json_has_the_ties(tmp_path, capsys):
    path = tmp_path / "t.json"
    assert main(["tune", "--preset", "paper-3b", "--hardware", "h800", "--gpus", "32", "--memory-gib", "40",
                 "--global-batch", "64", "--microbatch-sizes", "1", "--recompute", "off,auto",
                 "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["tie_pct"] == TIE_PCT and data["ties"] and data["best"]["label"] in [t["label"] for t in data["ties"]]
    heads = [t["headroom_gib"] for t in data["ties"]]
    assert heads == sorted(heads, reverse=True)
    assert main(["tune", "--preset", "paper-3b", "--gpus", "32", "--json", "x.txt"]) == 2
    assert "--json 'x.txt'" in capsys.readouterr().err
