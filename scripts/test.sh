#!/usr/bin/env bash
# The whole CPU test suite; Triton kernels run under the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
export TRITON_INTERPRET=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
python -m pytest -q -x --durations=15 "$@"
