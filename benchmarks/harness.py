"""What every benchmark shares, written once: spawning workers and collecting what they found,
counting storage bytes, timing sides against each other, checking they computed the same
thing, and the settings both sides of a comparison use.

    res = spawn_collect(worker, nproc, args, name="tp_overlap")   # worker(args, out) ... emit(out, res)
    storage_bytes(model.parameters())                              # distinct storages, as allocated
    rounds = interleaved_rounds(ctx, {"meshspeed": a, "peer": b}, batch, rounds=3, steps=4)
    median, lo, hi = ratio(rounds["meshspeed"], rounds["peer"])   # peer / meshspeed per round

Benchmarks import this as `benchmarks.harness`, so they run as modules from the repository
root: `python -m benchmarks.train_step`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable

import torch

from meshspeed import comm
from meshspeed.memory import SavedBytes
from meshspeed.models import build_model, get_preset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# AdamW on both sides of every step-time comparison: decay on >= 2-D parameters only, no clipping
LR, BETAS, EPS, WD = 3e-4, (0.9, 0.95), 1e-8, 0.1
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Relative loss difference two sides may show and still be the same computation: float32 differs
# in summation order only; bf16 sides round differently (bf16 storage vs autocast)
RTOL = {"float32": 1e-5, "bfloat16": 3e-2}
# Variables of an enclosing job (torchrun, a test's worker) that a fresh job must not inherit
JOB_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


# ------------------------------------------------------------------------------ spawn and collect
def spawn_collect(worker: Callable, nproc: int, *args, name: str, each_rank: bool = False):
    """Run `worker(*args, out)` on `nproc` local gloo ranks and return what rank 0 passed to
    `emit(out, result)` (each_rank: a list of every rank's). When the workers fail, or one did
    not emit, print one line naming the benchmark and exit with their code (the launcher has
    already printed which rank failed and why)."""
    with tempfile.TemporaryDirectory() as out:
        code = comm.spawn(worker, nproc, (*args, out))
        paths = [_result_path(out, r) for r in (range(nproc) if each_rank else (0,))]
        if code or not all(os.path.exists(p) for p in paths):
            print(f"{name}: the workers failed (exit code {code}; see above)", file=sys.stderr)
            raise SystemExit(code or 1)
        results = []
        for p in paths:
            with open(p) as f:
                results.append(json.load(f))
    return results if each_rank else results[0]


def emit(out: str, result, rank: int = 0) -> None:
    """In a worker: hand `result` (JSON-able) back to spawn_collect as this rank's."""
    with open(_result_path(out, rank), "w") as f:
        json.dump(result, f)


def _result_path(out: str, rank: int) -> str:
    return os.path.join(out, f"rank{rank}.json")


def clean_env() -> dict[str, str]:
    """This process's environment without an enclosing job's rank variables."""
    return {k: v for k, v in os.environ.items() if k not in JOB_ENV}


def meshspeed_train(argv: list[str], run_dir: str, what: str = "meshspeed train", check: bool = True):
    """`python -m meshspeed train ARGV --run.dir RUN_DIR` from the repository root in a clean
    environment; its metrics.jsonl rows. When it fails: exit naming `what` with the run's
    stderr tail, or with check=False print its last line and return None (a benchmark that
    reports a failed setting as a row)."""
    cmd = [sys.executable, "-m", "meshspeed", "train", *argv, "--run.dir", run_dir]
    out = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True)
    path = os.path.join(run_dir, "metrics.jsonl")
    if out.returncode or not os.path.exists(path):
        if check:
            raise SystemExit(f"{what} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
        print(f"  {what} failed: {out.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# ------------------------------------------------------------------------------ command line
def parser(doc: str) -> argparse.ArgumentParser:
    """An argument parser whose --help is the benchmark's docstring (first paragraph, then the
    rest as written)."""
    head, _, rest = doc.partition("\n\n")
    return argparse.ArgumentParser(
        description=head, epilog=rest, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def require_positive(p: argparse.ArgumentParser, args, *names: str) -> None:
    """One parser error naming the first of `names` (attribute names) that is below 1."""
    for k in names:
        if getattr(args, k) < 1:
            p.error(f"--{k.replace('_', '-')}={getattr(args, k)} must be >= 1")


def write_json(path: str, what: str, args, **content) -> None:
    """Write {settings (the command line but --json), torch version, **content} to path."""
    settings = {k: v for k, v in vars(args).items() if k != "json"}
    with open(path, "w") as f:
        json.dump({"settings": settings, "torch": torch.__version__, **content}, f, indent=1)
    print(f"{what} written to {path}")


# ------------------------------------------------------------------------------ counting bytes
def storage_bytes(tensors: Iterable) -> int:
    """Bytes of the distinct storages behind `tensors` (a DTensor counts its local piece; None
    is skipped): a view counts its whole storage, once; a storage released by resize_(0)
    counts 0. Keyed by storage object, as meshspeed.memory.count_saved keys them, not by data
    pointer: released storages all point at address 0, and an address freed by resize_(0) is
    handed to the next tensor allocated."""
    counter = SavedBytes()
    with torch.no_grad():
        for t in tensors:
            to_local = getattr(t, "to_local", None)  # DTensor -> this rank's piece
            counter.add(to_local() if to_local is not None else t)
    return counter.bytes


# ------------------------------------------------------------------------------ timing
def rank_max(ctx, x: float) -> float:
    """The maximum of x over all ranks: a step takes as long as its slowest rank, and a layout
    needs the memory of its fullest."""
    return comm.all_reduce(torch.tensor([float(x)], dtype=torch.float64), ctx.world, "max").item()


def interleaved_rounds(
    ctx,
    sides: dict[str, Callable],
    batch: Callable[[int], tuple],
    rounds: int,
    steps: int,
    on_round: Callable[[int], None] | None = None,
) -> dict[str, list[float]]:
    """Per side, each round's median step time in ms. The sides run interleaved step by step,
    the order reversed every other step (A B B A ...), so a slow spell of a shared machine
    (seconds long on 2 cores) hits every side alike; every rank starts each step together
    (barrier), a step's time is the slowest rank's, the collector stays off inside a round.
    `sides[key](*batch(i))` runs step i (batch built before the clock starts)."""
    order = list(sides)
    out: dict[str, list[float]] = {key: [] for key in order}
    for r in range(rounds):
        local: dict[str, list[float]] = {key: [] for key in order}
        gc.collect()
        gc.disable()
        try:
            for s in range(steps):
                args = batch(s)
                for key in order if (r * steps + s) % 2 == 0 else order[::-1]:
                    comm.barrier(ctx.world)
                    t0 = time.perf_counter()
                    sides[key](*args)
                    local[key].append(time.perf_counter() - t0)
        finally:
            gc.enable()
        for key in order:
            worst = comm.all_reduce(torch.tensor(local[key], dtype=torch.float64), ctx.world, "max")
            out[key].append(statistics.median(worst.tolist()) * 1e3)
        if on_round is not None:
            on_round(r)
    return out


def ratio(base_ms: list[float], other_ms: list[float]) -> tuple[float, float, float]:
    """(median, lowest, highest) of other / base over rounds (> 1: base faster). Read a range
    that straddles 1 as a tie."""
    ratios = [o / b for b, o in zip(base_ms, other_ms)]
    return statistics.median(ratios), min(ratios), max(ratios)


# ------------------------------------------------------------------------------ agreement
def rel_diff(a: Iterable[float], b: Iterable[float]) -> float:
    """Largest relative difference between paired values (relative to a)."""
    return max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b))


def agree(a: Iterable[float], b: Iterable[float], rtol: float) -> bool:
    """True when every pair (a loss of each side, say) is equal within rtol."""
    return rel_diff(a, b) <= rtol


def mismatch_note(what: str) -> str:
    """The line a benchmark prints when its sides disagree: their times mean nothing then."""
    return f"(!) LOSS MISMATCH: {what} computed different losses; their times are not comparable"


def all_ranks_ok(ctx, ok: bool) -> bool:
    """True when every rank says ok, so all ranks skip a failed side together."""
    if ctx.world_size == 1:
        return ok
    return bool(comm.all_reduce(torch.tensor([1.0 if ok else 0.0]), ctx.world, "min").item())


def first_losses(step: Callable, data: list[tuple], group, n: int = 2) -> list[float]:
    """The mean over `group` of the loss `step` returns on each of the first n batches. Step 1
    checks the forward from the same weights, step 2 the optimizer update too."""
    out = []
    for i in range(n):
        loss = step(*data[i]).float().reshape(1).clone()
        out.append(comm.all_reduce(loss, group, "avg").item())
    return out


# ------------------------------------------------------------------------------ the same work
def optimizer_step(opt, loss_fn: Callable) -> Callable:
    """The training step every side times: zero the gradients, loss_fn(x, y), backward, the
    optimizer's step; returns the detached loss."""

    def step(x, y):
        opt.zero_grad()
        loss = loss_fn(x, y)
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def preset_model(preset: str, seq_len: int, seed: int, **overrides):
    """The preset's model (float32) with the given overrides and room for seq_len tokens:
    every side of a comparison starts from these weights."""
    cfg = get_preset(preset, **overrides)
    if seq_len > cfg.max_seq_len:
        cfg = get_preset(preset, max_seq_len=seq_len, **overrides)
    return build_model(cfg, seed=seed)


def token_batches(seed: int, vocab: int, batch: int, seq_len: int, dp_rank: int, dp: int, n: int = 4):
    """n global batches [batch, seq_len + 1] of random tokens, as (inputs, targets) of this dp
    rank's batch / dp rows: every layout sees the same global batch."""
    g = torch.Generator().manual_seed(seed + 1)
    rows, out = batch // dp, []
    for _ in range(n):
        t = torch.randint(0, vocab, (batch, seq_len + 1), generator=g)[dp_rank * rows : (dp_rank + 1) * rows]
        out.append((t[:, :-1].contiguous(), t[:, 1:].contiguous()))
    return out
