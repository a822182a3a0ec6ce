"""Faults in a disaggregated `[modules]` run (the encoder on its own rank, train/modules_run.py):
the encoder-only rank runs a loop of its own, not the trainer's, so its death and its stop must
end the job as any rank's do — named, every worker gone — and not leave the decoder waiting at
the seam. Real jobs, real signals, bounded waits (a bound on a hang, not a speed claim)."""

from __future__ import annotations

import os
import signal

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BOUND = 600  # start-up on a loaded 2-core machine: each worker imports torch
STOP_TIMEOUT = 15  # --run.timeout: long enough for gloo to connect on a loaded machine
VLM = [
    "--config",
    os.path.join(ROOT, "configs", "vlm-tiny.toml"),
    "--nproc",
    "2",
    "--modules.encoder_ranks",
    "1",
]
VLM += ["--train.steps", "2000", "--train.global_batch_size", "4", "--train.micro_batch_size", "2"]
VLM += ["--train.eval_interval", "0", "--run.log_interval", "1"]


def test_killed_encoder_rank_ends_the_job_named(start, tmp_path):
    run = tmp_path / "run"
    job = start(VLM + ["--run.dir", str(run)])
    workers = job.workers(2, timeout=BOUND)
    job.wait_rows(run, 2, timeout=BOUND)
    os.kill(workers[1], signal.SIGKILL)
    assert job.finish(60) == 1
    assert "rank 1 was killed by SIGKILL" in job.last_line(), job.stderr[-2000:]
    assert not job.gone(workers)


def test_stopped_encoder_rank_is_named_as_the_root_cause(start, tmp_path):
    """The decoder (rank 0) waits for the encoder's features at the seam; the stopped encoder
    rank is named as the one that stopped making progress."""
    run = tmp_path / "run"
    job = start(VLM + ["--run.dir", str(run)], extra_env={"MESHSPEED_TIMEOUT": str(STOP_TIMEOUT)})
    workers = job.workers(2, timeout=BOUND)
    job.wait_rows(run, 2, timeout=BOUND)
    os.kill(workers[1], signal.SIGSTOP)
    assert job.finish(STOP_TIMEOUT + 60) != 0
    line = job.last_line()
    # where rank 0 waits depends on the moment of the stop (the seam's receive, or the gradient
    # norm both modules join): either way the stopped rank is named first
    assert line.startswith("meshspeed: rank 1 stopped making progress ("), line
    assert f"timed out after {STOP_TIMEOUT}s" in line, line
    assert not job.gone(workers), "a worker outlived the job"


def _p2p_worker(rank: int, port: int, out) -> None:
    from tests.harness import worker_env

    os.environ.update(worker_env(rank, 2, port))
    import torch

    from meshspeed import comm
    from meshspeed.comm.p2p import recv

    torch.set_num_threads(1)
    ctx = comm.init("gloo", timeout_s=4)
    comm.all_reduce(torch.ones(1), ctx.world)  # connected, heartbeats running
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # every thread stops: the heartbeat too
        return
    try:
        recv(torch.empty(4), ctx.world, src=1)
        out.put("no error")
    except Exception as err:  # noqa: BLE001 - the message is what the test checks
        out.put(str(err))


def test_point_to_point_wait_names_a_stopped_peer_as_the_root_cause():
    """The seam's transfers are point to point: a receive from a stopped peer names it as the
    rank that stopped making progress (its heartbeat), as a collective's timeout does."""
    import multiprocessing as mp

    from tests.harness import free_port

    mctx = mp.get_context("spawn")
    out, port = mctx.Queue(), free_port()
    procs = [mctx.Process(target=_p2p_worker, args=(r, port, out), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        msg = out.get(timeout=BOUND)
    finally:
        for p in procs:
            p.kill()
    assert msg.startswith("meshspeed: rank 1 stopped making progress ("), msg
    assert "recv with rank 1 on group world" in msg and "timed out after 4s" in msg, msg
