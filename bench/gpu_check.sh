#!/usr/bin/env bash
# GPU check of mhc-pipe on one H200 (docs: shared/docs/gpu.md), in under 8 minutes, then a short table.
#
#   bash bench/gpu_check.sh          # on the GPU machine (device tool), outputs in ${OUT:-runs/gpu_check}
#   bash bench/gpu_check.sh --cpu    # the same steps with the device set to CPU at small shapes (or GPU_CHECK_CPU=1)
#
# Steps, in this order (each with a time limit, its output in OUT/<step>.log; a failing step never stops the
# later ones; a step that would start with under 15 s of the budget left is skipped and says so):
#   install         pydantic / nvtx / pyyaml from .whl/ when the image lacks them (gpu.md §1: no network there)
#   env             versions, device, stream priorities, NVTX (bench/gpu_report.py env)
#   kernel_parity   fused kernels vs float64 reference at full size, T=4096, C=2560/4096/7168 (bench/kernel_parity.py)
#   stage           one DualPipeV rank's action list at the paper-27B block shape, n=1 vs n=4, loopback
#                   hand-offs, CUDA-event spans, and the cost model's H200 prediction (bench/stage.py)
#   kernel_bench    kernel GB/s vs copy bandwidth, block overhead plain / mHC fused / eager (bench/kernel_bench.py)
#   pipeline_2rank  a real 2-rank torchrun pipeline with the host-staged transport at the 27B block shape,
#                   2 steps, traced; then a check that the trace has hp-stream spans. Two processes on one GPU
#                   need host-staged transfers (~3.8 GB/s, gpu.md §6): this proves the CUDA path (streams,
#                   events, NVTX, priorities) works, it is not a timing.
#   world1_nccl     one rank on NCCL: every blocking collective of the runtime, CUDA-event spans, and a
#                   torch.distributed.checkpoint save + resume whose next loss must equal an uninterrupted run's
#   kernel_tests    pytest tests/kernels (compiled Triton kernels on CUDA; the interpreter on CPU). Last because
#                   CI already runs these small shapes and they compile the most kernel variants.
#   then the final table (bench/gpu_report.py table OUT; also OUT/summary.json). Exit 0 only when every step is ok.
#
# Preparing the wheels (the H200 image has no pydantic, no nvtx and no PyYAML, and no network), once, on a dev
# machine with network, from the repository root (.whl/ is git-ignored):
#
#   python3 -m pip download --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
#       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
#       -d .whl pydantic pydantic-core annotated-types typing-inspection typing-extensions nvtx pyyaml
#
# A session then runs this through the device tool with carry: [".whl"], e.g.
#   run(command="bash bench/gpu_check.sh", carry=[".whl"], timeout_s=540)
# $OUT is set by the device tool to the folder that comes back; the wheels go to a --target folder under /tmp
# that is put first on PYTHONPATH (nothing is installed into the image's site-packages).
#
# Environment: OUT (output folder), GPU_CHECK_BUDGET (seconds for all steps; default 460 on GPU, 900 on CPU),
# WHEEL_DIR (default .whl), SITE_DIR (default /tmp/gpu_check_site), PYTHON (interpreter; default .venv/bin/python
# when present, else python3), GPU_CHECK_CPU=1 (same as --cpu).
set -u

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2

MODE=gpu
for arg in "$@"; do
    case "$arg" in
        --cpu) MODE=cpu ;;
        -h|--help) sed -n '2,36p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument '$arg' (use --cpu or nothing)" >&2; exit 2 ;;
    esac
done
[ "${GPU_CHECK_CPU:-0}" = "1" ] && MODE=cpu

if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"
else PY=$(command -v python3 || command -v python); fi
if [ -z "$PY" ]; then echo "gpu_check.sh: no python3 on PATH" >&2; exit 2; fi

OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
STATUS="$OUT/status.tsv"
: > "$STATUS"
if [ "$MODE" = cpu ]; then BUDGET=${GPU_CHECK_BUDGET:-900}; else BUDGET=${GPU_CHECK_BUDGET:-460}; fi
WHEELS=${WHEEL_DIR:-$ROOT/.whl}
SITE=${SITE_DIR:-/tmp/gpu_check_site}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
START=$(date +%s.%N)

elapsed() { awk -v a="$START" -v b="$(date +%s.%N)" 'BEGIN { printf "%d", b - a }'; }

# run_step NAME LIMIT_S CMD...: run under `timeout` (the whole process group is killed at the limit), capped by
# what is left of the budget; log to OUT/NAME.log; append "name rc seconds limit log" to status.tsv.
run_step() {
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET - $(elapsed)))
    local log="$name.log"
    if [ "$left" -lt 15 ]; then
        echo "budget of ${BUDGET}s used up: step $name skipped" > "$OUT/$log"
        printf '%s\tskip\t0\t0\t%s\n' "$name" "$log" >> "$STATUS"
        echo "[$name] SKIP (budget used up)"
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
need = {"pydantic": "pydantic", "nvtx": "nvtx", "yaml": "pyyaml"}
print(" ".join(dist for mod, dist in need.items() if importlib.util.find_spec(mod) is None))
EOF
)
if [ -n "$MISSING" ]; then
    if [ -d "$WHEELS" ]; then
        run_step install 120 "$PY" -m pip install --no-index --find-links "$WHEELS" --target "$SITE" \
            --disable-pip-version-check --no-warn-script-location $MISSING
        export PYTHONPATH="$SITE:$PYTHONPATH"
    else
        echo "missing $MISSING and no wheel folder $WHEELS (see the top of this script)" > "$OUT/install.log"
        printf 'install\t1\t0\t0\tinstall.log\n' >> "$STATUS"
        echo "[install] FAIL: missing $MISSING and no $WHEELS"
    fi
fi

if [ "$MODE" = cpu ]; then
    SMALL=(--device cpu --small)
    KB=(--device cpu --small --no-compile)
else
    SMALL=(--device cuda)
    KB=(--device cuda --no-compile)
fi

# Per-step limits in seconds, GPU vs CPU (the CPU run interprets the Triton kernels, hence the longer tests).
lim() { if [ "$MODE" = cpu ]; then echo "$2"; else echo "$1"; fi; }

run_step env "$(lim 60 60)" "$PY" bench/gpu_report.py env --out "$OUT/env.json"
if [ "$MODE" = cpu ]; then PARITY=(--launch gpu --num-sms 11); else PARITY=(); fi  # CPU: the GPU's tiles and splits
run_step kernel_parity "$(lim 90 120)" "$PY" bench/kernel_parity.py "${SMALL[@]}" "${PARITY[@]}" --out "$OUT/parity.json"
run_step stage "$(lim 150 120)" "$PY" bench/stage.py "${SMALL[@]}" --out "$OUT/stage.json"
run_step kernel_bench "$(lim 90 120)" "$PY" bench/kernel_bench.py "${KB[@]}" --out "$OUT/kernels.json"
# pipeline_2rank: the 27B block shape as a 2-rank DualPipeV config (1 block per stage), torchrun, trace check.
CFG="$OUT/pipeline_2rank.yaml"
TRACE_DIR="$OUT/pipeline_2rank_trace"
rm -rf "$TRACE_DIR"
run_step pipeline_2rank "$(lim 120 180)" bash -c '
    set -e
    "$0" bench/stage.py "${@:4}" --write-config "$1" --config-ranks 2 --config-blocks-per-stage 1 --config-steps 2
    "$0" -m torch.distributed.run --standalone --nproc-per-node 2 -m pipeline --config "$1" \
        --device "$3" --transport host --steps 2 --trace-dir "$2"
    "$0" bench/gpu_report.py trace-check "$2/trace.json" --ranks 2 --device "$3" --out "$(dirname "$1")/trace_check.json"
' "$PY" "$CFG" "$TRACE_DIR" "$([ "$MODE" = cpu ] && echo cpu || echo cuda)" "${SMALL[@]}"

# world1_nccl: one rank on NCCL (the CPU run: gloo) - the runtime's every blocking collective (barriers, loss and
# statistics all-reduces, clock all-gather), CUDA-event spans and hp stream, and a torch.distributed.checkpoint save
# and resume on the device: 3 steps uninterrupted vs 2 steps + resume, the resumed step's loss must match.
run_step world1_nccl "$(lim 120 240)" bash -c '
    set -e
    W="$1"; rm -rf "$W"; mkdir -p "$W"
    run() { "$0" -m torch.distributed.run --standalone --nproc-per-node 1 -m pipeline --config configs/tiny.yaml \
        --pp 1 --schedule 1f1b --device "$2" "${@:3}"; }
    run "$W" "$2" --steps 3 --trace-dir "$W/trace" | tee "$W/full.log"
    run "$W" "$2" --steps 2 --checkpoint-dir "$W/ckpt"
    run "$W" "$2" --steps 3 --checkpoint-dir "$W/ckpt" --resume | tee "$W/resumed.log"
    "$0" bench/gpu_report.py trace-check "$W/trace/trace.json" --ranks 1 --device "$2" --no-comm \
        --out "$(dirname "$W")/world1_trace_check.json"
    "$0" bench/gpu_report.py resume-check "$W/full.log" "$W/resumed.log" --out "$(dirname "$W")/world1_resume.json"
' "$PY" "$OUT/world1" "$([ "$MODE" = cpu ] && echo cpu || echo cuda)"

# Last: the small-shape kernel tests (CI runs them under the interpreter; here compiled) get what is left.
run_step kernel_tests "$(lim 100 300)" "$PY" -m pytest tests/kernels -x -q -p no:cacheprovider

echo
echo "gpu_check ($MODE) finished in $(elapsed)s of a ${BUDGET}s budget; outputs in $OUT"
"$PY" bench/gpu_report.py table "$OUT" | tee "$OUT/table.txt"
exit "${PIPESTATUS[0]}"
