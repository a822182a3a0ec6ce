"""A peer that dies (or gives up after its own timeout) mid-collective closes its gloo
connections; the ranks still waiting must get meshspeed's diagnosis naming the rank that never
arrived, not gloo's bare "Connection closed by peer" (seen under heavy load, where one rank's
deadline passes well before another's). Real processes, a real os._exit, a bounded wait."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import sys
import time

import pytest

from tests.harness import free_port, worker_env

DEADLINE_S = 60  # a bound on a hang, not a speed claim (the diagnosis waits a 3 s grace)


def _worker(rank: int, ws: int, port: int, algo: str, out) -> None:
    os.environ.update(worker_env(rank, ws, port))
    import torch

    from meshspeed import comm

    torch.set_num_threads(1)
    ctx = comm.init("gloo", timeout_s=6)  # the death comes at ~0.3 s: the error is not our own timeout
    comm.all_reduce(torch.ones(4), ctx.world)  # every pair connected before the death
    if rank == ws - 1:
        time.sleep(0.3)
        os._exit(3)
    try:
        comm.all_reduce(torch.ones(64), ctx.world, algo=algo)
        out.put((rank, "no error", ""))
    except Exception as err:  # noqa: BLE001 - the message is what the test checks
        out.put((rank, type(err).__name__, str(err)))
    sys.stdout.flush()


@pytest.mark.parametrize("algo", ["native", "ring"])
def test_dead_peer_is_named_not_a_socket_error(algo):
    mctx = mp.get_context("spawn")
    out, port, ws = mctx.Queue(), free_port(), 3
    procs = [mctx.Process(target=_worker, args=(r, ws, port, algo, out), daemon=True) for r in range(ws)]
    for p in procs:
        p.start()
    try:
        got = {}
        deadline = time.monotonic() + DEADLINE_S
        while len(got) < ws - 1:
            rank, kind, msg = out.get(timeout=max(0.1, deadline - time.monotonic()))
            got[rank] = (kind, msg)
    except queue.Empty:
        pytest.fail(f"ranks {sorted(set(range(ws - 1)) - set(got))} hung after their peer died")
    finally:
        for p in procs:
            p.kill()
    for rank, (kind, msg) in got.items():
        assert kind == "CollectiveTimeout", (rank, kind, msg)
        assert "a peer closed its connection (Connection closed by peer" in msg, msg
        assert "rank 2 did not arrive (ranks 0,1 are waiting in it)" in msg, msg
        assert f"all_reduce([64] fp32) algo={algo}" in msg, msg
