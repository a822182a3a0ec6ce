"""`meshspeed train --config configs/dit-tiny.toml` end to end (a few steps): the workers train
and checkpoint the EMA, then the launcher samples every class into run.dir/samples.png beside
loss.png and prints the digit figure; `meshspeed sample --run` on that directory draws with the
EMA (or, with --no-ema, the trained weights: other images)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from PIL import Image

from meshspeed.cli import main

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
    out = subprocess.run(
        [sys.executable, "-m", "meshspeed", "train", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
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
