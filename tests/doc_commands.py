"""The commands the docs show, read from their fenced shell blocks, and the one rule that
shortens them for a CPU test (docs/testing.md, "Every documented command is a test").

A command is a line of a ```bash / ```sh / ```console / ```shell block of README.md or
docs/*.md (continued by a trailing backslash, `# ...` comments dropped, `a && b` two commands),
or a `$ ` line of a ```text block, whose following lines are the output the page shows. Only
`meshspeed ...`, `python ...` and `torchrun ...` commands are kept (and `pip install`, which the
test lists as not run).

The shortening, applied by `shorten` and nothing else:
- `meshspeed train` (also under torchrun) gets `--train.steps 2 --checkpoint.interval 0`
  appended, unless it is a `--dry-run` or `--help`;
- `meshspeed bench comm` gets `--max-bytes 64K --iters 2 --warmup 1`;
- `meshspeed generate` gets `--max-new-tokens 4`;
- `python -m benchmarks.NAME` gets QUICK[NAME], the benchmark's own size flags at toy values;
- a usage synopsis (a line with `[--flag ...]` options) is not run: its `--help` must list
  every flag it shows.
Later flags win, so an appended flag overrides the page's. Every command runs in a fresh
temporary working directory holding links to the repository's configs/ and examples/, so
relative paths (`--run.dir runs/pp`, `--out data/...`) land there and nothing is written in the
checkout or in ~/.cache/meshspeed's calibrations.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHELL = ("bash", "sh", "console", "shell")
PROGRAMS = ("meshspeed", "python", "torchrun", "pip")

TRAIN_SHORT = ["--train.steps", "2", "--checkpoint.interval", "0"]
BENCH_COMM_SHORT = ["--max-bytes", "64K", "--iters", "2", "--warmup", "1"]
GENERATE_SHORT = ["--max-new-tokens", "4"]
# each benchmark's own flags at toy sizes (the slow tier's smoke sizes in tests/test_benchmarks.py)
QUICK: dict[str, list[str]] = {
    "train_step": "--nproc 2 --steps 2 --rounds 1 --warmup 1 --batch 4 --seq-len 32",
    "sparse_linear": "--iters 1 --shapes 128x256@64",
    "pipeline": "--microbatches 4 --micro 2 --seq-len 16 --layers 2 --dim 64 --warmup 1 --rounds 1",
    "sparse_accuracy": "--preset tiny --steps 4 --batch 4 --seq-len 32 --eval-batches 1 --finish 1 "
    "--update-interval 2 --runs dense",
    "build_memory": "--dim 64 --layers 2 --vocab 256 --ffn 256 --tp 2",
    "placement_overhead": "--iters 5",
    "memory": "--dim 64 --layers 2 --seq 32 --steps 1 --no-zero3",
    "zero3": "--model tiny --layers 3 --nproc 2 --steps 2 --rounds 1 --warmup 1 --batch 4 --seq-len 32",
    "parallelize": "--layers 2 --dim 64 --vocab 2048 --seq-len 64 --steps 1 --rounds 1",
    "moe": "--ep 2 --dim 32 --hidden 64 --tokens 64 --steps 1 --pp-ep 2 --pp-dim 32 --pp-seq 16",
    "generate": "--hidden 64 --layers 2 --vocab 256 --batch 2 --prompt-len 8 --new 4 --rounds 1 --device cpu",
    "context_parallel": "--seq 128 --heads 4 --kv-heads 2 --head-dim 16 --steps 1",
    "vlm": "--nproc 2 --batch 4 --text 8 --steps 1 --warmup 0",
    "tp_overlap": "--tp 2 --dim 128 --seq 32 --batch 2 --steps 1 --rounds 1 --chunks 2",
    "sparse_step": "--preset tiny --steps 7 --interval 3 --repeat 1 --batch 4 --seq-len 32",
    "gpu_report": "",
    "trainer_overhead": "--presets tiny --dtypes float32 --steps 1 --rounds 1",
    "planner": "--nproc 2 --steps 4 --layouts 3 --batch 4 --seq 32",
    "planner_published": "--only 'DGXC, Llama 3.1 8B'",
}
QUICK = {k: shlex.split(v) for k, v in QUICK.items()}


@dataclasses.dataclass
class Command:
    page: str  # README.md or docs/NAME.md
    line: int  # of the command's first line in the page
    text: str  # the command alone (continuations joined, no comment, no `&&`, no `> FILE`)
    argv: list[str]
    shown: list[str]  # output lines the page shows after a `$ ` command ('...' dropped)
    stdout_to: str | None = None  # `> FILE`

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}:{' '.join(self.argv[:4])}"

    @property
    def synopsis(self) -> bool:
        return any(a.startswith("[") for a in self.argv)

    @property
    def benchmark(self) -> str | None:
        """NAME of `python -m benchmarks.NAME` or `python benchmarks/NAME.py`."""
        a = self.argv
        if a[:2] == ["python", "-m"] and len(a) > 2 and a[2].startswith("benchmarks."):
            return a[2].split(".", 1)[1]
        if a[:1] == ["python"] and len(a) > 1 and re.fullmatch(r"benchmarks/\w+\.py", a[1]):
            return a[1][len("benchmarks/") : -3]
        return None


def pages() -> list[str]:
    docs = os.path.join(ROOT, "docs")
    return ["README.md"] + [f"docs/{n}" for n in sorted(os.listdir(docs)) if n.endswith(".md")]


def _split(text: str) -> list[str]:
    """`a && b` -> [a, b]; `cmd # comment` -> cmd."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars="&|;<>")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    parts, cur = [], []
    for tok in lexer:
        if tok in ("&&", ";", "||"):
            parts.append(cur)
            cur = []
        else:
            cur.append(tok)
    return [p for p in parts + [cur] if p]


def _lines(body: str, first: int) -> list[tuple[int, str]]:
    """Logical lines (backslash continuations joined) with their line numbers."""
    out, buf, start = [], "", None
    for i, ln in enumerate(body.splitlines()):
        if start is None:
            start = first + i
        if ln.rstrip().endswith("\\"):
            buf += ln.rstrip()[:-1] + " "
            continue
        out.append((start, buf + ln))
        buf, start = "", None
    return out


def parse_page(page: str) -> list[Command]:
    with open(os.path.join(ROOT, page)) as f:
        text = f.read()
    found = []
    for m in re.finditer(r"^```(\w*)[^\n]*\n(.*?)^```", text, re.M | re.S):
        lang, body = m.group(1), m.group(2)
        first = text[: m.start()].count("\n") + 2
        prompted = lang not in SHELL
        if prompted and not re.search(r"^\s*\$ ", body, re.M):
            continue  # output or a diagram, not commands
        cmds: list[Command] = []
        for line, ln in _lines(body, first):
            stripped = ln.strip()
            if prompted and not stripped.startswith("$ "):
                if cmds and stripped and stripped != "...":
                    cmds[-1].shown.append(stripped)
                continue
            stripped = stripped.removeprefix("$ ")
            for argv in _split(stripped):
                if argv[0] not in PROGRAMS:
                    continue
                out = None
                if ">" in argv:
                    i = argv.index(">")
                    argv, out = argv[:i], argv[i + 1]
                cmds.append(Command(page, line, shlex.join(argv), argv, [], out))
        found += cmds
    return found


def commands() -> list[Command]:
    return [c for p in pages() for c in parse_page(p)]


def flags(argv: list[str]) -> list[str]:
    """The --flags of a synopsis line (inside its [...] options too)."""
    return [m for a in argv for m in re.findall(r"--[\w.-]+", a)]


def shorten(argv: list[str]) -> list[str]:
    """The documented command as the test runs it (the module's docstring is the rule)."""
    argv = list(argv)
    if argv[0] == "torchrun":
        i = argv.index("-m")
        return argv[: i + 2] + shorten(["meshspeed", *argv[i + 2 :]])[1:]
    if argv[0] == "meshspeed" and len(argv) > 1:
        if argv[1] == "train" and not {"--dry-run", "--help", "-h"} & set(argv):
            return argv + TRAIN_SHORT
        if argv[1:3] == ["bench", "comm"]:
            return argv + BENCH_COMM_SHORT
        if argv[1] == "generate":
            return argv + GENERATE_SHORT
        return argv
    cmd = Command("", 0, "", argv, [])
    if cmd.benchmark is not None:
        return argv + QUICK.get(cmd.benchmark, [])
    return argv
