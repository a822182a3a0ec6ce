"""Session-wide test settings."""

import inspect
import re

import pytest
import torch

# The distributed tests keep pools of worker processes on the same two cores; a multi-threaded
# main process would fight them for the CPU and slow every test down.
torch.set_num_threads(1)


_USES_POOLS: dict[str, bool] = {}
_LAUNCHES = re.compile(r"subprocess|procs\.|cli_batch|sys\.executable")


def _launches(item) -> bool:
    """The test's own body starts processes (a launched CLI run): no pool job runs meanwhile."""
    try:
        return bool(_LAUNCHES.search(inspect.getsource(item.function)))
    except (AttributeError, OSError, TypeError):
        return False


def pytest_runtest_setup(item):
    # Idle worker pools burn CPU (each gloo group's loop thread wakes about 1.6% of a core, and
    # a worker holds dozens): before a test of a file that never runs a job on them, or a test
    # that launches processes itself, every pool is stopped; otherwise those no test has used
    # lately. Measured: with the comm tests' pools left alive, the first launched-checkpoint
    # test took 204 s, and 75 s with them stopped.
    from tests import harness

    path = str(item.path)
    if path not in _USES_POOLS:
        with open(path) as f:
            _USES_POOLS[path] = "harness" in f.read()
    harness.stop_idle_pools(everything=not _USES_POOLS[path] or _launches(item))


@pytest.hookimpl(tryfirst=True)  # before `-m 'not slow'` deselects
def pytest_collection_modifyitems(config, items):
    # the slow tier is listed in one place, each entry with the CI test that keeps its claim
    from tests.tiers import SLOW

    # files collected whole (not narrowed to some of their tests by a node id on the command line)
    roots = [a.rstrip("/") for a in config.args if "::" not in a]
    files = {
        f
        for f in {item.nodeid.split("::")[0] for item in items}
        if any(f == r or f.startswith(r + "/") or r in ("", ".", "tests") for r in roots)
    }
    used = set()
    for item in items:
        for key in (item.nodeid, item.nodeid.split("[")[0]):
            if key in SLOW:
                item.add_marker(pytest.mark.slow)
                used.add(key)
    stale = [k for k in SLOW if k.split("::")[0] in files and k not in used]
    if stale and not config.getoption("keyword") and not config.getoption("deselect"):
        raise pytest.UsageError(f"tests/tiers.py names tests that do not exist: {stale}")
