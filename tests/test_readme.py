"""The README's Python snippets run as written (on CPU here), and the ring
example it shows is examples/ring_attention.py, run under torchrun."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RING = os.path.join(ROOT, "examples", "ring_attention.py")


def _python_blocks() -> list[str]:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)


def _env() -> dict:
    # what a user's shell has: no Triton interpreter (the test script turns it on for the kernels' tests)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))
    return env


def test_readme_ring_snippet_is_the_example_script():
    ring = [b for b in _python_blocks() if "ring_attention" in b]
    assert len(ring) == 1
    with open(RING, encoding="utf-8") as f:
        assert ring[0] == f.read()


def test_readme_snippets_run():
    blocks = [b for b in _python_blocks() if "init_process_group" not in b]  # the ring script: test below
    assert blocks
    for code in blocks:
        res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True,
                             timeout=300)
        assert res.returncode == 0, f"README snippet failed:\n{code}\n{res.stderr[-3000:]}"


@pytest.mark.dist
def test_ring_example_runs_under_torchrun():
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", RING], cwd=ROOT,
                         env=_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    m = re.search(r"2 ranks, 2048 tokens \(1024 per rank.*relative difference from one-device attention (\S+)",
                  res.stdout)
    assert m, res.stdout
    assert float(m.group(1)) < 1e-5
