"""Jobs for test_start_method, each run as `python -m tests.faults.fork_jobs CASE` in a fresh
process: single-threaded, as the CLI's launcher is when it may fork its workers."""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

from meshspeed.comm import launch

SEEN_BY = "a fresh import"  # the launcher sets it before starting workers: a forked one sees it


def silent_exit() -> None:
    """Rank 1 dies without a report; rank 0 would sleep far past the test's bound."""
    if os.environ["RANK"] == "1":
        print(f"rank 1: {SEEN_BY}", flush=True)
        os._exit(3)
    time.sleep(120)


def handlers() -> None:
    """The launcher's own SIGTERM/SIGHUP handlers must not survive into a forked worker."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is not signal.SIG_DFL:
            raise RuntimeError(f"{signal.Signals(sig).name} handler inherited: {signal.getsignal(sig)}")
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        raise RuntimeError("SIGINT handler inherited")
    print(f"rank {os.environ['RANK']}: {SEEN_BY}, handlers default", flush=True)


def main(case: str) -> int:
    global SEEN_BY
    if case == "method":
        allowed = launch.start_method(True, ("meshspeed.train.trainer",))
        refused = launch.start_method(False)
        torch.set_num_threads(2)  # a CPU op now starts the OpenMP pool: not safe to fork any more
        torch.randn(512, 512) @ torch.randn(512, 512)
        print(allowed, refused, launch.start_method(True))
        return 0
    SEEN_BY = "the launcher"
    return launch.spawn({"silent_exit": silent_exit, "handlers": handlers}[case], 2, fork_ok=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
