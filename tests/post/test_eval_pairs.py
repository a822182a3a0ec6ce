"""`meshspeed eval --pairs FILE`: held-out preference accuracy and mean margin against the run's
starting point, equal to the trainer's own validation metrics on the same pairs, and the same
under tp and pp as on one process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from meshspeed.data.arith import write_arith
from tests import warm

STEPS, G, EVAL_BATCHES = 2, 8, 2
RUN = ["--train.objective", "dpo", "--train.seq_len", "48", "--train.global_batch_size", str(G)]
RUN += ["--train.micro_batch_size", "4", "--train.warmup_steps", "0", "--train.lr", "1e-2"]
RUN += ["--train.eval_batches", str(EVAL_BATCHES), "--parallel.tp", "1"]


def _ms(*args, cwd) -> subprocess.CompletedProcess:
    return warm.run(
        [sys.executable, "-m", "meshspeed", *args], capture_output=True, text=True, timeout=300, cwd=cwd
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A DPO run of 2 steps on the arithmetic task from the seeded tiny model; the held-out file
    holds exactly the pairs its validation read (records [0, G·eval_batches) of pairs.val)."""
    d = tmp_path_factory.mktemp("eval-pairs")
    write_arith(str(d / "arith"), seed=0)
    lines = (d / "arith" / "pairs.val.jsonl").read_text().splitlines(keepends=True)
    (d / "held_out.jsonl").write_text("".join(lines[: G * EVAL_BATCHES]))
    out = _ms("train", "--nproc", "1", "--train.steps", str(STEPS), "--data.path", "arith", *RUN,
              "--run.dir", "run", cwd=d)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in (d / "run" / "metrics.jsonl").read_text().splitlines()]
    return d, rows[-1]


def _eval(d, name: str, *args) -> dict:
    out = _ms("eval", "--checkpoint", "run", "--pairs", "held_out.jsonl", "--json", name, *args, cwd=d)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "meshspeed eval: preference accuracy" in out.stdout
    return json.loads((d / name).read_text())


@pytest.fixture(scope="module")
def one_process(trained):
    return _eval(trained[0], "one.json", "--nproc", "1")


def test_equals_the_trainers_validation_metrics(trained, one_process):
    _, row = trained
    assert one_process["pairs"] == G * EVAL_BATCHES and one_process["reference"] == "init"
    # the trainer's validation: the mean over equal micro-batches of their means = the mean here
    assert one_process["accuracy"] == pytest.approx(row["val_rewards/accuracies"], abs=1e-9)
    for mine, theirs in (("margin", "margins"), ("chosen_reward", "chosen"), ("rejected_reward", "rejected")):
        assert one_process[mine] == pytest.approx(row[f"val_rewards/{theirs}"], abs=2e-6), mine
    assert one_process["margin"] != 0, "the policy moved off its reference: a vacuous check otherwise"


@pytest.mark.parametrize(
    "layout",
    [["--parallel.tp", "2"], ["--parallel.tp", "1", "--parallel.pp", "2"]],
    ids=["tp2", "pp2"],
)
def test_layouts_equal_one_process(trained, one_process, layout):
    got = _eval(trained[0], "".join(layout).strip("-") + ".json", "--nproc", "2", *layout)
    assert got["accuracy"] == one_process["accuracy"]
    for key in ("margin", "chosen_reward", "rejected_reward"):
        assert got[key] == pytest.approx(one_process[key], abs=2e-6), key


def test_reference_is_a_directory(trained):
    """The policy against itself: every reward is 0, so no pair is won."""
    got = _eval(trained[0], "self.json", "--nproc", "1", "--reference", "run")
    assert got["accuracy"] == 0 and got["margin"] == 0 and got["chosen_reward"] == 0


@pytest.mark.parametrize(
    "args,words",
    [
        (["--pairs", "missing.jsonl"], "does not exist"),
        (["--pairs", "held_out.jsonl", "--reference", "nowhere"], "--reference='nowhere'"),
    ],
)
def test_mistakes_are_one_line(trained, args, words):
    out = _ms("eval", "--checkpoint", "run", *args, cwd=trained[0])
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and words in out.stderr, out.stderr
