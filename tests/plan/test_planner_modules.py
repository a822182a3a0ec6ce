"""`meshspeed plan` for a vlm: the planner searches per-module layouts ([modules]: colocated and
disaggregated) beside the one-mesh ones, keeps only what `meshspeed train` accepts (the run
plan's check_trainable, read when the planner runs), and prints a whole command that trains."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest

from meshspeed.comm import ConfigError
from meshspeed.plan import config
from meshspeed.plan import modules as per_module
from meshspeed.plan.machine import get_machine
from meshspeed.plan.planner import layout_space, rank_layouts, train_command

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VLM = [("model.preset", "vlm-tiny"), ("train.objective", "sft"), ("train.seq_len", "28")]
VLM += [("train.global_batch_size", "8"), ("data.path", "digits"), ("run.dir", "/tmp/ms-plan-modules")]


def _cfg(*extra):
    return config.load(None, VLM + list(extra))


def _kinds(groups) -> set:
    out = set()
    for s in (s for g in groups for s in g):
        if s.get("modules.encoder_ranks"):
            out.add("disaggregated")
        elif "modules.encoder_dp" in s:
            out.add("colocated")
        else:
            out.add("one mesh")
    return out


def test_a_vlm_is_planned_one_mesh_colocated_and_disaggregated():
    groups = layout_space(_cfg(), 4, get_machine("cpu"))
    assert _kinds(groups) == {"one mesh", "colocated", "disaggregated"}
    piped = set()
    for s in (s for g in groups for s in g):
        if s.get("modules.encoder_ranks"):  # the last k ranks: rank 0 logs the loss
            assert "0" not in s["modules.encoder_ranks"].split("-")[0], s
            piped.add(s["parallel.pp"])
            assert s["parallel.cp"] == 1, s
        else:  # colocated: the decoder is not pipelined
            assert s["parallel.pp"] == 1 or "modules.encoder_dp" not in s, s
    assert piped == {1, 2}, piped  # the dist-train shape: the decoder's 2 layers over 2 stages
    plain = layout_space(
        config.load(None, [("model.preset", "tiny"), ("run.dir", "/tmp/ms-pm")]), 4, get_machine("cpu")
    )
    assert _kinds(plain) == {"one mesh"}  # no encoder, no [modules]


def test_ranked_per_module_layouts_are_ones_train_accepts():
    ok, rejected = rank_layouts(_cfg(), 4, get_machine("cpu"))
    modes = {r["predicted"].get("modules", "one mesh") for r in ok}
    assert {"colocated", "disaggregated", "one mesh"} <= modes, modes
    steps = [r["predicted"]["step_s"] for r in ok]
    assert steps == sorted(steps) and all(s > 0 for s in steps)
    for r in ok:  # each one the run plan of a starting run takes, check_trainable included
        if "modules" in r["predicted"]:
            pairs = VLM + [
                (k, str(v).lower() if isinstance(v, bool) else str(v)) for k, v in r["settings"].items()
            ]
            cfg = config.load(None, pairs)
            from meshspeed.plan.run_plan import make_plan

            make_plan(cfg, 4, ranks=False, local_gpus=0, local_ranks=0, need_data=False)
            per_module.check_trainable(cfg, make_plan(cfg, 4, ranks=False, need_data=False).modules)


def test_the_trainers_refusals_are_read_when_the_planner_runs(monkeypatch):
    """A refusal added to (or lifted from) check_trainable changes the plan without a change here."""

    def refuse_all(cfg, layout):
        raise ConfigError("modules: refused for this test")

    monkeypatch.setattr(per_module, "check_trainable", refuse_all)
    ok, rejected = rank_layouts(_cfg(), 4, get_machine("cpu"))
    assert ok and all("modules" not in r["predicted"] for r in ok)
    assert any(r["rejected"] == "modules: refused for this test" for r in rejected)


def test_pinned_module_settings_plan_only_per_module_layouts():
    ok, _ = rank_layouts(_cfg(), 4, get_machine("cpu"), fixed={"modules.encoder_ranks": "2-3"})
    assert ok and all(r["predicted"]["modules"] == "disaggregated" for r in ok)
    assert all(r["settings"]["modules.encoder_ranks"] == "2-3" for r in ok)


def test_the_command_line_holds_the_config_the_given_settings_and_the_layout():
    line = train_command(
        "configs/vlm-tiny.toml",
        [("nproc", 4), ("train.global_batch_size", 8), ("parallel.tp", 1)],
        4,
        {"parallel.tp": 2, "parallel.sequence_parallel": True, "modules.encoder_ranks": "2-3"},
    )
    words = shlex.split(line)
    assert words[:5] == ["meshspeed", "train", "--config", "configs/vlm-tiny.toml", "--nproc"]
    assert words.count("--parallel.tp") == 1 and "--train.global_batch_size" in words  # the planner's tp wins
    assert words[words.index("--modules.encoder_ranks") + 1] == "2-3"
    assert words[words.index("--parallel.sequence_parallel") + 1] == "true"


def _plan_best(tmp_path, *extra) -> list[str]:
    cmd = [sys.executable, "-m", "meshspeed", "plan", "--config", os.path.join(ROOT, "configs/vlm-tiny.toml")]
    cmd += ["--nproc", "2", "--device", "cpu", "--train.global_batch_size", "4", "--data.path", "digits"]
    cmd += ["--train.seq_len", "28", "--run.dir", str(tmp_path / "run"), *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("run the best: ")]
    assert len(line) == 1, out.stdout
    words = shlex.split(line[0].removeprefix("run the best: "))
    assert words[:2] == ["meshspeed", "train"], words
    return words


@pytest.mark.parametrize("extra", [[], ["--modules.encoder_ranks", "1"]], ids=["best", "disaggregated"])
def test_the_printed_best_command_is_one_the_run_plan_starts(tmp_path, extra):
    """Fast: the printed command's settings pass the run plan of a run that starts (data read,
    check_trainable) — what `meshspeed train` checks before any worker."""
    from meshspeed.plan.run_plan import make_plan

    words = _plan_best(tmp_path, *extra)
    pairs, i = [], 2
    while i < len(words):
        pairs.append((words[i].removeprefix("--"), words[i + 1]))
        i += 2
    args = dict(pairs)
    cfg = config.load(args.pop("config"), [(k, v) for k, v in pairs if k != "config"])
    plan = make_plan(cfg, int(args["nproc"]), ranks=False, local_gpus=0, local_ranks=0)
    assert plan.modules or not extra
    if extra:
        assert args["modules.encoder_ranks"] == "1" and plan.modules["mode"] == "disaggregated"


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--modules.encoder_ranks", "1"]], ids=["best", "disaggregated"])
def test_the_printed_best_command_trains(tmp_path, extra):
    """The printed line, run as printed for 2 steps, trains (20-30 s each on 2 cores)."""
    words = _plan_best(tmp_path, *extra)
    cmd = [sys.executable, "-m", "meshspeed", *words[1:], "--train.steps", "2", "--train.eval_interval", "0"]
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (tmp_path / "run" / "metrics.jsonl").exists()
