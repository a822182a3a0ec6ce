"""Peak memory of building a tensor-parallel model: the old path vs parameters born sharded.

Spawns `--tp` local gloo workers (one tensor-parallel group) once per mode, so the peaks of the
two modes never mix in one process:

  before  every rank builds the whole fp32 single-device model (models.build_model), then
          parallel.tensor.parallelize slices it: each rank briefly holds the full model
  after   parallel.materialize.build_parallel_model: built on the meta device, split, then
          only this rank's pieces are allocated, each drawn from the full initial value of one
          parameter at a time (the design promises at most one full parameter of transient
          memory beyond the rank's own pieces)

Per rank, memory is read from /proc/self/status: VmRSS right before building (after imports,
process-group and mesh setup; the peak-RSS counter is reset there through /proc/self/clear_refs
where the kernel allows) and VmHWM right after. Reported: the peak growth VmHWM_after -
VmRSS_before, the growth still resident after the build, the bytes the rank's parameters hold
(unique untyped storages: a piece that is a view of a bigger tensor counts that tensor), the
rank's own parameter bytes (numel x element size: the theoretical minimum) and the design's
bound, own bytes + the largest full parameter. Ratios: peak / full-model bytes (param count x
4), and before / after peak growth per rank.

The default model is a ~1B-parameter Llama (dim 2048, 12 layers, 16 heads, 8 KV heads, SwiGLU
8192, Llama-3 vocabulary of 128,256 tokens, tied embeddings as in Llama-3.2-1B): about 4 GiB
of fp32 weights, so `before` needs about 4 x 4.4 GiB on 4 ranks. The free memory
(MemAvailable) is checked before each job; --layers/--dim/--vocab shrink the model.

    python -m benchmarks.build_memory [--mode before|after|both] [--tp 4] [--layers 12] [--json FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time

import torch

from benchmarks import harness
from meshspeed import comm
from meshspeed.models import build_model, get_preset, param_count, preset_names, recipe_for
from meshspeed.parallel.materialize import build_parallel_model
from meshspeed.parallel.tensor import check_tp, parallelize

GIB = 2**30
MODES = ("before", "after")
# The ~1B default, on top of the llama3-8b preset (its RoPE theta, norm eps, max_seq_len).
ONE_B = dict(
    dim=2048, n_layers=12, n_heads=16, n_kv_heads=8, vocab_size=128256, ffn_hidden=8192, tie_embeddings=True
)
# Resident memory of one worker before it builds anything (torch, meshspeed, gloo, the mesh):
# measured at ~0.3 GiB; budgeted with a margin.
WORKER_BASE = int(0.4 * GIB)
HEADROOM = int(0.5 * GIB)  # left free for the rest of the machine


# ------------------------------------------------------------------------------ model
def model_config(args):
    """The benchmarked ModelConfig: --preset (default: the ~1B Llama) with the size flags."""
    base = dict(ONE_B) if args.preset is None else {}
    over = {}
    if args.dim is not None:
        over["dim"] = args.dim
        if args.preset is None and args.ffn is None:
            over["ffn_hidden"] = 4 * args.dim  # keep the default's 4x SwiGLU width
    for flag, field in (
        ("layers", "n_layers"),
        ("vocab", "vocab_size"),
        ("ffn", "ffn_hidden"),
        ("heads", "n_heads"),
        ("kv_heads", "n_kv_heads"),
        ("tie_embeddings", "tie_embeddings"),
    ):
        if getattr(args, flag) is not None:
            over[field] = getattr(args, flag)
    return get_preset(args.preset or "llama3-8b", **{**base, **over})


def warmup_config(config, tp: int):
    """The same family and structure at a few KiB: building it once through both paths makes
    each process import, and fault in the library code of, everything a build touches, so the
    measured growth is the model's and not a first call's (tens of MiB otherwise)."""
    small = dict(dim=2 * config.n_heads, n_layers=1, vocab_size=4 * tp, max_seq_len=16)
    if config.ffn_hidden is not None:
        small["ffn_hidden"] = 4 * tp
    if config.moe_ffn_hidden is not None:
        small["moe_ffn_hidden"] = 4 * tp
    return dataclasses.replace(config, **small)


def meta_params(config) -> list[tuple[str, torch.Size]]:
    """(FQN, full shape) of every parameter of the single-device model, in init order (a tied
    parameter once), from a model built on the meta device: no memory."""
    with torch.device("meta"):
        model = recipe_for(config).build()
    return [(n, p.shape) for n, p in model.named_parameters()]


def model_facts(config, tp: int) -> dict:
    params = meta_params(config)
    sizes = [(n, s, s.numel() * 4) for n, s in params]  # fp32
    count = sum(s.numel() for _, s in params)
    full = count * 4
    name, shape, largest = max(sizes, key=lambda t: t[2])
    # Resident peak of the old path: build_model draws each parameter into a temporary before
    # copying it in (pages of parameters not yet written are not resident), then parallelize
    # clones a piece before dropping the full parameter it came from.
    done, init_peak = 0, 0
    for _, _, b in sizes:
        init_peak = max(init_peak, done + 2 * b)
        done += b
    before_peak = max(init_peak, full + -(-largest // tp))
    layer_bytes = sum(b for n, _, b in sizes if n.startswith("layers.0."))
    return {
        "param_count": count,
        "param_count_formula": param_count(config),
        "full_bytes": full,
        "largest": {"name": name, "shape": list(shape), "bytes": largest},
        "layer_bytes": layer_bytes,
        "before_peak_estimate": before_peak,
    }


# ------------------------------------------------------------------------------ /proc
def vm_status() -> dict[str, int]:
    """VmRSS, VmHWM... of this process in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Vm"):
                key, val = line.split(":", 1)
                parts = val.split()
                out[key] = int(parts[0]) * (1024 if parts[-1] == "kB" else 1)
    return out


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: '5' > /proc/self/clear_refs), so the peak
    read after building is the build's, not an earlier transient's. False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    st = vm_status()
    return st["VmHWM"] <= st["VmRSS"] + 64 * 1024  # equal, up to pages touched in between


def mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# ------------------------------------------------------------------------------ worker
def worker(args_dict: dict, mode: str, out: str) -> None:
    args = argparse.Namespace(**args_dict)
    ctx = comm.init()
    try:
        mesh = comm.ParallelDims(tp=args.tp).build(ctx)
        config = model_config(args)
        recipe = recipe_for(config)
        check_tp(args.tp, recipe)
        small = warmup_config(config, args.tp)  # both paths, whatever the mode: equal baselines
        sp = args.sequence_parallel
        parallelize(build_model(small, seed=args.seed), mesh, recipe_for(small), sequence_parallel=sp)
        build_parallel_model(recipe_for(small), mesh, seed=args.seed, sequence_parallel=sp)
        gc.collect()
        comm.barrier(ctx.world)  # every rank set up: they build at the same time, as a job would
        reset = reset_peak()
        st0 = vm_status()
        t0 = time.perf_counter()
        if mode == "before":
            model = build_model(config, seed=args.seed)
            parallelize(model, mesh, recipe, sequence_parallel=sp)
        else:
            model = build_parallel_model(recipe, mesh, seed=args.seed, device="cpu", sequence_parallel=sp)
        seconds = time.perf_counter() - t0
        st1 = vm_status()
        named = list(model.named_parameters())  # a tied parameter once
        own = sum(p.numel() * p.element_size() for _, p in named)
        # Parameters whose storage is bigger than their values: views keeping a bigger tensor alive.
        views = [
            (n, p.untyped_storage().nbytes(), p.numel() * p.element_size())
            for n, p in named
            if p.untyped_storage().nbytes() > p.numel() * p.element_size()
        ]
        row = {
            "mode": mode,
            "rank": ctx.rank,
            "rss_before": st0["VmRSS"],
            "hwm_after": st1["VmHWM"],
            "rss_after": st1["VmRSS"],
            "peak_growth": st1["VmHWM"] - st0["VmRSS"],
            "retained": st1["VmRSS"] - st0["VmRSS"],
            "param_storage_bytes": harness.storage_bytes(p for _, p in named),
            "own_param_bytes": own,
            "build_s": seconds,
            "hwm_reset": reset,
            "oversized_storages": len(views),
            "oversized_storage_bytes": sum(s for _, s, _ in views),
            "oversized_examples": [f"{n} ({s} B storage for {b} B)" for n, s, b in views[:3]],
        }
        harness.emit(out, row, ctx.rank)
        comm.barrier(ctx.world)
    finally:
        ctx.close()


# ------------------------------------------------------------------------------ launcher
def memory_refusal(mode: str, facts: dict, tp: int, n_layers: int) -> str | None:
    """One line refusing `mode` when MemAvailable cannot hold it, else None. Both modes are
    budgeted at the old path's peak (the whole model per rank): 'after' is meant to need far
    less, but a regression in it must not push a shared machine into the OOM killer."""
    avail = mem_available()
    if avail is None:
        return None
    need = tp * (facts["before_peak_estimate"] + WORKER_BASE) + HEADROOM
    if need <= avail:
        return None
    # How many blocks would fit, the rest (embeddings, transient) unchanged.
    layer, rest = facts["layer_bytes"], facts["before_peak_estimate"] - n_layers * facts["layer_bytes"]
    fit = int((avail - HEADROOM) / tp - WORKER_BASE - rest) // layer if layer else 0
    hint = f"--layers {fit} (or --dim/--vocab)" if fit >= 1 else "--vocab/--dim"
    per_rank = (facts["before_peak_estimate"] + WORKER_BASE) / GIB
    return (
        f"build_memory: --mode {mode} needs ~{need / GIB:.1f} GiB ({tp} ranks x "
        f"{per_rank:.1f} GiB: the whole fp32 model per rank) but "
        f"MemAvailable is {avail / GIB:.1f} GiB; shrink the model with {hint}"
    )


def _g(n: float) -> str:
    return f"{n / GIB:7.3f}"


def _h(n: float) -> str:
    return f"{n / GIB:.3f} GiB" if abs(n) >= GIB else f"{n / 2**20:.1f} MiB"


def report(results: dict, facts: dict, config, args) -> dict:
    full, largest = facts["full_bytes"], facts["largest"]
    print(
        f"\nbuild memory, {args.tp} gloo ranks (tp {args.tp}), fp32, seed {args.seed}"
        f"{', sequence parallel' if args.sequence_parallel else ''}"
    )
    print(
        f"model: {config.family} dim {config.dim} x {config.n_layers} layers, heads {config.n_heads}/"
        f"{config.num_kv_heads} kv, ffn {config.ffn_hidden}, vocab {config.vocab_size}, "
        f"{'tied' if config.tie_embeddings else 'untied'} embeddings: {facts['param_count']:,} parameters"
    )
    print(
        f"full model (params x 4): {full:,} B = {full / GIB:.3f} GiB; largest full parameter "
        f"{largest['name']} {largest['shape']}: {largest['bytes']:,} B = {largest['bytes'] / GIB:.3f} GiB"
    )
    print(
        "peak = VmHWM after building - VmRSS before; retained = VmRSS after - VmRSS before; "
        "storage = unique parameter storages; own = parameter values (the minimum); "
        "bound = own + largest full parameter (the design's promise)"
    )
    hdr = (
        f"{'mode':<7} {'rank':>4} {'peak bytes':>15} {'peak GiB':>8} {'/full':>6} {'retained GiB':>12} "
        f"{'storage bytes':>15} {'stor GiB':>8} {'own bytes':>15} {'own GiB':>7} {'bound GiB':>9} "
        f"{'build s':>7}"
    )
    print(hdr)
    print("-" * len(hdr))
    out_rows = []
    for mode, rows in results.items():
        for r in rows:
            r["peak_over_full"] = r["peak_growth"] / full
            r["bound"] = r["own_param_bytes"] + largest["bytes"]
            print(
                f"{mode:<7} {r['rank']:>4} {r['peak_growth']:>15,} {_g(r['peak_growth']):>8} "
                f"{r['peak_over_full']:6.3f} {_g(r['retained']):>12} {r['param_storage_bytes']:>15,} "
                f"{_g(r['param_storage_bytes']):>8} {r['own_param_bytes']:>15,} "
                f"{_g(r['own_param_bytes']):>7} "
                f"{_g(r['bound']):>9} {r['build_s']:7.1f}"
            )
            out_rows.append(r)
    ratios = {}
    if all(m in results for m in MODES):
        pairs = zip(results["before"], results["after"])
        per_rank = [b["peak_growth"] / max(a["peak_growth"], 1) for b, a in pairs]
        worst = max(r["peak_growth"] for r in results["before"]) / max(
            max(r["peak_growth"] for r in results["after"]), 1
        )
        ratios = {"per_rank": per_rank, "max_rank": worst}
        print(
            "\nbefore / after peak growth: "
            + "  ".join(f"rank {i} {x:.2f}x" for i, x in enumerate(per_rank))
            + f"   largest rank peak: {worst:.2f}x"
        )
    notes = []
    for mode, rows in results.items():
        if not all(r["hwm_reset"] for r in rows):
            notes.append(
                f"{mode}: VmHWM could not be reset before building on some rank; its peak may "
                "include an earlier transient"
            )
        for r in rows:
            if r["oversized_storages"]:
                notes.append(
                    f"{mode}: rank {r['rank']}: {r['oversized_storages']} parameters are views "
                    f"keeping {_h(r['oversized_storage_bytes'])} of storage alive "
                    f"(parameters hold {_h(r['param_storage_bytes'])} for "
                    f"{_h(r['own_param_bytes'])} of values), e.g. " + "; ".join(r["oversized_examples"])
                )
        if mode == "after":
            for r in rows:
                if r["peak_growth"] > r["bound"] + max(0.05 * full, 32 * 2**20):  # RSS is noisy by MiBs
                    notes.append(
                        f"after: rank {r['rank']}: peak {_h(r['peak_growth'])} exceeds own + one "
                        f"full parameter = {_h(r['bound'])}"
                    )
    for n in notes:
        print(f"(!) {n}")
    return {"rows": out_rows, "ratios": ratios, "notes": notes}


def parse_args(argv):
    p = harness.parser(__doc__)
    p.add_argument(
        "--mode",
        default="both",
        choices=["before", "after", "both"],
        help="before: build_model + parallelize; after: build_parallel_model; both (default), "
        "in separate jobs",
    )
    p.add_argument("--tp", type=int, default=4, help="tensor-parallel degree = gloo ranks (default 4)")
    p.add_argument(
        "--preset",
        default=None,
        choices=preset_names(),
        help="start from this preset instead of the ~1B Llama (size flags still apply)",
    )
    p.add_argument("--dim", type=int, help="model width (default 2048; the FFN follows at 4x unless --ffn)")
    p.add_argument("--layers", type=int, help="transformer blocks (default 12)")
    p.add_argument("--vocab", type=int, help="vocabulary size (default 128256)")
    p.add_argument("--ffn", type=int, help="SwiGLU hidden width (default 4 x dim)")
    p.add_argument("--heads", type=int, help="query heads (default 16)")
    p.add_argument("--kv-heads", type=int, help="key/value heads (default 8)")
    p.add_argument(
        "--tie-embeddings",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="share the output projection with the embedding (default: tied for the ~1B model, "
        "the preset's otherwise)",
    )
    p.add_argument("--sequence-parallel", action="store_true", help="parallelize with sequence parallelism")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="write the figures (settings, model, rows, ratios) here")
    args = p.parse_args(argv)
    for k in ("tp", "dim", "layers", "vocab", "ffn", "heads", "kv_heads"):
        v = getattr(args, k)
        if v is not None and v < 1:
            p.error(f"--{k.replace('_', '-')}={v} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = model_config(args)
        check_tp(args.tp, recipe_for(config))
    except (ValueError, comm.ConfigError) as e:
        print(f"build_memory: {str(e).strip().splitlines()[0]}", file=sys.stderr)
        return 2
    facts = model_facts(config, args.tp)
    assert facts["param_count"] == facts["param_count_formula"], facts  # the meta build and the formula agree
    modes = list(MODES) if args.mode == "both" else [args.mode]
    refusal = memory_refusal(modes[0], facts, args.tp, config.n_layers)
    if refusal:
        print(refusal, file=sys.stderr)
        return 1
    print(
        f"build_memory: {args.tp} gloo ranks, modes {', '.join(modes)} (one job each); "
        f"{facts['param_count']:,} parameters, {facts['full_bytes'] / GIB:.3f} GiB fp32",
        flush=True,
    )
    t0 = time.perf_counter()
    results: dict[str, list[dict]] = {}
    for i, mode in enumerate(modes):
        # Checked again before each later job: the machine is shared.
        refusal = memory_refusal(mode, facts, args.tp, config.n_layers) if i else None
        if refusal:
            print(refusal, file=sys.stderr)
            return 1
        print(f"[{mode}] building on {args.tp} ranks ...", flush=True)
        results[mode] = harness.spawn_collect(
            worker, args.tp, vars(args), mode, name=f"build_memory ({mode})", each_rank=True
        )
        gc.collect()
    out = report(results, facts, config, args)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    if args.json:
        model = {"config": {k: getattr(config, k) for k in config.field_names()}, **facts}
        harness.write_json(args.json, "figures", args, model=model, **out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
