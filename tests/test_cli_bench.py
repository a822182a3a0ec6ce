"""`meshspeed bench comm` end to end: spawned workers, a real torchrun launch, bad input."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests import cli_batch, warm

KEYS = {
    "op",
    "algo",
    "bytes",
    "count",
    "dtype",
    "time_us",
    "algbw_gbps",
    "busbw_gbps",
    "wrong",
    "raw_busbw_gbps",
}


def _env(tmp_path):
    env = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MESHSPEED_ALGO"):
        env.pop(k, None)
    env["MESHSPEED_LINK_PARAMS"] = str(tmp_path / "link_params.json")
    return env


def _run(args, tmp_path, timeout=240):
    return warm.run(args, env=_env(tmp_path), capture_output=True, text=True, timeout=timeout, cwd=tmp_path)


def test_bench_comm_spawned_checks_plots_and_fits(tmp_path):
    out = _run(
        [
            sys.executable,
            "-m",
            "meshspeed",
            "bench",
            "comm",
            "--nproc",
            "3",
            "--ops",
            "all_reduce,all_gather,reduce_scatter,broadcast,all_to_all",
            "--min-bytes",
            "1K",
            "--max-bytes",
            "4K",
            "--iters",
            "8",
            "--warmup",
            "1",
            "--algo",
            "all",
            "--check",
            "--json",
            "rows.json",
            "--plot",
            "bw.png",
        ],
        tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.load(open(tmp_path / "rows.json"))
    assert rows and all(KEYS <= r.keys() for r in rows)
    assert all(r["wrong"] == 0 for r in rows)
    assert {r["op"] for r in rows} == {
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "broadcast",
        "all_to_all",
    }
    # every applicable algorithm ran beside the default path, each with the raw call's busbw
    assert {r["algo"] for r in rows if r["op"] == "all_reduce"} == {"auto", "native", "ring", "hd"}
    assert {r["algo"] for r in rows if r["op"] == "reduce_scatter"} == {"auto", "native", "ring", "bruck"}
    assert all(r["raw_busbw_gbps"] > 0 and r["time_us"] > 0 for r in rows)
    assert [r["bytes"] for r in rows if r["op"] == "all_gather" and r["algo"] == "auto"] == [1020, 2040, 4092]
    assert (tmp_path / "bw.png").stat().st_size > 10_000
    params = json.load(open(tmp_path / "link_params.json"))["gloo"]
    assert params["values"]["p2p.intra"][0] > 0 and "fitted" in params
    assert "# default path (auto) busbw / raw busbw" in out.stdout and "# wrong elements: 0" in out.stdout
    assert "cost model: median |predicted - measured|" in out.stdout
    # the fit's error per collective, the choices runs will make, and where they were saved
    assert all(
        f"{op} " in out.stdout.split("per op:")[1].splitlines()[0] for op in ("all_reduce", "all_to_all")
    )
    assert "later runs on this machine" in out.stdout and str(tmp_path / "link_params.json") in out.stdout
    # what was measured is kept, with the machine it was measured on, and decides the choices:
    # a runs' choice at each measured size is the algorithm timed fastest there
    from meshspeed.comm import cost_model

    saved = cost_model.LinkParams.from_dict(params)
    assert saved.machine == cost_model.this_machine()
    quiet = [r for r in rows if not r["noisy"] and r["op"] != "broadcast"]
    assert {op for op in saved.measured} == {r["op"] for r in quiet}
    for op, entries in saved.measured.items():
        for e in entries:
            fastest = min(e["us"], key=lambda a: (e["us"][a], a != "native"))
            assert cost_model.choose(op, e["bytes"], [0, 0, 0], "gloo", saved) == fastest, (op, e)


def test_bench_comm_under_torchrun(tmp_path):
    from meshspeed.comm.launch import free_port

    out = _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(free_port()),
            "-m",
            "meshspeed",
            "bench",
            "comm",
            "--ops",
            "all_gather,reduce_scatter",
            "--min-bytes",
            "2K",
            "--max-bytes",
            "2K",
            "--iters",
            "8",
            "--warmup",
            "1",
            "--check",
            "--json",
            "rows.json",
            "--no-save",
        ],
        tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.load(open(tmp_path / "rows.json"))
    assert len(rows) == 2 and all(r["wrong"] == 0 for r in rows)
    assert not (tmp_path / "link_params.json").exists()  # --no-save


_BAD_BENCH: dict = {}


def _bad_bench_results(tmp_path_factory) -> dict:
    """Every bad-input case in one interpreter (tests/cli_batch.py): one torch import, not six."""
    if not _BAD_BENCH:
        cases = [a for a, _ in BAD_BENCH_INPUTS] + [["--help"], ["bench", "comm", "--help"]]
        argvs = [["bench", "comm", *a] if a[0].startswith("--") and a != ["--help"] else a for a in cases]
        tmp = tmp_path_factory.mktemp("bad-bench")
        env = _env(tmp)
        for argv, res in zip(argvs, cli_batch.run_many(argvs, tmp, env=env)):
            _BAD_BENCH[tuple(argv)] = res
    return _BAD_BENCH


BAD_BENCH_INPUTS = [
    (["--ops", "gather"], "--ops 'gather': unknown gather; valid: all_reduce, all_gather"),
    (["--algo", "tree"], "--algo 'tree': unknown tree; valid: auto, all,"),
    (["--min-bytes", "8M", "--max-bytes", "1K"], "--min-bytes 8M is larger than --max-bytes 1K"),
    (["--min-bytes", "lots"], "size 'lots' is not a size"),
    (["--nproc", "1"], "--nproc 1: bench comm needs at least 2 ranks"),
    (["--dtype", "float8"], "--dtype 'float8' is not supported"),
]


@pytest.mark.parametrize("args,needle", BAD_BENCH_INPUTS)
def test_bench_comm_bad_input_is_one_clear_line(tmp_path_factory, args, needle):
    out = _bad_bench_results(tmp_path_factory)[("bench", "comm", *args)]
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], out.stderr


def test_help_texts(tmp_path_factory):
    results = _bad_bench_results(tmp_path_factory)
    for args in (["--help"], ["bench", "comm", "--help"]):
        out = results[tuple(args)]
        assert out.returncode == 0 and "usage: meshspeed" in out.stdout, out
    out = results[("bench", "comm", "--help")]
    for flag in (
        "--ops",
        "--min-bytes",
        "--max-bytes",
        "--factor",
        "--dtype",
        "--warmup",
        "--iters",
        "--algo",
        "--check",
        "--nproc",
        "--json",
        "--plot",
    ):
        assert flag in out.stdout
