"""Every documented command is a test: each `meshspeed ...`, `python ...` and `torchrun ...`
command of a shell block in README.md and docs/*.md runs here, shortened by the one rule of
tests/doc_commands.py (docs/testing.md), and must exit 0 and print what the page shows after
it. A command that cannot run on a CPU machine is in NOT_RUN with its reason; a usage synopsis
(`[--flag ...]`) is checked against its `--help`. A command added to a page is collected without
editing this file; one this file cannot place (a file it reads that no fixture makes) fails.

README.md's commands are the CI tier; the other pages' are `slow` (`python -m pytest -m slow`).
A command shown on several pages runs once, under its first page (README.md first).
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

from tests import doc_commands, warm
from tests.faults.procs import env as clean_env

ROOT = doc_commands.ROOT

# command (a regex searched in the page's text of it) -> why it cannot run on this CPU machine
NOT_RUN = {
    r"^pip install": "the install itself: this test runs in the environment it made",
    r"^python -m pytest": "the test suite itself (CI runs it)",
    r"~/": "reads a user's model or corpus directory (~/...); on a GPU machine "
    "benchmarks/gpu_report.py runs the model-directory commands on a model it writes",
    r"runs/mixtral": "reads the checkpoint converted from ~/models/Mixtral-8x7B",
    r"--nnodes 2 .*\.\.\.": "two nodes; `...` stands for the rendezvous flags of the user's cluster",
    r"^meshspeed run --nproc 4 examples/hf_llama\.py$": "run as written (10 steps, its losses checked "
    "against one process) by tests/test_examples.py",
    r"^python -m benchmarks\.gpu_report --cpu-smoke$": "every section of the GPU report at toy sizes: "
    "576 s on 2 CPU cores, it has no smaller size; the slow tier runs it once in "
    "tests/kernels/test_gpu_report.py::test_cpu_smoke_runs_every_step",
}
# what a command needs installed (the dev extra; a minimal install skips it with the reason)
NEEDS = {
    r"--png|--plot|pp_trace true|post_training\.py": "matplotlib",
    r"benchmarks[./](parallelize|generate|trainer_overhead)\b|hf_llama\.py": "transformers",
    r"diffusers_dit\.py|\bdit-diffusers\b|\bdit-exported": "diffusers",
}
TIMEOUT = {"ci": 300, "slow": 900}

TRAIN_PY = '''"""A torchrun-style script (README's `meshspeed run ... train.py --lr 3e-4`)."""
import argparse
import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, default=1e-3)
args = parser.parse_args()
dist.init_process_group("gloo")
x = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(x)
assert x.item() == dist.get_world_size() * (dist.get_world_size() + 1) / 2
print(f"rank {dist.get_rank()} lr {args.lr} sum {x.item()}")
dist.destroy_process_group()
'''


def _distinct() -> list[doc_commands.Command]:
    seen, out = set(), []
    for c in doc_commands.commands():
        key = tuple(doc_commands.shorten([a for a in c.argv if not a.startswith("[")]))
        if c.synopsis:
            key = ("synopsis",) + tuple(c.argv)
        if key in seen:
            continue
        seen.add(key)
        out.append(c)
    return out


COMMANDS = _distinct()


def _reason(cmd: doc_commands.Command) -> str | None:
    for pattern, why in NOT_RUN.items():
        if re.search(pattern, cmd.text):
            return why
    return None


def _params():
    for c in COMMANDS:
        marks = [] if c.page == "README.md" else [pytest.mark.slow]
        yield pytest.param(c, id=c.id, marks=marks)


def _env(cwd) -> dict:
    e = clean_env()
    e["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, [e.get("PYTHONPATH")])])
    e["MESHSPEED_LINK_PARAMS"] = os.path.join(cwd, "link_params.json")  # not ~/.cache's
    e["MESHSPEED_MACHINE"] = os.path.join(cwd, "machine.json")
    return e


def _argv(argv: list[str]) -> list[str]:
    """A page's argv as a process's: `meshspeed` and `python` are this interpreter's."""
    if argv[0] == "meshspeed":
        return [sys.executable, "-m", "meshspeed", *argv[1:]]
    if argv[0] == "python":
        return [sys.executable, *argv[1:]]
    if argv[0] == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *argv[1:]]
    return argv


def run(argv: list[str], cwd, timeout: int, stdout_to: str | None = None) -> subprocess.CompletedProcess:
    cmd = _argv(argv)
    if warm._warm_module(cmd) is not None:  # a warm command's timeout ends everything it started
        done = warm.run(cmd, cwd=str(cwd), env=_env(cwd), timeout=timeout, capture_output=True, text=True)
    else:
        done = _cold(cmd, cwd, timeout)
    if stdout_to:
        (cwd / stdout_to).write_text(done.stdout)
    return done


def _cold(cmd: list[str], cwd, timeout: int) -> subprocess.CompletedProcess:
    """A benchmark or torchrun, started cold. subprocess.run's timeout kills the command alone:
    the workers it started would run on, orphaned, taking the 2 cores from every later case (a
    slow tier that never ends). Here a command past its timeout and its process group get SIGTERM
    (a launcher stops its workers), then everything it had started is killed, and the case fails
    naming the command."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            cmd, cwd=str(cwd), env=_env(cwd), stdin=subprocess.DEVNULL, stdout=out, stderr=err, text=True,
            start_new_session=True,
        )  # fmt: skip
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            started = _descendants(proc.pid)  # before the signal: then they are still its children
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                pass
            for pid in [proc.pid, *started]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            out.seek(0)
            err.seek(0)
            tail = f"{out.read()[-2000:]}\n{err.read()[-2000:]}"
            pytest.fail(f"{shlex.join(cmd)} ran past its {timeout} s; the end of its output:\n{tail}")
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, proc.returncode, out.read(), err.read())


def _descendants(pid: int) -> list[int]:
    kids = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [d for k in map(int, kids) for d in (k, *_descendants(k))]


def _ok(done: subprocess.CompletedProcess, what) -> None:
    out = f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert done.returncode == 0, f"{what}: exit {done.returncode}\n{out}"


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """A directory holding runs/tiny: the tiny preset trained 1 step (what `meshspeed train`
    leaves), made once for the commands that read a run."""
    d = tmp_path_factory.mktemp("trained")
    _ok(run(["meshspeed", "train", "--train.steps", "1", "--checkpoint.interval", "0"], d, 300), "runs/tiny")
    return d / "runs" / "tiny"


@pytest.fixture(scope="session")
def trained_big(tmp_path_factory):
    """runs/big: a model that tp 4 divides (inference.md's `--parallel.tp 4 --parallel.pp 2`);
    the tiny preset with 4 key/value heads, trained 1 step."""
    d = tmp_path_factory.mktemp("trained_big")
    argv = ["meshspeed", "train", "--model.n_kv_heads", "4", "--run.dir", "runs/big"]
    _ok(run(argv + ["--train.steps", "1", "--checkpoint.interval", "0"], d, 300), "runs/big")
    return d / "runs" / "big"


@pytest.fixture(scope="session")
def trained_dit(tmp_path_factory):
    """runs/dit-tiny: configs/dit-tiny.toml trained 2 steps, no end-of-run samples (docs/diffusion.md's
    `meshspeed sample --run runs/dit-tiny` commands read it)."""
    d = tmp_path_factory.mktemp("trained_dit")
    os.symlink(os.path.join(ROOT, "configs"), d / "configs")
    argv = ["meshspeed", "train", "--config", "configs/dit-tiny.toml", "--flow.sample_n", "0"]
    _ok(run(argv + ["--train.steps", "2", "--checkpoint.interval", "0"], d, 300), "runs/dit-tiny")
    return d / "runs" / "dit-tiny"


@pytest.fixture(scope="session")
def trained_vlm(tmp_path_factory):
    """runs/vlm-tiny: configs/vlm-tiny.toml trained 2 steps (docs/vlm.md's generate and convert
    commands read it)."""
    d = tmp_path_factory.mktemp("trained_vlm")
    os.symlink(os.path.join(ROOT, "configs"), d / "configs")
    argv = ["meshspeed", "train", "--config", "configs/vlm-tiny.toml", "--train.steps", "2"]
    _ok(run(argv + ["--checkpoint.interval", "0"], d, 300), "runs/vlm-tiny")
    return d / "runs" / "vlm-tiny"


@pytest.fixture(scope="session")
def trained_post(tmp_path_factory):
    """runs/sft and runs/dpo (from runs/sft) of docs/post-training.md, 2 steps each on the arith
    task's 400 questions, for the eval --pairs and generate --chat commands that read them."""
    d = tmp_path_factory.mktemp("trained_post")
    arith = ["meshspeed", "data", "prepare", "--kind", "arith", "--out", "data/arith", "--count", "400"]
    _ok(run(arith, d, 300), "meshspeed data prepare --kind arith")
    base = ["meshspeed", "train", "--nproc", "1", "--parallel.tp", "1", "--data.path", "data/arith"]
    base += ["--train.seq_len", "48", "--train.steps", "2", "--checkpoint.interval", "0"]
    _ok(run(base + ["--train.objective", "sft", "--run.dir", "runs/sft"], d, 300), "runs/sft")
    dpo = ["--train.objective", "dpo", "--model.init_from", "runs/sft", "--run.dir", "runs/dpo"]
    _ok(run(base + dpo, d, 300), "runs/dpo")
    return d / "runs"


def _workdir(tmp_path):
    for name in ("configs", "examples"):
        os.symlink(os.path.join(ROOT, name), tmp_path / name)
    return tmp_path


def _prepare(cmd: doc_commands.Command, cwd, request) -> None:
    """Make what the command reads, as the page's earlier commands (or the user) would."""
    text = cmd.text
    if re.search(r"runs/tiny\b|--checkpoint\.resume|\./tiny-llama", text):
        shutil.copytree(request.getfixturevalue("trained"), cwd / "runs" / "tiny", symlinks=True)
    if re.search(r"--run runs/dit-tiny\b", text):
        shutil.copytree(request.getfixturevalue("trained_dit"), cwd / "runs" / "dit-tiny", symlinks=True)
    if re.search(r"runs/vlm-tiny\b|vlm-hf\b", text):  # docs/vlm.md: the run, its PNG, its export
        shutil.copytree(request.getfixturevalue("trained_vlm"), cwd / "runs" / "vlm-tiny", symlinks=True)
        _ok(run(["python", "examples/vlm_shapes.py", "--png", "shape.png"], cwd, 300), "shape.png")
        if re.search(r"vlm-hf\b", text) and "--to-hf vlm-hf" not in text:
            convert = ["meshspeed", "convert", "--checkpoint", "runs/vlm-tiny", "--to-hf", "vlm-hf"]
            _ok(run(convert, cwd, 300), "runs/vlm-tiny to vlm-hf")
    # docs/diffusion.md's diffusers commands: the tiny random directory, the run, its export
    if re.search(r"(--checkpoint|--against) runs/dit-tiny\b", text):
        shutil.copytree(request.getfixturevalue("trained_dit"), cwd / "runs" / "dit-tiny", symlinks=True)
    if re.search(r"\bdit-diffusers\b", text) and "--out dit-diffusers" not in text:
        _ok(run(["python", "examples/diffusers_dit.py", "--out", "dit-diffusers"], cwd, 300), "dit-diffusers")
    if "--check dit-exported" in text:
        convert = ["meshspeed", "convert", "--checkpoint", "runs/dit-tiny", "--to-hf", "dit-exported"]
        _ok(run(convert, cwd, 300), "runs/dit-tiny to dit-exported")
    if re.search(r"runs/big\b", text):
        shutil.copytree(request.getfixturevalue("trained_big"), cwd / "runs" / "big", symlinks=True)
    # runs/sft for a command that starts from it; runs/dpo with runs/sft (its recorded reference)
    if re.search(r"--model\.init_from runs/sft\b", text):
        post = ["sft"]
    else:
        post = ["sft", "dpo"] if re.search(r"--checkpoint runs/(sft|dpo)\b", text) else []
    for name in post:
        shutil.copytree(request.getfixturevalue("trained_post") / name, cwd / "runs" / name, symlinks=True)
    if "./tiny-llama" in text:
        convert = ["meshspeed", "convert", "--checkpoint", "runs/tiny", "--to-hf", "tiny-llama"]
        _ok(run(convert, cwd, 300), "runs/tiny to tiny-llama")
    if "notes.txt" in text:  # eval scores the end of the file: give it a few hundred KB of text
        lib = os.path.dirname(os.__file__)
        src = [os.path.join(lib, n) for n in sorted(os.listdir(lib)) if n.endswith(".py")]
        body = "".join(open(p, errors="replace").read() for p in src)[:600_000]
        (cwd / "notes.txt").write_text(body)
    if "data/arith/" in text:  # docs/post-training.md: the arithmetic task's files, as its first command
        arith = ["meshspeed", "data", "prepare", "--kind", "arith", "--out", "data/arith", "--count", "400"]
        _ok(run(arith, cwd, 300), "meshspeed data prepare --kind arith")
    if re.search(r"\bdata/shapes\b", text) and "examples/vlm_captions.py" not in text:  # docs/vlm.md
        shapes = ["python", "examples/vlm_captions.py", "--out", "data/shapes", "--count", "40"]
        _ok(run(shapes, cwd, 300), "data/shapes")
        if "data/shapes.safetensors" in text and "--out data/shapes.safetensors" not in text:
            prep = ["meshspeed", "data", "prepare", "--images", "data/shapes", "--out"]
            _ok(run(prep + ["data/shapes.safetensors"], cwd, 300), "data/shapes.safetensors")
    if "prompts.txt" in text:
        (cwd / "prompts.txt").write_text("Once upon\nThe\n")
    if re.search(r"(^| )train\.py( |$)", text):
        (cwd / "train.py").write_text(TRAIN_PY)
    for name in re.findall(r"--layout-from (\S+)", text):  # the page's command that writes it
        maker = next(c for c in doc_commands.commands() if c.stdout_to == name)
        _calibrate(maker.text, cwd)
        _ok(run(doc_commands.shorten(maker.argv), cwd, 300, maker.stdout_to), maker.text)
    _calibrate(text, cwd)


def _calibrate(text: str, cwd) -> None:
    """`--device calibrated` reads MESHSPEED_MACHINE: made by the page's `meshspeed plan --calibrate`."""
    if "--device calibrated" in text and not (cwd / "machine.json").exists():
        _ok(run(["meshspeed", "plan", "--calibrate"], cwd, 300), "meshspeed plan --calibrate")


@pytest.mark.parametrize("cmd", list(_params()))
def test_documented_command_runs(cmd: doc_commands.Command, tmp_path, request):
    why = _reason(cmd)
    if why:
        pytest.skip(f"not run here: {why}")
    for pattern, module in NEEDS.items():
        if re.search(pattern, cmd.text):
            pytest.importorskip(module, reason=f"{module} is in the dev extra: pip install -e .[dev]")
    cwd = _workdir(tmp_path)
    timeout = TIMEOUT["ci" if cmd.page == "README.md" else "slow"]
    if cmd.synopsis:  # a usage line: the command's --help lists every flag it shows
        base = [a for a in cmd.argv if not a.startswith("[") and not a.startswith("--") and "]" not in a]
        base = base[: 3 if base[0] == "python" else 2]
        done = run(base + ["--help"], cwd, timeout)
        _ok(done, cmd.text)
        missing = [f for f in doc_commands.flags(cmd.argv) if f not in done.stdout]
        assert missing == [], f"{cmd.page}:{cmd.line}: {' '.join(base)} --help does not list {missing}"
        return
    _prepare(cmd, cwd, request)
    argv = doc_commands.shorten(cmd.argv)
    done = run(argv, cwd, timeout, cmd.stdout_to)
    _ok(done, f"{cmd.page}:{cmd.line}: {' '.join(argv)}")
    printed = {ln.strip() for ln in (done.stdout + done.stderr).splitlines()}
    missing = [ln for ln in cmd.shown if ln not in printed]
    assert missing == [], f"{cmd.page}:{cmd.line} shows lines the command did not print: {missing}"


def test_every_not_run_entry_matches_a_documented_command():
    texts = [c.text for c in doc_commands.commands()]
    stale = [p for p in NOT_RUN if not any(re.search(p, t) for t in texts)]
    assert stale == [], stale


def test_the_docs_show_commands_and_the_parser_finds_them():
    # the parser, on what the pages are known to hold: a wrong regex must not silently run nothing
    cmds = doc_commands.commands()
    by_page = {c.page for c in cmds}
    assert {"README.md", "docs/training.md", "docs/parallelism.md", "docs/benchmarks.md"} <= by_page
    texts = [c.text for c in cmds]
    assert "meshspeed pipeline show --schedule 1f1b --pp 4 --microbatches 8" in texts
    # a command continued over lines by a backslash is one command
    assert any(t.startswith("meshspeed train --parallel.pp 2 --parallel.vpp 2") for t in texts)
    shown = [c for c in cmds if c.shown]
    assert shown and all(c.argv[:2] == ["meshspeed", "train"] for c in shown)
    short = doc_commands.shorten(["meshspeed", "train", "--run.dir", "runs/pp"])
    assert short[-4:] == doc_commands.TRAIN_SHORT
    assert doc_commands.shorten(["meshspeed", "train", "--dry-run"]) == ["meshspeed", "train", "--dry-run"]


# ---------------------------------------------------------------- figures: the memory tables
BYTES = ("params", "grads", "optimizer", "activations", "total", "plan est.")
# reuse_fp32_param's optimizer holds a few hundred bytes of per-run bookkeeping beside the
# 51,415,040 B of moments and residuals (424, 464 and 632 B over three runs): that row's optimizer
# and total are compared to 1 KiB, every other byte exactly
LOOSE = {("reuse fp32 param (bf16)", "optimizer"): 1024, ("reuse fp32 param (bf16)", "total"): 1024}


def memory_table(text: str) -> dict[str, dict[str, int]]:
    """The byte columns of benchmarks/memory.py's table, by feature."""
    rows = {}
    for ln in text.splitlines():
        m = re.match(r"(\S.*?)\s{2,}([\d,]+(?:\s+[\d.,]+){8})$", ln)
        if m and not ln.startswith("feature"):
            cells = m.group(2).split()
            values = cells[:5] + cells[6:7]  # params .. total, plan est. (not vs base, times)
            rows[m.group(1)] = {k: int(v.replace(",", "")) for k, v in zip(BYTES, values)}
    return rows


def _page_table(page: str) -> dict[str, dict[str, int]]:
    with open(os.path.join(ROOT, page)) as f:
        block = re.search(r"```\n(memory features, CPU gloo.*?)```", f.read(), re.S)
    assert block, f"{page}: benchmarks/memory.py's table is gone"
    return memory_table(block.group(1))


def _differences(got: dict, want: dict) -> list[str]:
    out = [f"rows {sorted(set(got) ^ set(want))}"] if set(got) != set(want) else []
    for feature in set(got) & set(want):
        for col in BYTES:
            a, b = got[feature][col], want[feature][col]
            if abs(a - b) > LOOSE.get((feature, col), 0):
                out.append(f"{feature} {col}: {a:,} against {b:,}")
    return out


def test_the_memory_tables_of_the_two_pages_agree():
    bench, memory = _page_table("docs/benchmarks.md"), _page_table("docs/memory.md")
    assert len(bench) == 12, bench
    assert _differences(bench, memory) == []


@pytest.mark.slow
def test_the_memory_tables_are_what_the_benchmark_counts(tmp_path):
    # bytes do not depend on the step count: one timed step; the page's other defaults
    done = run(["python", "-m", "benchmarks.memory", "--steps", "1", "--no-zero3"], tmp_path, 900)
    _ok(done, "benchmarks.memory")
    fresh = memory_table(done.stdout)
    assert _differences(fresh, _page_table("docs/memory.md")) == []
