#!/usr/bin/env bash
# Set up (CPU torch if none is installed, the package with test extras) and run
# the whole test suite. Triton kernels run under the CPU interpreter; GPU-only
# tests skip on machines without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch" 2>/dev/null || pip install -q torch==2.13.0
pip install -q -e ".[test]"
export TRITON_INTERPRET=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
python -m pytest -q --durations=15 "$@"
