#!/usr/bin/env bash
# GPU check of mhc-pipe on one H200 (docs: docs/gpu.md), in under 8 minutes, then a short table.
#
#   bash bench/gpu_check.sh              # on the GPU machine (device tool), outputs in ${OUT:-runs/gpu_check}
#   bash bench/gpu_check.sh --cpu        # the same steps with the device set to CPU at small shapes (or GPU_CHECK_CPU=1)
#   bash bench/gpu_check.sh --gpus N     # a node with N >= 2 GPUs (N even): install, env, multi_gpu only
#   bash bench/gpu_check.sh --gpus N --cpu   # the multi_gpu plumbing on CPU: its "NCCL" side falls back to gloo
#
# Steps, in this order (each with its own time limit, listed by --plan; the GPU limits add up to less than the
# budget, so every step gets its full limit; a failing step never stops the later ones; a step that cannot run,
# because the budget is spent or what it needs is missing, is reported SKIP with the reason, not as a failure;
# output of each step in OUT/<step>.log):
#   install         pydantic / nvtx / pyyaml / pytest from .whl/ when the image lacks them (no network there;
#                   bench/stage_wheels.sh fills .whl/ on a machine with network)
#   env             versions, device, stream priorities, NVTX (bench/gpu_report.py env)
#   stream_probe    the stream rule the pipeline relies on: a kernel on the compute stream runs while an end stream
#                   (made by the runtime's device layer) waits for an op that has not completed; a blocking-stream
#                   control must fail it (bench/gpu_stream_probe.py; --cpu: the emulated device and the replay).
#                   Failing it stops the check with one line: every later step would rest on a broken rule.
#   fb_pair_cuda    the threaded F&B pair on CUDA streams: DualPipeV rank 0 (P=2, M=8, 11 pairs) of a MoE model
#                   with a world-size-1 NCCL group, two 1-rank EP groups (F, B) whose all-to-alls really run, and
#                   loopback P2P; trace has both halves' spans and the all-to-all comm spans; loss and every grad
#                   equal the overlap-off run's (rel <= 1e-5, fp32); step time overlap vs serial
#                   (bench/gpu_pair_check.py)
#   hp_bitwise      mhc:4 and mhc-sp:4, DualPipeV ranks 0 and 1: loss, sends and grads with the priority -1 hp
#                   stream placement torch.equal to the same runtime with env.hp = None, fresh random inputs per
#                   check, plus a no-hp vs no-hp determinism baseline (bench/gpu_hp_check.py)
#   world1_nccl     one rank on NCCL, tiny-moe (EP=1: the MoE count read on CUDA): every blocking collective of
#                   the runtime, CUDA-event spans, the channel and collective warm-up, and a
#                   torch.distributed.checkpoint save + resume whose next loss must equal an uninterrupted run's
#   kernel_parity   fused kernels vs float64 reference at full size, T=4096, C=2560/4096/7168 (bench/kernel_parity.py)
#   stage           one DualPipeV rank's action list at the paper-27B block shape, n=1 vs n=4, loopback
#                   hand-offs, CUDA-event spans, and the cost model's H200 prediction (bench/stage_bench.py)
#   kernel_bench    kernel GB/s vs copy bandwidth, block overhead plain / mHC fused / eager (bench/kernel_bench.py)
#   pipeline_2rank  a real 2-rank torchrun pipeline with the host-staged transport at the 27B block shape,
#                   2 steps, traced; then a check that the trace has hp-stream spans. Two processes on one GPU
#                   need host-staged transfers (~3.8 GB/s, gpu.md §6): this proves the CUDA path (streams,
#                   events, NVTX, priorities) works, it is not a timing.
#   kernel_tests    pytest tests/kernels (compiled Triton kernels on CUDA; the interpreter on CPU). Last because
#                   CI already runs these small shapes and they compile the most kernel variants.
#   multi_gpu       (--gpus N only, instead of the steps from fb_pair_cuda on) every schedule x {pp=N (tiny, mhc:4),
#                   pp=N/2 dp=2 ep=2 (tiny-moe)} for 3 steps with torchrun on NCCL and on gloo, losses equal to
#                   1e-4 relative, one table (bench/gpu_multi.py; also OUT/multi_table.txt)
#   then the final table (bench/gpu_report.py table OUT; also OUT/summary.json). Exit 0 only when every step is ok.
#
# Preparing the wheels (the GPU image lacks pydantic, nvtx and PyYAML, maybe pytest, and has no network), once,
# on a machine with network, from the repository root: `bash bench/stage_wheels.sh` (into .whl/, git-ignored,
# about 9 MiB).
#
# A session then runs this through the device tool with carry: [".whl"], e.g.
#   run(command="bash bench/gpu_check.sh", carry=[".whl"], timeout_s=540)
# $OUT is set by the device tool to the folder that comes back; the wheels go to a --target folder under /tmp
# that is put first on PYTHONPATH (nothing is installed into the image's site-packages; pip --target installs the
# dependencies too, so the wheels' typing-extensions, which pydantic needs at >= its pinned minimum, shadows an
# older one in the image).
#
# Environment: OUT (output folder), GPU_CHECK_BUDGET (seconds for all steps; default 460 on GPU (the step limits add up to 450), 900 on CPU, 1800
# with --gpus, 3600 with --gpus --cpu), WHEEL_DIR (default .whl), SITE_DIR (default /tmp/gpu_check_site), PYTHON
# (interpreter; default .venv/bin/python when present, else python3), GPU_CHECK_CPU=1 (same as --cpu),
# GPU_CHECK_ONLY=step,step (run only these steps, plus install and env; e.g. fb_pair_cuda,hp_bitwise,world1_nccl).
set -u

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2

MODE=gpu
PLAN=0  # --plan: print the steps with their limits and the budget, run nothing
GPUS=0  # 0: the one-GPU steps; N >= 2: the multi-GPU mode (multi_gpu step)
while [ $# -gt 0 ]; do
    case "$1" in
        --cpu) MODE=cpu ;;
        --gpus) GPUS=${2:-}; shift ;;
        --gpus=*) GPUS=${1#--gpus=} ;;
        --plan) PLAN=1 ;;
        -h|--help) sed -n '2,52p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument '$1' (use --cpu, --gpus N, --plan, or nothing)" >&2; exit 2 ;;
    esac
    shift
done
[ "${GPU_CHECK_CPU:-0}" = "1" ] && MODE=cpu
case "$GPUS" in
    ''|*[!0-9]*) echo "gpu_check.sh: --gpus takes an even number >= 2, got '$GPUS'" >&2; exit 2 ;;
esac
if [ "$GPUS" != 0 ] && { [ "$GPUS" -lt 2 ] || [ $((GPUS % 2)) != 0 ]; }; then
    echo "gpu_check.sh: --gpus $GPUS: must be even and >= 2 (the dp=2 layout halves it)" >&2; exit 2
fi

if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"
else PY=$(command -v python3 || command -v python); fi
if [ -z "$PY" ]; then echo "gpu_check.sh: no python3 on PATH" >&2; exit 2; fi

if [ "$GPUS" != 0 ]; then
    if [ "$MODE" = cpu ]; then BUDGET=${GPU_CHECK_BUDGET:-3600}; else BUDGET=${GPU_CHECK_BUDGET:-1800}; fi
elif [ "$MODE" = cpu ]; then BUDGET=${GPU_CHECK_BUDGET:-900}; else BUDGET=${GPU_CHECK_BUDGET:-460}; fi

# Per-step limits in seconds. GPU: they add up to 450 s, under the 460 s budget, so the whole check fits one
# 8-minute device call with room for the machine's start; CPU (--cpu, 810 s of 900): Triton interpreted.
STEPS=(install env stream_probe fb_pair_cuda hp_bitwise world1_nccl kernel_parity stage kernel_bench pipeline_2rank
       kernel_tests)
declare -A LIM_GPU=([install]=30 [env]=20 [stream_probe]=15 [fb_pair_cuda]=50 [hp_bitwise]=40 [world1_nccl]=70
                    [kernel_parity]=40 [stage]=55 [kernel_bench]=30 [pipeline_2rank]=60 [kernel_tests]=40)
declare -A LIM_CPU=([install]=60 [env]=30 [stream_probe]=30 [fb_pair_cuda]=60 [hp_bitwise]=60 [world1_nccl]=90
                    [kernel_parity]=60 [stage]=60 [kernel_bench]=60 [pipeline_2rank]=90 [kernel_tests]=240)
lim() { if [ "$MODE" = cpu ]; then echo "${LIM_CPU[$1]}"; else echo "${LIM_GPU[$1]}"; fi; }

if [ "$PLAN" = 1 ]; then
    total=0
    printf '%-16s %6s\n' step "limit"
    for st in "${STEPS[@]}"; do printf '%-16s %6s\n' "$st" "$(lim "$st")"; total=$((total + $(lim "$st"))); done
    echo "sum of limits ${total}s, budget ${BUDGET}s ($MODE)"
    [ "$total" -le "$BUDGET" ] || { echo "gpu_check.sh: the step limits add up to more than the budget" >&2; exit 1; }
    exit 0
fi

OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
STATUS="$OUT/status.tsv"
: > "$STATUS"
WHEELS=${WHEEL_DIR:-$ROOT/.whl}
SITE=${SITE_DIR:-/tmp/gpu_check_site}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
START=$(date +%s.%N)

elapsed() { awk -v a="$START" -v b="$(date +%s.%N)" 'BEGIN { printf "%d", b - a }'; }

# skip_step NAME REASON: a row that says the step did not run and why (not a failure).
skip_step() {
    echo "skipped: $2" > "$OUT/$1.log"
    printf '%s\tskip\t0\t0\t%s\n' "$1" "$1.log" >> "$STATUS"
    echo "[$1] SKIP ($2)"
}

# run_step NAME LIMIT_S CMD...: run under `timeout` (the whole process group is killed at the limit), capped by
# what is left of the budget; log to OUT/NAME.log; append "name rc seconds limit log" to status.tsv.
run_step() {
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET - $(elapsed)))
    local log="$name.log"
    if [ -n "${GPU_CHECK_ONLY:-}" ] && [ "$name" != install ] && [ "$name" != env ] &&
        [[ ",$GPU_CHECK_ONLY," != *",$name,"* ]]; then
        return  # not selected: no row at all
    fi
    if [ "$left" -lt 15 ]; then
        skip_step "$name" "the ${BUDGET}s budget is used up"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "[$name] limit ${limit}s, log $OUT/$log"
    local t0 rc dt
    t0=$(date +%s.%N)
    printf '+ %s\n' "$*" > "$OUT/$log"
    timeout -k 10 "$limit" "$@" >> "$OUT/$log" 2>&1
    rc=$?
    dt=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$dt" "$limit" "$log" >> "$STATUS"
    echo "[$name] rc=$rc in ${dt}s"
    if [ "$rc" != 0 ]; then tail -n 15 "$OUT/$log" | sed "s/^/    $name| /"; fi
}

# ---- install: only what the interpreter lacks, from the wheel folder ----------------------------------------
MISSING=$("$PY" - <<'EOF'
import importlib.util
need = {"pydantic": "pydantic", "nvtx": "nvtx", "yaml": "pyyaml", "pytest": "pytest"}
print(" ".join(dist for mod, dist in need.items() if importlib.util.find_spec(mod) is None))
EOF
)
if [ -n "$MISSING" ]; then
    if [ -d "$WHEELS" ]; then
        run_step install "$(lim install)" "$PY" -m pip install --no-index --find-links "$WHEELS" --target "$SITE" \
            --disable-pip-version-check --no-warn-script-location $MISSING
        export PYTHONPATH="$SITE:$PYTHONPATH"
    else
        echo "missing $MISSING and no wheel folder $WHEELS: run bash bench/stage_wheels.sh where there is network" \
            "and carry .whl" > "$OUT/install.log"
        printf 'install\t1\t0\t0\tinstall.log\n' >> "$STATUS"
        echo "[install] FAIL: missing $MISSING and no $WHEELS (bash bench/stage_wheels.sh makes it)"
    fi
fi

if [ "$MODE" = cpu ]; then
    SMALL=(--device cpu --small)
    KB=(--device cpu --small --no-compile)
else
    SMALL=(--device cuda)
    KB=(--device cuda --no-compile)
fi

run_step env "$(lim env)" "$PY" bench/gpu_report.py env --out "$OUT/env.json"

finish() {
    echo
    echo "gpu_check ($MODE$([ "$GPUS" != 0 ] && echo ", --gpus $GPUS")) finished in $(elapsed)s of a ${BUDGET}s budget; outputs in $OUT"
    "$PY" bench/gpu_report.py table "$OUT" | tee "$OUT/table.txt"
    exit "${PIPESTATUS[0]}"
}

rm -f "$OUT/fb_pair.json" "$OUT/hp_bitwise.json" "$OUT/multi.json" "$OUT/multi_table.txt"  # no stale results

# multi_gpu (--gpus N): every schedule x {pp=N, pp=N/2 dp=2 ep=2}, NCCL vs gloo losses; nothing else runs.
if [ "$GPUS" != 0 ]; then
    if [ "$MODE" = cpu ]; then MULTI=(--cpu); else MULTI=(); fi
    run_step multi_gpu "$BUDGET" "$PY" bench/gpu_multi.py --gpus "$GPUS" "${MULTI[@]}" --python "$PY" \
        --out "$OUT/multi.json" --workdir "$OUT/multi"
    [ -f "$OUT/multi_table.txt" ] && { echo; cat "$OUT/multi_table.txt"; }
    finish
fi

# stream_probe: first, and a failure stops the check (every later step rests on the rule it checks).
run_step stream_probe "$(lim stream_probe)" "$PY" bench/gpu_stream_probe.py \
    --device "$([ "$MODE" = cpu ] && echo cpu || echo cuda)" --out "$OUT/stream_probe.json"
if [ "$(awk -F'\t' '$1 == "stream_probe" { print $2 }' "$STATUS")" != "0" ] && grep -q '^stream_probe' "$STATUS"; then
    echo "gpu_check: stopped: $(tail -n 1 "$OUT/stream_probe.log")"
    finish
fi

# fb_pair_cuda: the threaded F&B pair (helper thread, EP all-to-alls on 1-rank F/B groups, NCCL world size 1 on
# CUDA, gloo on CPU), loss and grads against overlap off, step time overlap vs serial.
run_step fb_pair_cuda "$(lim fb_pair_cuda)" "$PY" bench/gpu_pair_check.py "${SMALL[@]}" --out "$OUT/fb_pair.json" \
    --trace-out "$OUT/fb_pair_trace.json"
# hp_bitwise: mhc and mhc-sp with the hp stream placement vs without (torch.equal), plus a determinism baseline.
run_step hp_bitwise "$(lim hp_bitwise)" "$PY" bench/gpu_hp_check.py "${SMALL[@]}" --out "$OUT/hp_bitwise.json"
# world1_nccl: one rank on NCCL (the CPU run: gloo) - the runtime's every blocking collective (barriers, the
# statistics and clock all-gathers), MoE blocks whose expert counts the host reads from the GPU, CUDA-event spans and hp stream, and a torch.distributed.checkpoint save
# and resume on the device: 3 steps uninterrupted vs 2 steps + resume, the resumed step's loss must match.
run_step world1_nccl "$(lim world1_nccl)" bash -c '
    set -e
    W="$1"; rm -rf "$W"; mkdir -p "$W"
    run() { "$0" -m torch.distributed.run --standalone --nproc-per-node 1 -m pipeline --config configs/tiny-moe.yaml \
        --pp 1 --schedule 1f1b --device "$2" "${@:3}"; }
    run "$W" "$2" --steps 3 --trace-dir "$W/trace" | tee "$W/full.log"
    run "$W" "$2" --steps 2 --checkpoint-dir "$W/ckpt"
    run "$W" "$2" --steps 3 --checkpoint-dir "$W/ckpt" --resume | tee "$W/resumed.log"
    "$0" bench/gpu_report.py trace-check "$W/trace/trace.json" --ranks 1 --device "$2" --no-comm \
        --out "$(dirname "$W")/world1_trace_check.json"
    "$0" bench/gpu_report.py resume-check "$W/full.log" "$W/resumed.log" --out "$(dirname "$W")/world1_resume.json"
' "$PY" "$OUT/world1" "$([ "$MODE" = cpu ] && echo cpu || echo cuda)"

if [ "$MODE" = cpu ]; then PARITY=(--launch gpu --num-sms 11); else PARITY=(); fi  # CPU: the GPU's tiles and splits
run_step kernel_parity "$(lim kernel_parity)" "$PY" bench/kernel_parity.py "${SMALL[@]}" "${PARITY[@]}" --out "$OUT/parity.json"
run_step stage "$(lim stage)" "$PY" bench/stage_bench.py "${SMALL[@]}" --out "$OUT/stage.json"
run_step kernel_bench "$(lim kernel_bench)" "$PY" bench/kernel_bench.py "${KB[@]}" --out "$OUT/kernels.json"
# pipeline_2rank: the 27B block shape as a 2-rank DualPipeV config (1 block per stage), torchrun, trace check.
CFG="$OUT/pipeline_2rank.yaml"
TRACE_DIR="$OUT/pipeline_2rank_trace"
rm -rf "$TRACE_DIR"
run_step pipeline_2rank "$(lim pipeline_2rank)" bash -c '
    set -e
    "$0" bench/stage_bench.py "${@:4}" --write-config "$1" --config-ranks 2 --config-blocks-per-stage 1 --config-steps 2
    "$0" -m torch.distributed.run --standalone --nproc-per-node 2 -m pipeline --config "$1" \
        --device "$3" --transport host --steps 2 --trace-dir "$2"
    "$0" bench/gpu_report.py trace-check "$2/trace.json" --ranks 2 --device "$3" --out "$(dirname "$1")/trace_check.json"
' "$PY" "$CFG" "$TRACE_DIR" "$([ "$MODE" = cpu ] && echo cpu || echo cuda)" "${SMALL[@]}"

# Last: the small-shape kernel tests (CI runs them under the interpreter; here compiled) get what is left.
if "$PY" -c "import pytest" 2>/dev/null; then
    run_step kernel_tests "$(lim kernel_tests)" "$PY" -m pytest tests/kernels -x -q -p no:cacheprovider
else
    skip_step kernel_tests "pytest is not importable (bash bench/stage_wheels.sh stages it into .whl/)"
fi

finish
