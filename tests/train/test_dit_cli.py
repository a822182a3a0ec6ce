"""`meshspeed train --config configs/dit-tiny.toml` end to end (a few steps): the workers train
and checkpoint the EMA, then the launcher samples every class into run.dir/samples.png beside
loss.png and prints the digit figure; `meshspeed sample --run` on that directory draws with the
EMA (or, with --no-ema, the trained weights: other images). The command test is in the slow
tier (tests/tiers.py); test_sample_loads_the_ema keeps the EMA's way into the sampler in CI."""

from __future__ import annotations

import json
import os
import sys

import torch
from PIL import Image

from meshspeed.cli import main
from tests import warm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_train_config_then_sample(tmp_path, capsys):
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    run = tmp_path / "run"
    argv = ["--config", os.path.join(ROOT, "configs", "dit-tiny.toml"), "--run.dir", str(run)]
    argv += [
        "--train.steps",
        "4",
        "--train.eval_interval",
        "2",
        "--flow.sample_n",
        "1",
        "--flow.sample_steps",
        "2",
    ]
    out = warm.run([sys.executable, "-m", "meshspeed", "train", *argv], env=env, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "dp 2 × tp 1" in out.stdout and "the EMA of the weights (decay 0.99, 4 updates)" in out.stdout
    assert "the digit classifier recognises" in out.stdout and "FID" in out.stdout
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert "val_loss" in rows[1] and "val_loss" in rows[3]
    assert rows[0]["tokens_per_s"] > 0  # image tokens: 64 samples × 16 per step
    grid = Image.open(run / "samples.png")
    assert grid.size[1] > 9 * grid.size[0]  # a row per class, one image each: 10 tiles stacked
    score = json.loads((run / "samples" / "score.json").read_text())
    assert score["n"] == 10 and 0.0 <= score["accuracy"] <= 1.0

    capsys.readouterr()
    common = ["sample", "--run", str(run), "--classes", "3,7", "--n", "1", "--steps", "2"]
    assert main([*common, "--out", str(tmp_path / "ema")]) == 0
    assert "the EMA of the weights" in capsys.readouterr().out
    assert main([*common, "--out", str(tmp_path / "raw"), "--no-ema"]) == 0
    assert "the trained weights" in capsys.readouterr().out
    a, b = ((tmp_path / d / "grid.png").read_bytes() for d in ("ema", "raw"))
    assert a != b, "sampling with the EMA drew the same images as the trained weights"


def job_train_and_save(ctx, run_dir: str):
    """2 flow steps with the EMA on, saved: (EMA whole, weights whole) by name."""
    from meshspeed.plan import config
    from meshspeed.train.trainer import Trainer
    from tests.train.test_dit_trainer import BASE, whole_weights

    cfg = config.load(None, BASE + [("run.dir", run_dir), ("train.steps", "2")])
    trainer = Trainer(cfg, ctx)
    for s in range(2):
        trainer.train_step(s)
    trainer._save(2)
    return trainer.ema.whole(), whole_weights(trainer)


def test_sample_loads_the_ema(tmp_path):
    """In-process (the CI claim of the command test above): the sampler's model holds the
    checkpoint's EMA, or with no_ema the trained weights."""
    from meshspeed import comm
    from meshspeed.infer.sample_run import load_model, resolve
    from tests import harness

    ema, weights = harness.run(1, job_train_and_save, str(tmp_path / "run"))[0]
    opts = {
        "run": str(tmp_path / "run"), "checkpoint": None, "classes": None, "prompts": None, "n": 1,
        "steps": 2, "sampler": "euler", "guidance": 1.0, "seed": 0, "out": str(tmp_path / "s"),
        "score": False, "nproc": 1, "device": "cpu",
    }  # fmt: skip
    mesh = comm.ParallelDims().build(comm.init())
    for no_ema, want in ((False, ema), (True, weights)):
        job = resolve({**opts, "no_ema": no_ema})
        model = load_model(job, mesh)
        for n, p in model.named_parameters():
            assert torch.equal(p.detach(), want[n].to(p.dtype)), (no_ema, n)
    assert any(not torch.equal(ema[n], weights[n]) for n in ema)
