#!/usr/bin/env bash
# Set up (CPU torch if none is installed, the package with test extras) and run
# the whole test suite. Triton kernels run under the CPU interpreter; GPU-only
# tests skip on machines without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch" 2>/dev/null || pip install -q torch==2.13.0
pip install -q -e ".[test]"
# two pytest workers (pytest-xdist), one thread each: most of the suite is single-threaded Python (the Triton
# interpreter, spawned gloo worlds), so on 2 cores two workers take about three quarters of one's wall time
export TRITON_INTERPRET=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
python -m pytest -q -n 2 --durations=15 "$@"
