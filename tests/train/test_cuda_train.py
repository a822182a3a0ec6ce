"""Training, checkpoints and evaluation on the device the run plan chose (issue 25): the job's
worker follows plan.device, a checkpoint saved on CUDA resumes on the CPU bit for bit (and back),
and `meshspeed eval`'s worker evaluates on the chosen device. Each check runs on the CPU and,
where there is one, on a CUDA GPU; world size 1, in this process."""

from __future__ import annotations

import json
import os

import pytest
import torch

from meshspeed.comm.context import init
from meshspeed.plan import config
from meshspeed.plan.run_plan import make_plan
from meshspeed.train import evaluate, job
from meshspeed.train.trainer import Trainer

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; the cpu case runs here")
RUN = [
    ("nproc", "1"),
    ("parallel.tp", "1"),
    ("model.n_heads", "4"),
    ("model.n_kv_heads", "4"),
    ("train.seq_len", "32"),
    ("train.global_batch_size", "4"),
    ("train.micro_batch_size", "2"),
    ("train.dtype", "float32"),
    ("train.eval_interval", "0"),
    ("train.eval_batches", "1"),
    ("train.warmup_steps", "1"),
    ("data.max_mb", "0.2"),
]


def _cfg(run_dir, device: str, *extra) -> config.Config:
    return config.load(None, RUN + [("run.dir", str(run_dir)), ("run.device", device), *extra])


def _rows(run_dir) -> dict[int, dict]:
    lines = open(os.path.join(run_dir, "metrics.jsonl")).read().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if "step" in r}  # 0-based: the third is 2


def _trained(run_dir, device: str) -> dict[int, dict]:
    """3 steps through the job's worker, checkpoints at 2 and 3; the worker joins the job on the
    plan's device (comm.init(device=plan.device), seen through a wrapper of meshspeed's init)."""
    cfg = _cfg(run_dir, device, ("train.steps", "3"), ("checkpoint.interval", "2"))
    asked = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(job.comm, "init", lambda **kw: asked.append(kw.get("device")) or init(**kw))
        job.worker(make_plan(cfg, 1, ranks=False).to_dict(), True)
    assert asked == [device]
    return _rows(run_dir)


def _close(a: float, b: float, same_device: bool) -> bool:
    return a == b if same_device else a == pytest.approx(b, rel=1e-4)  # CUDA's and the CPU's sums


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("cpu_run") / "run"
    return d, _trained(d, "cpu")


@pytest.mark.parametrize(
    "first,second",
    [("cpu", "cpu"), pytest.param("cuda", "cpu", marks=CUDA), pytest.param("cpu", "cuda", marks=CUDA)],
)
def test_checkpoint_moves_between_devices(tmp_path, cpu_run, first, second):
    a_dir, a_rows = cpu_run if first == "cpu" else (tmp_path / "a", _trained(tmp_path / "a", first))
    step2 = os.path.join(a_dir, "step-000002")
    meta = json.load(open(os.path.join(step2, "meta.json")))
    assert meta["config"]["device"] == first  # meta.json records the plan, with its device
    resumed = {}
    for name, device in (("here", first), ("there", second)):
        cfg = _cfg(tmp_path / name, device, ("train.steps", "3"), ("checkpoint.resume", step2))
        trainer = Trainer(cfg, init(device=device), make_plan(cfg, 1, ranks=False))
        assert trainer.start_step == 2 and next(trainer.model.parameters()).device.type == device
        resumed[name] = {k: p.detach().cpu().clone() for k, p in trainer.model.named_parameters()}
        trainer.run()
        resumed[name + "_loss"] = _rows(tmp_path / name)[2]["loss"]
    for k, p in resumed["here"].items():  # loading is a copy: the same bits on either device
        assert torch.equal(p, resumed["there"][k]), k
    assert resumed["here_loss"] == a_rows[2]["loss"]  # resuming on the device it was saved on: exact
    assert _close(resumed["there_loss"], a_rows[2]["loss"], first == second)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_eval_runs_on_the_chosen_device(tmp_path, cpu_run, device, capsys):
    a_dir, a_rows = cpu_run
    cfg = evaluate.eval_config(str(a_dir), None, [("run.device", device)])
    plan = make_plan(cfg, 1, ranks=False)
    assert plan.device == device
    out = tmp_path / "eval.json"
    evaluate.worker(plan.to_dict(), str(out))
    result = json.loads(out.read_text())
    assert result["device"] == device and f"1 rank(s) on {device}" in capsys.readouterr().out
    assert result["loss"] == pytest.approx(a_rows[2]["val_loss"], rel=1e-5 if device == "cpu" else 1e-4)
