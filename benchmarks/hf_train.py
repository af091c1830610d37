"""Kept for the commands in docs/performance.md: the benchmark is
``python -m longattn.bench hf-train`` (longattn/bench/hf_train.py); this file
runs it with the same arguments (also under torchrun)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from longattn.bench.hf_train import main  # noqa: E402

if __name__ == "__main__":
    main()
