"""The multi-process harness of the distributed tests: a rank that dies
during its checks fails the test; one that aborts in teardown, after every
rank passed its checks and the barrier, is reported as a warning."""
import os

import pytest
import torch.multiprocessing as mp

from dist_utils import at_teardown, run_world


def _abort_in_teardown(rank, world):
    if rank == 1:
        at_teardown(os.abort)  # runs after the harness's barrier, marker and destroy


def _abort_in_checks(rank, world):
    if rank == 1:
        os.abort()


@pytest.mark.dist
def test_teardown_abort_after_all_checks_is_a_warning():
    with pytest.warns(UserWarning, match="teardown"):
        run_world(_abort_in_teardown, 2)


@pytest.mark.dist
def test_abort_during_checks_fails():
    with pytest.raises(mp.ProcessExitedException):
        run_world(_abort_in_checks, 2)
