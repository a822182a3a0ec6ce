"""Planted desyncs and missing ranks must produce the clear errors, on every rank, fast."""

from __future__ import annotations

import json
import os
import re
import time

import torch

from meshspeed import comm
from tests import harness


def job_planted_desync(ctx):
    g = ctx.world
    comm.all_reduce(torch.ones(3), g)  # a matched collective first, so the seq is not trivially 1
    t0 = time.monotonic()
    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    try:
        if ctx.rank == 2:
            comm.all_gather(x, g)
        else:
            comm.all_reduce(x, g)
        return ["no error", time.monotonic() - t0]
    except comm.DesyncError as err:
        return [str(err), time.monotonic() - t0]


def test_planted_desync_names_the_odd_rank_on_every_rank():
    results = harness.run(4, job_planted_desync, debug=True, timeout_s=10)
    for msg, elapsed in results:
        assert re.search(
            r"rank 2 called all_gather\(\[4, 8\] bf16\) at seq \d+ where ranks 0,1,3 called "
            r"all_reduce\(\[4, 8\] bf16\)",
            msg,
        ), msg
        # found by the signature check, not by the collective's 10 s timeout firing first
        assert elapsed < 10, f"desync reported after {elapsed:.1f}s: the timeout fired first"
    assert len({m for m, _ in results}) == 1  # every rank reports the same thing


def job_desync_in_details(ctx):
    """Same op and shape but a different reduce op, and a splits mismatch in all_to_all."""
    g, out = ctx.world, []
    try:
        comm.all_reduce(torch.ones(2), g, "max" if ctx.rank == 1 else "sum")
    except comm.DesyncError as err:
        out.append(str(err))
    ins = [1] * g.size
    outs = [1] * g.size
    if ctx.rank == 0:
        outs[1] = 2  # rank 0 expects 2 rows from rank 1, which sends 1
    try:
        comm.all_to_all(torch.ones(g.size, 2), g, ins, outs)
    except comm.DesyncError as err:
        out.append(str(err))
    return out


def test_desync_in_reduce_op_and_all_to_all_splits():
    for msgs in harness.run(3, job_desync_in_details, debug=True, timeout_s=10):
        assert re.search(
            r"rank 1 called all_reduce\(\[2\] fp32 op=max\) at seq \d+ where ranks 0,2 called "
            r"all_reduce\(\[2\] fp32 op=sum\)",
            msgs[0],
        ), msgs
        assert "rank 1 sends 1 rows to rank 0" in msgs[1] and "rank 0 expects 2" in msgs[1], msgs


def job_missing_rank(ctx, algo):
    """Rank 3 never joins the collective; the others must name it within the timeout."""
    if ctx.rank == 3:
        return ["absent", 0.0]
    t0 = time.monotonic()
    try:
        comm.all_reduce(torch.ones(64), ctx.world, algo=algo)
        return ["no error", time.monotonic() - t0]
    except comm.CollectiveTimeout as err:
        return [str(err), time.monotonic() - t0]


def _check_missing(results, timeout_s):
    for rank, (msg, elapsed) in enumerate(results[:3]):
        assert "rank 3 did not arrive" in msg and "ranks 0,1,2 are waiting in it" in msg, msg
        assert "last collectives on this rank" in msg and "all_reduce([64] fp32)" in msg, msg
        # timeout + the grace period that lets the other waiting ranks report themselves
        assert elapsed < timeout_s + 4, f"rank {rank} took {elapsed:.1f}s"


def test_missing_rank_is_named_native_path():
    results = harness.run(4, job_missing_rank, "native", timeout_s=2, fresh_after=True)
    _check_missing(results, 2)


def test_missing_rank_is_named_algorithm_path():
    results = harness.run(4, job_missing_rank, "ring", timeout_s=2, fresh_after=True)
    _check_missing(results, 2)


def test_missing_rank_is_named_in_debug_mode_before_the_collective():
    results = harness.run(4, job_missing_rank, None, debug=True, timeout_s=2, fresh_after=True)
    _check_missing(results, 2)
    assert "before it started" in results[0][0]


def job_flight_recorder(ctx, trace_dir):
    g = ctx.world
    ctx.recorder.entries.clear()
    for _ in range(3):
        comm.all_reduce(torch.ones(5), g)
    comm.all_gather(torch.ones(2, dtype=torch.bfloat16), g, algo="ring")
    h = comm.reduce_scatter(torch.ones(4 * g.size), g, async_op=True)
    pending_state = ctx.recorder.entries[-1]["state"]
    h.wait()
    ctx.trace_dir = trace_dir
    path = ctx.dump_trace()
    return [path, pending_state, ctx.recorder.entries.maxlen]


def test_flight_recorder_records_and_dumps(tmp_path):
    results = harness.run(2, job_flight_recorder, str(tmp_path), trace_dir=None)
    for rank, (path, pending_state, cap) in enumerate(results):
        assert pending_state == "started" and cap == 2000
        data = json.load(open(path))
        assert data["rank"] == rank
        ops = [(e["op"], e["dtype"], e["algo"], e["state"]) for e in data["entries"]]
        assert ops[:3] == [("all_reduce", "fp32", "native", "completed")] * 3
        assert ops[3] == ("all_gather", "bf16", "ring", "completed")
        assert ops[4][0] == "reduce_scatter" and ops[4][3] == "completed"
        seqs = [e["seq"] for e in data["entries"]]
        assert seqs == sorted(seqs) and len(set(seqs)) == 5
        assert all(e["end"] >= e["start"] for e in data["entries"])
    assert sorted(os.listdir(tmp_path)) == ["flight_rank0.json", "flight_rank1.json"]


def test_recorder_is_bounded():
    from meshspeed.comm.trace import FlightRecorder

    rec = FlightRecorder(0, capacity=4)
    for i in range(10):
        rec.finish(rec.record(i, "g", "all_reduce", [1], "fp32", "native", 4))
    assert [e["seq"] for e in rec.entries] == [6, 7, 8, 9]
    assert "seq     9" in rec.format_tail(2) and "seq     7" not in rec.format_tail(2)
