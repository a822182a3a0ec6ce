"""`meshspeed eval` gives the trainer's validation loss on the same data, under any layout."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests import warm

RUN = ["--train.seq_len", "32", "--train.global_batch_size", "8", "--train.micro_batch_size", "2"]
RUN += ["--data.max_mb", "0.3", "--train.eval_batches", "2", "--model.n_kv_heads", "4"]


def _ms(*args, cwd) -> subprocess.CompletedProcess:
    return warm.run(
        [sys.executable, "-m", "meshspeed", *args], capture_output=True, text=True, timeout=300, cwd=cwd
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny model trained 3 steps under dp 2; its last metrics row holds the validation loss."""
    d = tmp_path_factory.mktemp("eval")
    out = _ms(
        "train", "--nproc", "2", "--parallel.tp", "1", "--train.steps", "3", *RUN, "--run.dir", "run", cwd=d
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in (d / "run" / "metrics.jsonl").read_text().splitlines()]
    return d, rows[-1]["val_loss"]


@pytest.mark.parametrize(
    "layout",
    [
        ["--nproc", "4", "--parallel.tp", "2", "--parallel.pp", "2"],
        pytest.param(["--nproc", "1", "--parallel.tp", "1"], marks=pytest.mark.slow),
        pytest.param(["--nproc", "2", "--parallel.tp", "2"], marks=pytest.mark.slow),
    ],
    ids=["tp2xpp2", "one process", "tp2"],
)
def test_eval_equals_the_trainers_validation_loss(trained, layout):
    d, val_loss = trained
    name = "eval" + "".join(layout).replace("-", "_") + ".json"
    out = _ms("eval", "--checkpoint", "run", *layout, "--json", name, cwd=d)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((d / name).read_text())
    assert result["loss"] == pytest.approx(val_loss, rel=1e-5, abs=1e-6)
    assert result["tokens"] == 2 * 8 * 32 and result["perplexity"] > 1
    assert "meshspeed eval: loss" in out.stdout


def test_eval_of_something_that_is_not_a_checkpoint_is_one_line(tmp_path):
    out = _ms("eval", "--checkpoint", str(tmp_path), cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
