"""Worker functions for tests/faults/test_run_leftovers.py, launched with `launch.spawn` from a
`python -c` line (importable, so spawned workers find them too)."""

from __future__ import annotations

import os
import time


def linger() -> None:
    """Rank 0 finishes at once; rank 1 never returns (the test stops the job)."""
    with open(f"pid-{os.environ['RANK']}", "w") as f:
        f.write(str(os.getpid()))
    if os.environ["RANK"] == "1":
        time.sleep(600)
