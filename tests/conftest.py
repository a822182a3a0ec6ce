"""Session-wide test settings."""

import torch

# The distributed tests keep pools of worker processes on the same two cores; a multi-threaded
# main process would fight them for the CPU and slow every test down.
torch.set_num_threads(1)


def pytest_runtest_setup(item):
    # idle worker pools burn CPU (their gloo groups poll): stop those no test has used lately
    from tests import harness

    harness.stop_idle_pools()
