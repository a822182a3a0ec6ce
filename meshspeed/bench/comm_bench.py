"""`meshspeed bench comm`: an nccl-tests-class collective benchmark.

For every op and size it times meshspeed's default path ("auto"), any algorithms asked for,
and the raw torch.distributed call. As in nccl-tests, a round launches a burst of async calls
back to back and waits for them all; rounds alternate between the paths (ABBA order) so that
machine noise hits all of them alike. Time per row is the 20%-trimmed mean over rounds of the
burst's time per call (robust to outlier rounds, yet close to the mean's efficiency), counted
from when the last rank started it (see _span). \
(Single blocking calls vary by ±35% on a 2-core machine running 4
ranks; bursts bring that to a few percent.) Bandwidths follow
nccl-tests: algbw = bytes / time, busbw = algbw × the op's bus factor (all_reduce 2(p-1)/p,
all_gather / reduce_scatter / all_to_all (p-1)/p, broadcast 1), so busbw is comparable
across ops and world sizes. Sizes follow nccl-tests too: the whole buffer (all_gather: the
output; reduce_scatter and all_to_all: the input), rounded down to a multiple of p elements.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from meshspeed import comm
from meshspeed.bench.comm_fit import choices, fit_and_predict, fit_errors, fmt_size, plot
from meshspeed.comm import cost_model
from meshspeed.comm.raw import raw_call

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "int64": torch.int64,
}
REDUCING = ("all_reduce", "reduce_scatter")


def bus_factor(op: str, p: int) -> float:
    return {"all_reduce": 2 * (p - 1) / p, "broadcast": 1.0}.get(op, (p - 1) / p)


def parse_size(text: str) -> int:
    """`1K`, `8M`, `1G`, `4096` → bytes (binary multiples, as nccl-tests)."""
    t = text.strip().upper().removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    num = t[:-1] if t[-1:] in "KMG" else t
    try:
        value = int(float(num) * mult)
    except ValueError:
        raise comm.ConfigError(
            f"size {text!r} is not a size; use bytes or a K/M/G suffix, e.g. 1K, 8M"
        ) from None
    if value < 1:
        raise comm.ConfigError(f"size {text!r} must be at least 1 byte")
    return value


@dataclass
class BenchConfig:
    ops: list[str]
    min_bytes: int
    max_bytes: int
    factor: float
    dtype: str
    redop: str
    warmup: int
    iters: int
    algos: list[str]  # "auto" = meshspeed's default path
    check: bool
    json_path: str | None
    plot_path: str | None
    save_params: bool
    params_path: str | None


def sizes(cfg: BenchConfig) -> list[int]:
    out, s = [], cfg.min_bytes
    while s <= cfg.max_bytes:
        out.append(int(s))
        s = s * cfg.factor if cfg.factor > 1 else s + cfg.min_bytes
    return out


def _inputs(op: str, nbytes: int, dtype: torch.dtype, p: int, rank: int):
    """Buffers for one call: (input, output, elements of the whole buffer). Values are small
    integers that depend on rank and position, so results are exactly checkable."""
    esize = torch.empty(0, dtype=dtype).element_size()
    count = max(p, nbytes // esize // p * p)
    per_rank = count // p
    n_in = per_rank if op == "all_gather" else count
    x = ((torch.arange(n_in) % 7) + rank + 1).to(dtype)
    out = torch.empty(
        count if op == "all_gather" else per_rank if op == "reduce_scatter" else count, dtype=dtype
    )
    return x, out, count


def _expected(op: str, count: int, dtype: torch.dtype, p: int, rank: int, redop: str) -> torch.Tensor:
    per = count // p
    base = torch.arange(count) % 7
    if op == "all_reduce" or op == "reduce_scatter":
        stack = torch.stack([(base + r + 1).double() for r in range(p)])
        full = {"sum": stack.sum(0), "avg": stack.mean(0), "max": stack.amax(0), "min": stack.amin(0)}[redop]
        return full if op == "all_reduce" else full[rank * per : (rank + 1) * per]
    if op == "all_gather":
        return torch.cat([(torch.arange(per) % 7 + r + 1).double() for r in range(p)])
    if op == "broadcast":
        return (base + 1).double()
    # all_to_all: block j of rank r goes to rank j
    return torch.cat([(base[rank * per : (rank + 1) * per] + r + 1).double() for r in range(p)])


def _meshspeed_call(op: str, algo: str, group, x, out, redop: str, async_op: bool = False):
    """Like the raw call, reuses preallocated buffers, so both sides do the same work."""
    a = None if algo == "auto" else algo
    return {
        "all_reduce": lambda: comm.all_reduce(x, group, redop, algo=a, async_op=async_op),
        "all_gather": lambda: comm.all_gather(x, group, out=out, algo=a, async_op=async_op),
        "reduce_scatter": lambda: comm.reduce_scatter(x, group, redop, out=out, algo=a, async_op=async_op),
        "broadcast": lambda: comm.broadcast(x, group, 0, async_op=async_op),
        "all_to_all": lambda: comm.all_to_all(x, group, out=out, algo=a, async_op=async_op),
    }[op]


def _span(world, t0: float, t1: float, one_node: bool) -> float:
    """Seconds the burst took once every rank had joined. On one node perf_counter is one
    system-wide clock, so this is last finish − last start: ranks leave the preceding barrier
    up to milliseconds apart on a busy machine, and that skew is not the collective's time.
    Across nodes clocks differ, so fall back to the slowest rank's own elapsed time."""
    if one_node:
        t = comm.all_reduce(torch.tensor([t0, t1], dtype=torch.float64), world, "max")
        return t[1].item() - t[0].item()
    return comm.all_reduce(torch.tensor([t1 - t0], dtype=torch.float64), world, "max").item()


def _count_wrong(op, algo, world, nbytes, dtype, redop) -> int:
    p, rank = world.size, world.rank
    x, out, count = _inputs(op, nbytes, dtype, p, rank)
    got = _meshspeed_call(op, algo, world, x, out, redop)() if algo != "raw" else None
    if algo == "raw":
        raw_call(op, world, x, out, redop)()
        got = out if op in ("all_gather", "reduce_scatter", "all_to_all") else x
    elif op in ("all_reduce", "broadcast"):
        got = x
    want = _expected(op, count, dtype, p, rank, redop)
    tol = 0.0 if redop != "avg" else 1e-2 * want.abs().max().item()
    wrong = int(((got.double() - want).abs() > tol).sum()) if got.shape == want.shape else want.numel()
    return int(comm.all_reduce(torch.tensor([wrong]), world).item())


def trimmed_mean(xs: list[float], cut: float = 0.2) -> float:
    xs = sorted(xs)
    k = int(len(xs) * cut)
    kept = xs[k : len(xs) - k] or xs
    return sum(kept) / len(kept)


# Rounds of one size whose interquartile range exceeds this fraction of their median are
# noisy: timed again up to NOISY_RETRIES times, and left out of the fit and the choices if
# they stay noisy (the nearest quiet size decides there; an op with none keeps the built-in).
NOISY_SPREAD = 0.25
NOISY_RETRIES = 2


def relative_spread(xs: list[float]) -> float:
    """Interquartile range over median: robust to one outlier round, large when the machine's
    load changed during the measurement."""
    xs = sorted(xs)
    if len(xs) < 2:
        return 0.0
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return (q[2] - q[0]) / max(statistics.median(xs), 1e-12)


def _time_rounds(calls: dict, algos: list[str], rounds: int, burst: int, world, one_node: bool) -> dict:
    """Seconds per call of each path, one entry per round (ABBA order between paths)."""
    times: dict[str, list[float]] = {a: [] for a in algos}
    for r in range(rounds):
        for algo in algos if r % 2 == 0 else algos[::-1]:
            comm.barrier(world)
            t0 = time.perf_counter()
            handles = [calls[algo]() for _ in range(burst)]
            for h in handles:
                h.wait()
            times[algo].append(_span(world, t0, time.perf_counter(), one_node) / burst)
    return times


def _applicable(op: str, algo: str, world) -> bool:
    return algo in ("auto", "raw") or algo in cost_model.candidates(op, world.nodes, uneven=False)


def measure(cfg: BenchConfig, ctx, progress) -> list[dict]:
    world = ctx.world
    p, dtype = world.size, DTYPES[cfg.dtype]
    rows = []
    burst = min(8, cfg.iters)
    rounds = max(2, -(-cfg.iters // burst))
    plan = [(op, s) for op in cfg.ops for s in sizes(cfg)]
    for i, (op, nbytes) in enumerate(plan):
        redop = cfg.redop if op in REDUCING else "-"
        algos = ["raw"] + [a for a in cfg.algos if _applicable(op, a, world)]
        progress(i, len(plan), op, nbytes)
        calls = {}
        for algo in algos:
            x, out, count = _inputs(op, nbytes, dtype, p, world.rank)
            calls[algo] = (
                raw_call(op, world, x, out, cfg.redop, async_op=True)
                if algo == "raw"
                else _meshspeed_call(op, algo, world, x, out, cfg.redop, async_op=True)
            )
            for _ in range(cfg.warmup):
                calls[algo]().wait()
        # A size whose rounds spread widely (another job took the cores mid-way) is timed again
        # rather than fitted; spans are all-reduced, so every rank makes the same decision.
        times, spread = {}, float("inf")
        for _attempt in range(1 + NOISY_RETRIES):
            t_try = _time_rounds(calls, algos, rounds, burst, world, ctx.num_nodes == 1)
            s_try = max(relative_spread(ts) for ts in t_try.values())
            if s_try < spread:
                times, spread = t_try, s_try
            if spread <= NOISY_SPREAD:
                break
        esize = torch.empty(0, dtype=dtype).element_size()
        raw_t = trimmed_mean(times["raw"])
        for algo in algos[1:]:
            t = trimmed_mean(times[algo])
            bytes_ = count * esize
            resolved = (
                comm.select_algo(world, op, bytes_, None)
                if algo == "auto" and op != "broadcast"
                else ("native" if algo == "auto" else algo)
            )
            rows.append(
                {
                    "op": op,
                    "algo": algo,
                    "resolved": resolved,
                    "bytes": bytes_,
                    "count": count,
                    "dtype": cfg.dtype,
                    "redop": redop,
                    "time_us": t * 1e6,
                    "algbw_gbps": bytes_ / t / 1e9,
                    "busbw_gbps": bytes_ / t / 1e9 * bus_factor(op, p),
                    "raw_busbw_gbps": bytes_ / raw_t / 1e9 * bus_factor(op, p),
                    "raw_time_us": raw_t * 1e6,
                    "wrong": _count_wrong(op, algo, world, nbytes, dtype, cfg.redop) if cfg.check else 0,
                    "spread": spread,
                    "noisy": spread > NOISY_SPREAD,
                }
            )
    progress(len(plan), len(plan), "", 0)
    return rows


def format_table(rows: list[dict], p: int, backend: str) -> str:
    head = (
        f"# meshspeed bench comm: {p} ranks, backend {backend}; "
        "time per call = trimmed mean over rounds of 8-call bursts\n"
        f"# {'size':>8} {'count':>10} {'type':>8} {'redop':>5} {'op':>14} {'algo':>12} {'time':>9} "
        f"{'algbw':>7} {'busbw':>7} {'#wrong':>6} {'raw busbw':>9} {'vs raw':>6} {'model':>9}\n"
        f"# {'(B)':>8} {'(elements)':>10} {'':>8} {'':>5} {'':>14} {'':>12} {'(us)':>9} "
        f"{'(GB/s)':>7} {'(GB/s)':>7} {'':>6} {'(GB/s)':>9} {'':>6} {'(us)':>9}"
    )
    lines = [head]
    for r in rows:
        algo = r["algo"] if r["algo"] != "auto" else f"auto:{r['resolved']}"
        lines.append(
            f"  {fmt_size(r['bytes']):>8} {r['count']:>10} {r['dtype']:>8} {r['redop']:>5} {r['op']:>14} "
            f"{algo:>12} "
            f"{r['time_us']:>9.1f} {r['algbw_gbps']:>7.3f} {r['busbw_gbps']:>7.3f} {r['wrong']:>6} "
            f"{r['raw_busbw_gbps']:>9.3f} {r['busbw_gbps'] / r['raw_busbw_gbps']:>6.2f} "
            f"{r.get('predicted_us', 0):>9.1f}"
        )
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    """The numbers the acceptance criteria ask about, per op: the default path against raw."""
    out = ["# default path (auto) busbw / raw busbw, median over sizes >= 1 MiB:"]
    for op in dict.fromkeys(r["op"] for r in rows):
        big = [
            r["busbw_gbps"] / r["raw_busbw_gbps"]
            for r in rows
            if r["op"] == op and r["algo"] == "auto" and r["bytes"] >= 1 << 20
        ]
        if big:
            out.append(f"#   {op:<15} {statistics.median(big):.3f}  ({len(big)} sizes)")
    if len(out) == 1:
        out[0] += " (no rows of 1 MiB or more)"
    errs = [abs(r["predicted_us"] - r["time_us"]) / r["time_us"] for r in rows if "predicted_us" in r]
    if errs:
        out.append(
            f"# cost model: median |predicted - measured| / measured = {statistics.median(errs):.1%} "
            f"over {len(errs)} rows; per op: "
            + ", ".join(f"{op} {e:.1%}" for op, e in fit_errors(rows).items())
        )
    noisy = [r for r in rows if r["noisy"]]
    if noisy:
        out.append(
            f"# noisy (rounds spread > {NOISY_SPREAD:.0%} after {NOISY_RETRIES} retries), not fitted and "
            f"not used to choose (the nearest quiet size decides): {len(noisy)} rows, e.g. {noisy[0]['op']} "
            f"{fmt_size(noisy[0]['bytes'])} ({noisy[0]['spread']:.0%})"
        )
    wrong = sum(r["wrong"] for r in rows)
    out.append(f"# wrong elements: {wrong}")
    return "\n".join(out)


def worker(cfg: BenchConfig) -> None:
    """Runs on every rank (spawned or under torchrun); rank 0 prints and writes files."""
    ctx = comm.init()
    if ctx.world_size < 2:
        raise comm.ConfigError(
            "bench comm needs at least 2 ranks: pass --nproc 2 or more, or launch with torchrun"
        )
    lead = ctx.rank == 0
    tty = sys.stderr.isatty()

    def progress(i, n, op, nbytes):
        if not lead:
            return
        msg = f"[{i:>3}/{n}] {op} {fmt_size(nbytes)}" if op else f"[{n}/{n}] done"
        if tty:
            print(f"\r{msg:<50}", end="" if op else "\n", file=sys.stderr, flush=True)
        elif i % max(1, n // 10) == 0 or not op:
            print(msg, file=sys.stderr, flush=True)

    rows = measure(cfg, ctx, progress)
    if lead:
        params = fit_and_predict(rows, ctx)
        print(format_table(rows, ctx.world_size, ctx.backend))
        print(summary(rows))
        print("# fitted link parameters (alpha us, beta = 1/bandwidth GB/s, gamma = 1/reduce rate GB/s):")
        for key, (a, b, c) in sorted(params.values.items()):
            fitted = key.split(".")[0] in params.fitted
            if fitted and (key.endswith("intra") or ctx.num_nodes > 1):
                print(
                    f"#   {key:<13} alpha={a * 1e6:8.2f} us  "
                    f"beta=1/{1 / b / 1e9 if b else float('inf'):7.2f} GB/s"
                    f"  gamma=1/{1 / c / 1e9 if c else float('inf'):7.2f} GB/s"
                )
        print("# algorithms runs on this machine will use (measured fastest at each size; the rest native):")
        print("\n".join(choices(params, rows, ctx.world.nodes, ctx.backend)))
        if cfg.save_params:
            where = cost_model.save(ctx.backend, params, cfg.params_path)
            print(
                f"# saved to {where}: later runs on this machine (same host, cores and torch) choose "
                "their collective algorithms from it; MESHSPEED_LINK_PARAMS=none ignores it"
            )
        if cfg.json_path:
            with open(cfg.json_path, "w") as f:
                json.dump(rows, f, indent=1)
            print(f"# rows written to {cfg.json_path}")
        if cfg.plot_path:
            plot(rows, cfg.plot_path, ctx.world_size)
            print(f"# plot written to {cfg.plot_path}")
    comm.barrier(ctx.world)
    ctx.close()
