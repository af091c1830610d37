import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
# Triton autotuning compiles every candidate tile per new shape: minutes over the
# GPU suite's many shapes. Tests that check it turn it on themselves.
os.environ.setdefault("LONGATTN_TRITON_AUTOTUNE", "0")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped on CPU")
    config.addinivalue_line("markers", "multigpu: needs several CUDA GPUs visible at once (with gpu; "
                                       "scripts/test_gpu.sh runs these last, every GPU visible)")
    config.addinivalue_line("markers", "dist: spawns gloo process groups")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
