"""The `--dry-run` examples of docs/training.md and docs/memory.md (llama3-70b on 64 ranks), run
as written: every line a page shows is printed, and its per-rank line is EXPECTED[page].

docs/training.md's line is what the plan prints, checked by hand against its parts: 2,270,756,864 parameters
on ranks 0-15 (the first pipeline stage: embedding + 20 layers, 1/8 of each tp-split weight);
bf16 parameters 2 B each = 4.23 GiB; gradients in the data-parallel buckets, float32 whatever
train.dtype (DataParallel's grad_dtype; counted in tests/memory/test_estimate_counted.py) =
8.46 GiB; ZeRO-1 over dp 2 of AdamW's two moments and the fp32 master, 12 B / 2 = 12.69 GiB;
activations of 4 micro-batches in flight (1F1B's first stage) × 20 layers = 47.83 GiB (tp 8 of
8 kv heads: one per rank, so k and v are repeated as broadcast views and keep one head's bytes,
counted in tests/memory/test_swap_reference.py; the all-gathered input kept once per norm
output); the sequence-parallel gather of one layer's input, 8192 × 8192 × 2 B = 128 MiB.

docs/memory.md's line: the same first stage, ZeRO 0, with the fp32 masters shared with the bf16
parameters (memory.reuse_fp32_param): params 4.23 GiB and grads 8.46 GiB as above; the optimizer
holds the two fp32 moments and the master's other 2 B, 10 B per parameter = 21.15 GiB (12 B less
the 2 B the bf16 parameter already holds: the "saved 4.23 GiB" line); activations of the default
batch (micro-batches of 4 × 128 tokens, 2 in flight) = 3.14 GiB.
"""

from __future__ import annotations

import os
import re
import shlex

import pytest

from meshspeed import cli
from meshspeed.comm import launch

DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "docs")
EXPECTED = {
    "training.md": "ranks 0-15          2,270,756,864  "
    "73.34 GiB = 4.23 GiB + 8.46 GiB + 12.69 GiB + 47.83 GiB + 128.00 MiB",
    "memory.md": "ranks 0-15          2,270,756,864  "
    "36.97 GiB = 4.23 GiB + 8.46 GiB + 21.15 GiB + 3.14 GiB + 0 B",
}


def _example(page: str) -> tuple[list[str], list[str]]:
    """(the command's arguments after `meshspeed train`, the output lines the page shows)."""
    path = os.path.join(DOCS, page)
    with open(path) as f:
        text = f.read()
    block = re.search(r"```text\n(\s*\$ meshspeed train --model\.preset llama3-70b.*?)```", text, re.S)
    assert block, f"{path}: the llama3-70b --dry-run example is gone"
    lines = [ln.strip() for ln in block.group(1).splitlines()]
    command, shown, more = [], [], True
    for ln in lines:
        if more:
            command.append(ln.rstrip("\\").removeprefix("$ "))
            more = ln.endswith("\\")
        elif ln and ln != "...":
            shown.append(ln)
    args = shlex.split(" ".join(command))
    assert args[:2] == ["meshspeed", "train"] and "--dry-run" in args, args
    return args[2:], shown


@pytest.fixture
def no_workers(monkeypatch):
    def spawn(*a, **k):
        raise AssertionError("a worker was spawned")

    monkeypatch.setattr(launch, "spawn", spawn)
    monkeypatch.setattr(launch, "run_worker", spawn)


@pytest.mark.parametrize("page", sorted(EXPECTED))
def test_the_dry_run_example_prints_the_expected_per_rank_line(page, tmp_path, capsys, no_workers):
    args, shown = _example(page)
    assert cli.main(["train", *args, "--run.dir", str(tmp_path / "r")]) == 0
    out = [ln.strip() for ln in capsys.readouterr().out.splitlines()]
    assert EXPECTED[page] in out, "\n".join(out)
    missing = [ln for ln in shown if ln not in out and not ln.startswith("ranks ")]
    assert missing == [], f"lines of docs/{page} the dry run does not print: {missing}"


@pytest.mark.parametrize("page", sorted(EXPECTED))
def test_the_page_shows_the_expected_per_rank_line(page):
    _, shown = _example(page)
    assert [ln for ln in shown if ln.startswith("ranks ")] == [EXPECTED[page]]
