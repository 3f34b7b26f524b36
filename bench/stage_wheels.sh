#!/usr/bin/env bash
# Stage the wheels the GPU machine lacks into .whl/ (git-ignored), once, on a machine with network.
#
#   bash bench/stage_wheels.sh            # into .whl/ at the repository root
#   WHEEL_DIR=/some/dir bash bench/stage_wheels.sh
#
# Why: the lent GPU machine has no network, and its image (Python 3.12, torch 2.11) lacks pydantic (with
# pydantic-core, annotated-types, typing-inspection), the nvtx package and PyYAML, and may lack pytest
# (docs/gpu.md). bench/gpu_check.sh installs what is missing from this folder with `pip --no-index`; the device
# tool carries it (`carry: [".whl"]`), and a carry holds 64 MiB in all, so this script refuses a folder above
# 48 MiB (the rest is left for the working tree). Only cp312 manylinux x86_64 wheels (or pure-Python ones) are
# fetched: the GPU image's interpreter, not this machine's.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DIR=${WHEEL_DIR:-$ROOT/.whl}
PY=${PYTHON:-python3}
LIMIT_MIB=48
# typing-extensions: pydantic needs a newer one than some images ship; pip --target installs it next to pydantic.
# pytest with its own dependencies: the kernel_tests step; the image usually has pytest, a fresh one may not.
PACKAGES=(pydantic pydantic-core annotated-types typing-inspection typing-extensions nvtx pyyaml
          pytest pluggy iniconfig packaging)

mkdir -p "$DIR"
"$PY" -m pip download --disable-pip-version-check --quiet --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    -d "$DIR" "${PACKAGES[@]}"

mib=$(du -sm "$DIR" | cut -f1)
count=$(find "$DIR" -type f -name '*.whl' | wc -l)
echo "staged $count wheels, ${mib} MiB, in $DIR:"
find "$DIR" -type f -name '*.whl' -printf '  %f\n' | sort
if [ "$mib" -gt "$LIMIT_MIB" ]; then
    echo "stage_wheels.sh: $DIR holds ${mib} MiB, over the ${LIMIT_MIB} MiB left for it in a 64 MiB carry;" \
         "delete old wheels there (rm -r $DIR) and run this again" >&2
    exit 1
fi
