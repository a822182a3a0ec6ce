"""`meshspeed plan`: every proposed layout passes the run plan, its memory is the run plan's own
estimate, the ranking follows the machine it is given, and the best layout is one flag away."""

from __future__ import annotations

import dataclasses
import json

import pytest

from meshspeed.cli import main
from meshspeed.comm import ConfigError
from meshspeed.plan import config
from meshspeed.plan.machine import MACHINES, get_machine
from meshspeed.plan.planner import apply_settings, evaluate, layout_overrides, rank_layouts
from meshspeed.plan.run_plan import make_plan

# a small space: micro-batch and cp pinned, so the search is a few dozen run plans
FIXED = {"train.micro_batch_size": 2, "parallel.cp": 1}


def _tiny(**over):
    return config.load(None, [("train.global_batch_size", "8"), *over.items()])


@pytest.fixture(scope="module")
def ranked():
    cfg = _tiny()
    return cfg, rank_layouts(cfg, 4, MACHINES["cpu"], FIXED)


def test_every_layout_passes_the_run_plan_and_its_memory_is_the_plans(ranked):
    cfg, (ok, rejected) = ranked
    assert len(ok) >= 4 and {r["settings"]["parallel.tp"] for r in ok} >= {1, 2}
    assert any(r["settings"]["parallel.pp"] > 1 for r in ok)
    for r in ok[:6]:
        plan = make_plan(apply_settings(cfg, r["settings"], 4), 4, local_gpus=0, local_ranks=0)
        counted = max(rank["memory"]["total"] for rank in plan.ranks)  # every rank, not representatives
        assert r["predicted"]["memory_bytes"] == counted, r["settings"]
        assert r["predicted"]["bubble"] == plan.bubble
    times = [r["predicted"]["step_s"] for r in ok]
    assert times == sorted(times)


def test_a_layout_the_run_plan_refuses_is_rejected_with_its_line():
    cfg = _tiny()
    r = evaluate(cfg, 4, MACHINES["cpu"], {"parallel.tp": 3, "parallel.pp": 1})
    assert "parallel.tp=3" in r["rejected"]


def test_memory_decides_recompute_and_zero():
    """A device too small for the plain layout gets the first rung of the ladder that fits (ZeRO
    pinned, so the ladder is recompute none -> selective -> full)."""
    cfg = _tiny(**{"train.seq_len": "256"})
    s = {
        "parallel.tp": 1,
        "parallel.pp": 1,
        "parallel.cp": 1,
        "train.micro_batch_size": 2,
        "parallel.zero": 2,
    }
    need = {}
    for rc in ("none", "full"):
        r = evaluate(cfg, 4, MACHINES["cpu"], {**s, "memory.recompute": rc})
        need[rc] = r["predicted"]["memory_bytes"]
    assert need["full"] < need["none"]
    gib = (need["full"] + need["none"]) / 2 / 2**30  # between the two: only recompute fits
    machine = dataclasses.replace(MACHINES["cpu"], memory_gib=gib)
    ok, rejected = rank_layouts(cfg, 4, machine, {k: v for k, v in s.items()}, headroom=0.0)
    assert ok and ok[0]["settings"]["memory.recompute"] != "none"
    assert any(r["rejected"].startswith("memory") for r in rejected)


def test_tensor_parallel_across_a_slow_link_loses_to_pipeline():
    """Hand-checked: at tp 2 each layer exchanges activations four times per micro-batch; pp 2
    sends one activation per micro-batch. Across nodes on a 1 GB/s link tp must lose; inside a
    node on NVLink its exchange is cheap."""
    cfg = config.load(
        "configs/llama3-8b.toml", [("train.global_batch_size", "16"), ("train.seq_len", "4096")]
    )
    cfg.data.path = ""
    tp2 = {"parallel.tp": 2, "parallel.pp": 1, "parallel.sequence_parallel": True, "memory.recompute": "full"}
    pp2 = {
        "parallel.tp": 1,
        "parallel.pp": 2,
        "parallel.sequence_parallel": False,
        "memory.recompute": "full",
    }
    slow = get_machine("h100", gpus_per_node=1, inter_gbs=1.0, memory_gib=1000)
    fast = get_machine("h100", gpus_per_node=2, memory_gib=1000)
    t = {
        (m.name + str(m.gpus_per_node), k): evaluate(cfg, 2, m, s)["predicted"]
        for m in (slow, fast)
        for k, s in (("tp", tp2), ("pp", pp2))
    }
    assert t[("h1001", "pp")]["step_s"] < t[("h1001", "tp")]["step_s"]
    assert t[("h1001", "tp")]["comm_s"]["tp"] > 50 * t[("h1002", "tp")]["comm_s"]["tp"]


def test_plan_json_then_layout_from(tmp_path, capsys):
    args = ["--nproc", "4", "--device", "cpu", "--train.global_batch_size", "8"]
    args += ["--train.micro_batch_size", "2", "--parallel.cp", "1", "--memory.recompute", "none"]
    assert main(["plan", *args, "--json", "--top", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    best = out["layouts"][0]
    assert out["world_size"] == 4 and set(best["predicted"]) >= {
        "step_s",
        "tokens_per_s",
        "mfu",
        "memory_bytes",
    }
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(out))
    assert (
        main(["train", "--layout-from", str(path), "--train.global_batch_size", "8", "--dry-run", "--json"])
        == 0
    )
    plan = json.loads(capsys.readouterr().out)
    for key in ("tp", "pp", "cp"):
        assert plan["dims"][key] == best["settings"][f"parallel.{key}"]
    assert plan["world_size"] == 4 and plan["config"]["parallel"]["zero"] == best["settings"]["parallel.zero"]


@pytest.mark.parametrize(
    "body, needle",
    [
        ("not json", "not a readable JSON file"),
        ('{"layouts": []}', "no layouts"),
        ('{"layouts": [{"settings": {"train.lr": 1}}]}', "must map the planner's keys"),
        ('{"layouts": [{"settings": {"parallel.tp": [2]}}]}', r"parallel.tp=\[2\] must be a whole number"),
    ],
)
def test_layout_from_a_bad_file_is_one_line(tmp_path, body, needle):
    path = tmp_path / "plan.json"
    path.write_text(body)
    with pytest.raises(ConfigError, match=needle) as e:
        layout_overrides(str(path))
    assert str(path) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--nodes", "2"], "--gpus-per-node"),
        (["--device", "tpu9"], "is not known"),
        (["--headroom", "1.5"], "--headroom"),
        (["--memory-gib", "-1"], "must be > 0"),
    ],
)
def test_bad_arguments_are_one_line(capsys, argv, needle):
    assert main(["plan", "--nproc", "4", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and err.count("\n") == 0


def test_calibrate_takes_the_links_bench_comm_fitted(tmp_path, monkeypatch, capsys):
    """`bench comm` stores one fit per collective; --calibrate's machine takes their median, not
    the built-in defaults it read before (30 µs and 2.5 GB/s whatever was measured)."""
    from meshspeed.plan import machine

    fits = {  # (α s, β s/B, γ): medians α 1.2 ms, β 5e-9 s/B (0.2 GB/s)
        "native:all_gather.intra": [1.7e-3, 4e-9, 0.0],
        "native:all_reduce.intra": [1.4e-3, 3e-9, 0.0],
        "native:reduce_scatter.intra": [1.2e-3, 5e-9, 0.0],
        "native:all_to_all.intra": [1.0e-3, 6e-9, 0.0],
        "native:broadcast.intra": [0.6e-3, 7e-9, 0.0],
        "p2p.intra": [9e-3, 9e-9, 0.0],  # point to point is not the collectives' link
    }
    links = tmp_path / "links.json"
    from meshspeed.comm.cost_model import this_machine

    # as bench comm writes it: the machine it measured (a file from elsewhere is ignored)
    saved = {"values": fits, "source": "test", "measured": {}, "machine": this_machine()}
    links.write_text(json.dumps({"gloo": saved}))
    monkeypatch.setenv("MESHSPEED_LINK_PARAMS", str(links))
    monkeypatch.setenv("MESHSPEED_MACHINE", str(tmp_path / "machine.json"))
    monkeypatch.setattr(machine, "measure_matmul_tflops", lambda: 0.02)
    fake_sync = lambda world, tflops, us, group_size: 10 * world + group_size  # noqa: E731
    monkeypatch.setattr(machine, "measure_sync_us", fake_sync)
    assert main(["plan", "--calibrate", "--nproc", "4"]) == 0
    m = machine.get_machine("calibrated")
    assert m.sync_us == {"2": 42.0, "4": 44.0}  # each group size of the --nproc given
    assert m.sync_s(2) == 42e-6 and m.sync_s(3) == 42e-6 and m.sync_s(8) == 44e-6 and m.sync_s(1) == 0.0
    assert m.alpha_us == pytest.approx(1200.0)
    assert m.intra_gbs == pytest.approx(0.2)
    assert m.peak_tflops == pytest.approx(0.02)
    assert "α 1200 µs, 0.20 GB/s" in capsys.readouterr().out


def test_the_blocking_collective_wait_is_measured_on_real_ranks():
    """`plan --calibrate`'s sync measurement runs real gloo ranks (compute, a blocking
    all-reduce, compute) and returns microseconds per collective (non-negative, finite)."""
    import math

    from meshspeed.plan.machine import measure_sync_us

    us = measure_sync_us(2, tflops=0.01, compute_us=200.0, reps=5)
    assert math.isfinite(us) and 0.0 <= us < 5e6
