"""The `--dry-run` example of docs/training.md (llama3-70b on 64 ranks), run as written: every
line the page shows is printed, and the per-rank line is EXPECTED.

EXPECTED is what the plan prints, checked by hand against its parts: 2,270,756,864 parameters
on ranks 0-15 (the first pipeline stage: embedding + 20 layers, 1/8 of each tp-split weight);
bf16 parameters 2 B each = 4.23 GiB; gradients in the data-parallel buckets, float32 whatever
train.dtype (DataParallel's grad_dtype; counted in tests/memory/test_estimate_counted.py) =
8.46 GiB; ZeRO-1 over dp 2 of AdamW's two moments and the fp32 master, 12 B / 2 = 12.69 GiB;
activations of 4 micro-batches in flight (1F1B's first stage) × 20 layers = 77.83 GiB (tp 8 of
8 kv heads: one per rank, so k and v are repeated as broadcast views and keep one head's bytes,
counted in tests/memory/test_swap_reference.py); the sequence-parallel gather of one layer's
input, 8192 × 8192 × 2 B = 128 MiB.
"""

from __future__ import annotations

import os
import re
import shlex

import pytest

from meshspeed import cli
from meshspeed.comm import launch

PAGE = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "training.md")
EXPECTED = (
    "ranks 0-15          2,270,756,864  103.34 GiB = 4.23 GiB + 8.46 GiB + 12.69 GiB + 77.83 GiB + 128.00 MiB"
)


def _example() -> tuple[list[str], list[str]]:
    """(the command's arguments after `meshspeed train`, the output lines the page shows)."""
    with open(PAGE) as f:
        text = f.read()
    block = re.search(r"```text\n(\s*\$ meshspeed train --model\.preset llama3-70b.*?)```", text, re.S)
    assert block, f"{PAGE}: the llama3-70b --dry-run example is gone"
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


def test_the_dry_run_example_prints_the_expected_per_rank_line(tmp_path, capsys, no_workers):
    args, shown = _example()
    assert cli.main(["train", *args, "--run.dir", str(tmp_path / "r")]) == 0
    out = [ln.strip() for ln in capsys.readouterr().out.splitlines()]
    assert EXPECTED in out, "\n".join(out)
    missing = [ln for ln in shown if ln not in out and not ln.startswith("ranks ")]
    assert missing == [], f"lines of {PAGE} the dry run does not print: {missing}"


def test_the_page_shows_the_expected_per_rank_line():
    _, shown = _example()
    assert [ln for ln in shown if ln.startswith("ranks ")] == [EXPECTED]
