"""DeepSeek-V3 scale (issue 45 items 5-6): MLA, FP8, node-limited routing, one NIC for P2P and all-to-all, MTP, the
`deepseek-v3` preset at 2,048 H800 and its throughput/MFU, and the bad inputs around them (one line, exit 2)."""
from __future__ import annotations

import math
import random

import pytest

from configs import CONFIG_DIR, load_config
from costmodel.physics import comm_cost as comm
from costmodel.physics.hardware import get_hardware
from costmodel.physics.memory import stage_memory
from costmodel.physics.mhc_cost import ResidualSpec, mhc_params_per_sublayer
from costmodel.physics.ops import FP8_SCALE_BYTES, Shape, attention_params, block_params, linear, mtp_params
from costmodel.answers.predict import predict
from costmodel.pricing.pricer import Pricer
from costmodel.pricing.stage_split import resolve_layout
from costmodel.pricing.options import Options
from mhcpipe.cli import main
from schedules.build import build

H800 = get_hardware("h800")


@pytest.fixture(scope="module")
def v3():
    return load_config("deepseek-v3")


@pytest.fixture(scope="module")
def v3_pred(v3):
    return predict(v3, H800)


def test_v3_parameters_are_the_published_counts(v3):
    """V3 §4.2 / its model card: 671B parameters in the main model, 37B active per token; the MTP module 14B as the
    checkpoint stores it (its own copies of the embedding and head, shared in training)."""
    m, e = v3.model, v3.model.moe
    total = sum(block_params(v3, b, 1) for b in range(m.num_blocks)) + 2 * m.vocab_size * m.hidden + m.hidden
    assert total == pytest.approx(671e9, rel=0.002)
    active = (sum(block_params(v3, b, math.inf) for b in range(m.num_blocks)) + 2 * m.vocab_size * m.hidden
              + (m.num_blocks - e.first_dense_blocks) * e.top_k * 3 * m.hidden * e.expert_hidden)
    assert active == pytest.approx(37e9, rel=0.03)
    assert mtp_params(v3, 1) + 2 * m.vocab_size * m.hidden == pytest.approx(14e9, rel=0.05)
    # MLA: far fewer attention parameters than 128 full heads of width 192 would have
    assert attention_params(v3) < 0.3 * 4 * m.hidden * m.num_heads * m.head_dim


def test_remote_nodes_per_token_against_sampling():
    """The hypergeometric expectation against drawing experts at random (node-limited: M nodes first, then top-k
    experts among theirs), 20,000 tokens each."""
    rng = random.Random(0)
    for experts, k, nodes, limit in ((256, 8, 8, 4), (256, 8, 8, None), (72, 6, 2, None), (64, 8, 4, 2)):
        per = experts // nodes
        hits = 0
        for _ in range(20000):
            own = rng.randrange(nodes)
            allowed = rng.sample(range(nodes), limit) if limit else list(range(nodes))
            pool = [n * per + j for n in allowed for j in range(per)]
            chosen = {x // per for x in rng.sample(pool, k)}
            hits += len(chosen - {own})
        assert comm.remote_nodes_per_token(experts, k, nodes, limit) == pytest.approx(hits / 20000, rel=0.02)
    assert comm.remote_nodes_per_token(256, 8, 1) == 0.0


def test_node_limited_routing_and_dedup_cut_the_network_bytes():
    """DeepEP's internode all-to-all sends a token once per remote node: fewer nodes per token, less time; every
    copy on its own (routing None) costs the most."""
    ep, nbytes = 64, 4096 * 8 * 7168 * 2.0
    times = [comm.all_to_all_us(H800, ep, nbytes, routing=(256, 8, m)) for m in (1, 2, 4, 8, None)]
    assert times == sorted(times) and times[0] < times[-1]
    assert comm.all_to_all_us(H800, ep, nbytes) > times[-1]
    # inside one node neither routing nor the NIC matter
    assert comm.all_to_all_us(H800, 8, nbytes, routing=(256, 8, 4), nic_bytes=1e9) == comm.all_to_all_us(H800, 8,
                                                                                                         nbytes)


def test_one_nic_carries_p2p_and_all_to_all(v3):
    """V3's stage boundaries cross nodes (pipeline neighbours 128 ranks apart) and its EP group spans 8 nodes: an
    action's P2P bytes join its all-to-alls on the NIC. With the EP group inside a node nothing is shared (under
    the mesh an EP group over nodes means D > 8, so pipeline neighbours always sit on different nodes then)."""
    layout = resolve_layout(v3, build("dualpipe", 16, 120), False)
    spec = ResidualSpec("mhc", 4)
    shared = Pricer(v3, H800, spec, layout, Options())
    moe_blocks = v3.model.num_blocks - v3.model.moe.first_dense_blocks
    assert shared.nic_bytes == pytest.approx(shared.message_bytes / (2 * moe_blocks * 2 / len(layout)))
    alone = comm.all_to_all_us(H800, 64, 1e8, routing=shared.routing)
    assert comm.all_to_all_us(H800, 64, 1e8, routing=shared.routing, nic_bytes=shared.nic_bytes) > alone
    assert shared.link is H800.inter and shared.nic_bytes > 0
    small = load_config("deepseek-v3", {"parallel": {"expert_parallel": 8}})
    assert Pricer(small, H800, spec, layout, Options()).nic_bytes == 0.0  # EP inside a node: no network all-to-all


def test_fp8_gemm_runs_at_the_fp8_rate_plus_its_quantisation_pass(v3):
    s = Shape.of(v3)
    bf = Shape.of(load_config("deepseek-v3", {"train": {"fp8": False}}))
    k8, k16 = linear("x", 4096, 7168, 18432, s), linear("x", 4096, 7168, 18432, bf)
    assert k8.dtype == "fp8" and k16.dtype == "bf16" and k8.flops == k16.flops
    assert k8.quant_bytes == pytest.approx((2 + 1 + FP8_SCALE_BYTES) * 4096 * 7168)
    w8 = linear("x", 7168, 4096, 18432, s, wgrad=True)
    assert w8.quant_bytes == pytest.approx((2 + 1 + FP8_SCALE_BYTES) * (7168 * 4096 + 4096 * 18432))
    pr = Pricer(v3, H800, ResidualSpec.baseline(), resolve_layout(v3, build("dualpipe", 16, 120), False), Options())
    t8 = pr.kernel_us(k8, False)
    assert t8 == pytest.approx(H800.matmul_us(k8.flops, k8.nbytes, "fp8") + H800.memory_us(k8.quant_bytes)
                               + 2 * H800.launch_us)
    t16 = pr.kernel_us(k16, False)
    assert 0.5 * t16 < t8 < t16  # twice the rate, less the quantisation
    with pytest.raises(ValueError, match=r"^train\.fp8: the a100 has no FP8"):
        Pricer(v3, get_hardware("a100"), ResidualSpec.baseline(), pr.layout, Options())


def test_mtp_sits_on_the_last_stage(v3):
    layout = resolve_layout(v3, build("dualpipe", 16, 120), False)
    none = load_config("deepseek-v3", {"model": {"mtp_depth": 0}})
    spec = ResidualSpec("mhc", 4)
    with_mtp, without = Pricer(v3, H800, spec, layout, Options()), Pricer(none, H800, spec, layout, Options())
    last = next(st for st, (_, _, is_last) in layout.items() if is_last)
    first = next(st for st, (_, is_first, _) in layout.items() if is_first)
    names = [k.name for k in with_mtp.forward_kernels(last)]
    assert "mtp.proj" in names and names.count("head.logits") == 2
    assert [k.name for k in with_mtp.forward_kernels(first)] == [k.name for k in without.forward_kernels(first)]
    bw = [o.name for o in with_mtp.backward_ops(last, with_w=True)]
    assert bw.count("head.dgrad") == 2 and "mtp.proj.wgrad" in bw and bw.index("mtp.proj.dgrad") < bw.index(
        "head.dgrad", bw.index("mtp.proj.dgrad"))  # MTP's backward before the main head's
    m_with = stage_memory(v3, spec, last, *layout[last])
    m_without = stage_memory(none, spec, last, *layout[last])
    assert m_with.params - m_without.params == pytest.approx(mtp_params(v3, 64)
                                                             + 2 * mhc_params_per_sublayer(spec, 7168), rel=1e-12)
    assert m_with.chunk_activation_bytes > m_without.chunk_activation_bytes


def test_v3_prediction_prints_throughput_mfu_and_memory(v3, v3_pred, capsys):
    s = v3_pred.summary
    assert s["gpus"] == 2048 and s["tokens_per_step"] == 15360 * 4096
    for name in ("baseline", "mhc"):
        step_s = s["iteration_us"][name] * 1e-6
        assert s["tokens_per_s_per_gpu"][name] == pytest.approx(15360 * 4096 / step_s / 2048, rel=1e-12)
        assert s["mfu_pct"][name] == pytest.approx(100 * s["tokens_per_s_per_gpu"][name]
                                                   * s["model_tflop_per_token"] * 1e12 / 989.4e12, rel=1e-12)
    assert s["model_tflop_per_token"] > 6 * 37e9 / 1e12  # 6 x active parameters, plus attention
    # PaLM's convention counts the full score matrix: V3's MLA core, s^2 h (d_qk + d_v) per sequence causal,
    # counted twice; 61 layers + the MTP block, x3 for training
    mla = 4096 * 128 * (192 + 128) * 62 * 3 / 1e12
    assert s["model_tflop_per_token_palm"] - s["model_tflop_per_token"] == pytest.approx(mla, rel=1e-9)
    assert s["mfu_palm_pct"]["baseline"] / s["mfu_pct"]["baseline"] == pytest.approx(
        s["model_tflop_per_token_palm"] / s["model_tflop_per_token"], rel=1e-12)
    # the baseline (V3's own residual) fits an 80 GB H800, as V3 trained there
    assert s["memory_gib"]["baseline"] < H800.memory_bytes / 2**30
    assert main(["predict", "--preset", "deepseek-v3", "--hardware", "h800"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s per GPU" in out and "MFU" in out and "2,048 GPUs" in out and "peak memory per rank" in out


@pytest.mark.parametrize("argv, first", [
    (["--preset", "paper-27b", "--ep", "24"], "parallel.expert_parallel=24 (--ep) must divide parallel.data_parallel"),
    (["--preset", "paper-27b", "--ep", "16", "--dp", "16", "--microbatches", "384"],
     "parallel.expert_parallel=16 (--ep) must divide model.moe.num_experts=72"),
    (["--preset", "deepseek-v3", "--hardware", "a100"], "train.fp8: the a100 has no FP8 tensor-core rate"),
    (["--preset", "deepseek-v3", "--pp", "64"], "model.num_blocks=61 cannot fill 64 pipeline stages"),
    (["--preset", "paper-27b", "--n", "0"], "--n 0: residual streams must be >= 1"),
    (["--preset", "paper-27b", "--variant", "xhc", "--n", "16", "--k", "0"], "--k 0: active streams must be >= 1"),
])
def test_bad_layouts_one_line_exit_2(argv, first, capsys):
    assert main(["predict", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and first in err, err


def test_mla_ranks_inconsistent_with_heads_one_line(tmp_path, capsys):
    text = (CONFIG_DIR / "deepseek-v3.yaml").read_text()
    for bad, first in ((text.replace("head_dim: 192", "head_dim: 128"), "model.head_dim=128 must equal"),
                       (text.replace("kv_lora_rank: 512", "kv_lora_rank: 40000"), "model.mla.kv_lora_rank=40000 is "
                        "not below the 32768")):
        path = tmp_path / "bad.yaml"
        path.write_text(bad)
        assert main(["predict", "--config", str(path)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and first in err, err


def test_a_world_the_preset_cannot_fill_one_line(capsys):
    assert main(["tune", "--preset", "deepseek-v3", "--gpus", "2047", "--memory-gib", "80",
                 "--global-batch", "15360"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--gpus 2047: no P pipeline ranks" in err and "2048" in err


def test_the_runtime_refuses_what_only_the_cost_model_prices(v3):
    from pipeline.launch.run_args import refuse_cost_model_only

    with pytest.raises(ValueError, match=r"^model\.mla, model\.mtp_depth, train\.fp8, "
                                         r"model\.moe\.max_nodes_per_token: priced by the cost model only"):
        refuse_cost_model_only(v3)
    refuse_cost_model_only(load_config("tiny-moe"))


def test_forward_flops_count_dense_and_moe_blocks_each_as_their_own(v3):
    """forward_flops_per_token prices one block of each kind once: the total must still count V3's 3 dense and
    58 MoE blocks as such (a cache keyed on anything else prices 61 blocks of one kind)."""
    from costmodel.physics.ops import block_work, forward_flops_per_token, head, mtp_prelude

    s = Shape.of(v3)

    def matmuls(work, core: float) -> float:
        return sum(k.flops * (core if k.name == "attn.core" else 1.0) for k in work.F if k.cls == "matrix")

    for causal, core in ((True, 1.0), (False, 2.0)):
        dense = sum(matmuls(w, core) for w in block_work(s, 0))
        moe = sum(matmuls(w, core) for w in block_work(s, v3.model.num_blocks))
        assert dense != moe  # close (V3 sized its MoE to the dense MLP), not equal
        mtp = moe + matmuls(head(s), core) + matmuls(mtp_prelude(s), core)
        want = 3 * dense + 58 * moe + matmuls(head(s), core) + v3.model.mtp_depth * mtp
        assert forward_flops_per_token(v3, causal) * s.T == pytest.approx(want, rel=1e-12)
