#!/usr/bin/env bash
# The GPU suite in one command (docs/gpu.md).  From the repository root of a machine with a
# CUDA GPU, offline:
#
#     tools/gpu-suite.sh [WHEEL_DIR]        run it: tests/gpu, then benchmarks/gpu.py
#     tools/gpu-suite.sh --prepare [DIR]    on a machine with a package index: download the
#                                           wheels the GPU machine lacks into DIR (default .whl,
#                                           git-ignored), to be carried there
#
# Running: taas is used from this checkout (PYTHONPATH; nothing is built or installed); the
# wheels in WHEEL_DIR (default .whl), if any, are installed with --no-index (the Jupyter packages
# the real-kernel check needs; without them that check is skipped and the rest runs); then
# `pytest tests/gpu` and `python benchmarks/gpu.py`.  Logs and figures go to $OUT if it is set,
# else ./gpu-suite-out: env.txt, gpu-tests.log, gpu-tests.xml, gpu-bench.txt, gpu-bench.json.
# Exit status: non-zero if the tests or the benchmark failed.  Nothing is downloaded.
#
# PYTHON names the interpreter (default python3: the one with torch).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# What the GPU machine lacks (its image has torch, pytest, psutil, cloudpickle, transformers...):
# the Jupyter stack for the real-kernel check.  pip resolves their dependencies when it downloads.
WHEELS="ipykernel jupyter_client pyzmq nbval ipython"

if [ "${1:-}" = "--prepare" ]; then
    dir=${2:-.whl}
    mkdir -p "$dir"
    # Python 3.12 x86-64 wheels, whatever this machine runs; pure-Python ones match any platform.
    exec "$PY" -m pip download --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d "$dir" $WHEELS
fi

wheels=${1:-.whl}
out=${OUT:-./gpu-suite-out}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1

{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv 2>&1 || echo "no nvidia-smi"
    "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.version.cuda, "available", torch.cuda.is_available(), "nccl",
torch.cuda.nccl.version() if torch.cuda.is_available() else None)'
} 2>&1 | tee "$out/env.txt"

if ls "$wheels"/*.whl >/dev/null 2>&1; then
    echo "installing carried wheels from $wheels" | tee -a "$out/env.txt"
    "$PY" -m pip install -q --no-index --find-links "$wheels" $WHEELS 2>&1 | tee -a "$out/env.txt"
else
    echo "no wheels in $wheels: the real-kernel check is skipped" | tee -a "$out/env.txt"
fi

# --confcutdir: tests/conftest.py (the real-kernel fixtures) imports jupyter_client; the GPU
# suite's own conftest is all it needs.
"$PY" -m pytest -v -p no:cacheprovider --confcutdir=tests/gpu -rs --junitxml="$out/gpu-tests.xml" \
    tests/gpu 2>&1 | tee "$out/gpu-tests.log"
tests=${PIPESTATUS[0]}

"$PY" benchmarks/gpu.py --json "$out/gpu-bench.json" 2>&1 | tee "$out/gpu-bench.txt"
bench=${PIPESTATUS[0]}

echo "gpu suite: tests exit $tests, benchmark exit $bench (logs in $out)"
[ "$tests" = 0 ] && [ "$bench" = 0 ]
