"""Every benchmark checks its arguments before any work: a value it cannot run is one parser
line naming the flag, the value and what works, then exit 2 (issue 44 item 4). In-process,
before any worker starts, so each case costs the module's import only."""

from __future__ import annotations

import importlib
import inspect
import sys

import pytest

CASES = [
    ("memory", ["--dim", "60"], "--dim 60: must be a multiple of 16"),
    ("memory", ["--steps", "0"], "--steps=0 must be >= 1"),
    ("context_parallel", ["--seq", "102"], "--seq 102: must be a multiple of 2 × --cp = 4"),
    ("context_parallel", ["--heads", "6", "--kv-heads", "4"], "--heads 6: must be a multiple of --kv-heads"),
    ("pipeline", ["--parts", "bubbles"], "--parts bubbles: choose bubble, peer or bubble,peer"),
    ("pipeline", ["--microbatches", "0"], "--microbatches=0 must be >= 1"),
    ("sparse_accuracy", ["--steps", "10", "--finish", "10"], "--finish 10: the dense finish must be 0 to"),
    ("sparse_accuracy", ["--batch", "3", "--nproc", "2"], "--batch 3: must be a multiple of --nproc 2"),
    ("sparse_accuracy", ["--preset", "huge"], "--preset huge: not a preset"),
    ("generate", ["--hidden", "100"], "--hidden 100: must be a multiple of 64"),
    ("generate", ["--new", "1"], "--new 1: must be at least 2"),
    ("parallelize", ["--batch", "3"], "--batch 3: must be a multiple of --nproc 2"),
    ("parallelize", ["--dim", "200"], "--dim 200: 3 heads of an even size must divide it"),
    ("placement_overhead", ["--nproc", "3"], "--nproc 3: must divide 64"),
    ("sparse_linear", ["--shapes", "6x8@2"], "--shapes 6x8@2: IN, OUT multiples of 4"),
    ("sparse_linear", ["--shapes", "128by256"], "--shapes '128by256': write INxOUT@TOKENS"),
    ("zero3", ["--batch", "3"], "--batch=3 must be a multiple of --nproc=2"),
    ("build_memory", ["--tp", "0"], "--tp=0 must be >= 1"),
    ("vlm", ["--batch", "5"], "--batch 5: must be a multiple of each layout's decoder dp [2, 3, 4]"),
    ("vlm", ["--preset", "tiny"], "--preset tiny: not a vlm preset"),
    ("vlm", ["--nproc", "1"], "--nproc 1: the layouts need at least 2 ranks"),
]


@pytest.mark.parametrize("name,argv,line", CASES, ids=[f"{c[0]} {' '.join(c[1])}" for c in CASES])
def test_a_bad_argument_is_one_line_before_any_work(name, argv, line, monkeypatch, capsys):
    mod = importlib.import_module(f"benchmarks.{name}")
    monkeypatch.setattr(sys, "argv", [f"{name}.py", *argv])
    with pytest.raises(SystemExit) as exit_:
        mod.main(argv) if inspect.signature(mod.main).parameters else mod.main()
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and line in err[-1], err[-3:]
