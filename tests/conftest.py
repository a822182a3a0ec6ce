"""Session-wide test settings."""

import importlib.util
import os

import pytest
import torch


def _triton_ready_for_its_interpreter() -> None:
    """Import Triton once with TRITON_INTERPRET=1, then restore the variable. The kernel tests
    set it before building their kernels, but Triton keeps some state from its first import:
    imported first without it (diffusers imports torch ops that define Triton kernels), its
    interpreter later fails ("Cannot call @triton.jit'd outside of the scope of a kernel")."""
    if torch.cuda.is_available() or importlib.util.find_spec("triton") is None:
        return
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language  # noqa: F401
    except Exception:  # a broken Triton install: the kernel tests skip or say so themselves
        pass
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before


_triton_ready_for_its_interpreter()

# The distributed tests keep pools of worker processes on the same two cores; a multi-threaded
# main process would fight them for the CPU and slow every test down.
torch.set_num_threads(1)


def pytest_runtest_setup(item):
    # Pools live across files (an idle worker costs about 1% of a core: see tests/harness.py);
    # only those no test has used for a long while are stopped, to give their memory back.
    from tests import harness

    harness.stop_idle_pools()


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
