#!/usr/bin/env bash
# Install memplan with its test extras and run the suite (the README's test command; .ci/run calls it).
# torch is installed first, pinned: an open range would pull the multi-GB CUDA wheels, which the
# tests do not need (they run on the CPU; CUDA tests are marked and skip without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q "torch==2.13.0"
"$PY" -m pip install -q -e ".[test]"
# DeepSpeedCPUAdam (the offload plans' optimizer, which tests/test_emit_e2e.py trains with) is built by
# g++ on a machine's first use, ~150 s, then cached in ~/.cache/torch_extensions: build it here, with the
# rest of the set-up, so that the suite's time is the tests'.
"$PY" -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()" >/dev/null 2>&1 \
  || { echo "set-up: DeepSpeedCPUAdam did not build (needs g++); see tests/test_emit_e2e.py" >&2; exit 1; }
# Two workers (pytest-xdist), a test file each at a time: the suite is mostly CPU-bound traces and
# subprocesses, and this machine has two cores.
"$PY" -m pytest -q -n 2 --dist loadfile "$@"
