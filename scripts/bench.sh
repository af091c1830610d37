#!/usr/bin/env bash
# Set up and run the default benchmark (a small config on whatever device is
# here, CPU included). Extra arguments go to `python -m longattn.bench`.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch" 2>/dev/null || pip install -q torch==2.13.0
pip install -q -e ".[bench]"
python -m longattn.bench "$@"
