"""run.device (issue 25): the plan counts the node's GPUs before any worker starts; auto takes
CUDA only when every local rank gets a GPU of its own, else the CPU with one notice saying what to
type; cuda with too few GPUs is one line before spawn. The GPU count is injected into the plan
(make_plan(local_gpus=N), resolve(local_gpus=N)), never by patching torch."""

from __future__ import annotations

import json

import pytest
import torch

from meshspeed import cli
from meshspeed.comm import ConfigError, launch
from meshspeed.comm.context import choose_device, fit_degrees, init
from meshspeed.plan import config
from meshspeed.plan import device as plan_device
from meshspeed.plan.run_plan import RunPlan, describe, make_plan
from tests.cli_batch import run_many

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; the cpu case runs here")


def _cfg(tmp_path, *extra) -> config.Config:
    """The README's default command (4 workers, dp 2 × tp 2) with `extra` overrides."""
    return config.load(None, [("run.dir", str(tmp_path / "run")), *extra])


def test_auto_with_one_gpu_for_four_ranks_runs_on_cpu_and_says_how_to_use_it(tmp_path):
    plan = make_plan(_cfg(tmp_path), 4, ranks=False, local_gpus=1)
    assert plan.device == "cpu" and plan.device_info["backend"] == "gloo"
    assert plan.device_info["local_ranks"] == 4 and plan.device_info["local_gpus"] == 1
    notes = [w for w in plan.warnings if "run.device=auto" in w]
    assert len(notes) == 1, plan.warnings
    assert "4 local ranks but 1 GPU" in notes[0] and "add --nproc 1 --parallel.tp 1" in notes[0]
    # The plan the workers get (and meta.json records) carries the choice.
    again = RunPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again.device == "cpu" and again.device_info == plan.device_info


@pytest.mark.parametrize("gpus", [4, 8])
def test_auto_with_a_gpu_per_rank_takes_cuda_without_a_notice(tmp_path, gpus):
    plan = make_plan(_cfg(tmp_path), 4, local_gpus=gpus)
    assert plan.device == "cuda" and plan.device_info["backend"] == "nccl"
    assert not [w for w in plan.warnings if "run.device" in w]
    text = describe(plan)
    assert f"device       cuda (nccl): one GPU per local rank (4 of {gpus} GPUs)" in text


def test_no_gpu_runs_on_cpu_silently_and_cpu_is_honoured_next_to_gpus(tmp_path):
    plan = make_plan(_cfg(tmp_path), 4, ranks=False, local_gpus=0)
    assert plan.device == "cpu" and not plan.warnings  # a laptop: nothing to say
    plan = make_plan(_cfg(tmp_path, ("run.device", "cpu")), 4, ranks=False, local_gpus=8)
    assert plan.device == "cpu" and not plan.warnings and plan.device_info["why"] == "run.device=cpu"


@pytest.mark.parametrize("gpus,needle", [(1, "1 GPU visible; add --nproc 1 --parallel.tp 1, or set"),
                                         (0, "no GPU visible")])  # fmt: skip
def test_cuda_with_too_few_gpus_is_one_line_naming_both_numbers(tmp_path, gpus, needle):
    with pytest.raises(ConfigError) as err:
        make_plan(_cfg(tmp_path, ("run.device", "cuda")), 4, local_gpus=gpus)
    msg = str(err.value)
    assert len(msg.splitlines()) == 1 and "run.device=cuda" in msg
    assert "4 local ranks" in msg and needle in msg


def test_torchrun_counts_its_local_ranks_and_suggests_torchrun(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # 2 nodes of 8 ranks
    cfg = _cfg(tmp_path, ("parallel.dp", "8"), ("train.micro_batch_size", "2"))  # dp 8 × tp 2
    plan = make_plan(cfg, 16, ranks=False, local_gpus=8)
    assert plan.device == "cuda" and plan.device_info["local_ranks"] == 8
    plan = make_plan(cfg, 16, ranks=False, local_gpus=4)
    (note,) = [w for w in plan.warnings if "run.device" in w]
    assert "8 local ranks but 4 GPUs" in note
    # 2 nodes × 4 GPUs = 8 ranks: tp 2 still fits, the explicit dp 8 no longer does
    assert "launch with torchrun --nproc-per-node 4 and --parallel.dp 0" in note


def test_hint_keeps_the_degrees_that_fit():
    assert fit_degrees(1, {"tp": 2, "pp": 2}) == {"tp": 1, "pp": 1}
    assert fit_degrees(4, {"tp": 2, "pp": 4}) == {"tp": 2, "pp": 1}
    assert fit_degrees(8, {"tp": 2, "pp": 4}) == {"tp": 2, "pp": 4}
    with pytest.raises(ConfigError, match="run.device='gpu' is not valid; choose one of auto, cpu, cuda"):
        choose_device("gpu", 1, 1)


def test_dry_run_and_the_launcher_print_the_notice_once(tmp_path, monkeypatch, capsys):
    """The launcher's own GPU count (plan/device.count_gpus) is the injected one: 1 GPU."""
    monkeypatch.setattr(plan_device, "count_gpus", lambda: 1)
    assert cli.main(["train", "--dry-run", "--run.dir", str(tmp_path / "r")]) == 0
    out = capsys.readouterr()
    text = out.out + out.err
    assert text.count("run.device=auto: 4 local ranks but 1 GPU") == 1
    assert "device       cpu (gloo)" in out.out
    assert cli.main(["train", "--dry-run", "--json", "--run.dir", str(tmp_path / "r")]) == 0
    assert json.loads(capsys.readouterr().out)["device"] == "cpu"
    seen = []
    monkeypatch.setattr(launch, "spawn", lambda fn, n, args, **k: seen.append(args[0]["device"]) or 0)
    assert cli.main(["train", "--run.dir", str(tmp_path / "r")]) == 0  # spawn: the plan's device
    err = capsys.readouterr().err
    assert seen == ["cpu"] and err.count("run.device=auto") == 1 and "warning" in err


def test_cli_refuses_cuda_before_spawning(tmp_path):
    """One more rank than this machine has GPUs: one line, exit 2, no worker (no 'rank' lines)."""
    n = torch.cuda.device_count() + 1
    have = f"{n - 1} GPU visible" if n == 2 else ("no GPU visible" if n == 1 else f"{n - 1} GPUs visible")
    train = ["train", "--nproc", str(n), "--parallel.tp", "1", "--run.device", "cuda"]
    (res,) = run_many([train + ["--run.dir", str(tmp_path / "r")]], cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and f"run.device=cuda needs a GPU per local rank: {n} local ranks" in lines[0]
    assert have in lines[0]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_comm_init_puts_the_process_on_the_chosen_device(device):
    ctx = init(device=device)
    assert ctx.device.type == device and ctx.backend == {"cpu": "gloo", "cuda": "nccl"}[device]
    x = torch.ones(2, device=ctx.device)  # a tensor made where the context says
    assert x.device.type == device


def test_comm_init_refuses_cuda_without_a_gpu_per_rank(monkeypatch):
    n = torch.cuda.device_count() + 1
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")  # a job of one rank on a node said to hold n: no rendezvous
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(n))
    monkeypatch.delenv("MESHSPEED_BACKEND", raising=False)
    with pytest.raises(ConfigError, match=f"device=cuda needs a GPU per local rank: {n} local ranks"):
        init(device="cuda")
