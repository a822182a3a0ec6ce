"""`meshspeed bench comm`: the collective benchmark (nccl-tests columns + the raw torch call)."""

from __future__ import annotations

import argparse

from meshspeed.comm import ConfigError, cost_model

EXAMPLES = """examples:
  meshspeed bench comm --nproc 4 --check
  meshspeed bench comm --nproc 4 --ops all_reduce,reduce_scatter --min-bytes 1K \
--max-bytes 8M --algo auto,ring,hd
  torchrun --nnodes 2 --nproc-per-node 8 -m meshspeed bench comm --max-bytes 1G --json out.json

Each row times meshspeed's default path ("auto", shown as auto:<algorithm it chose>) or the
algorithm named, and the raw torch.distributed call on the same buffers in the same run;
"vs raw" is their busbw ratio. The fitted alpha-beta-gamma parameters are saved (see
--params) and used from then on to choose algorithms.
"""


def register(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks", description="Benchmarks.")
    bsub = bench.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    p = bsub.add_parser(
        "comm",
        help="collective bandwidth and latency (nccl-tests style)",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--ops",
        default="all_reduce,all_gather,reduce_scatter,broadcast,all_to_all",
        help="comma-separated collectives to time (default: all five)",
    )
    p.add_argument("--min-bytes", default="1K", help="smallest message, bytes or with K/M/G (default 1K)")
    p.add_argument("--max-bytes", default="64M", help="largest message (default 64M)")
    p.add_argument("--factor", type=float, default=2.0, help="size multiplier between rows (default 2)")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16, float16 or int64 (default float32)")
    p.add_argument(
        "--redop", default="sum", help="reduction for all_reduce/reduce_scatter: sum, avg, max, min"
    )
    p.add_argument("--warmup", type=int, default=3, help="untimed calls per algorithm and size (default 3)")
    p.add_argument(
        "--iters",
        type=int,
        default=160,
        help="timed calls per algorithm and size, in rounds of 8-call bursts (default 160: "
        "on a busy machine fewer rounds leave ±5%% noise in each row)",
    )
    p.add_argument(
        "--algo",
        default="auto",
        help="comma-separated: auto (meshspeed's default path), native, ring, hd, hier, bruck, "
        "pairwise, or all; each is compared side by side with raw torch (default auto)",
    )
    p.add_argument(
        "--check", action="store_true", help="verify every result against a reference; count wrong elements"
    )
    p.add_argument(
        "--nproc",
        type=int,
        default=4,
        help="local worker processes to spawn when not under torchrun (default 4)",
    )
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="draw busbw against size, one line per op/algorithm")
    p.add_argument(
        "--params",
        metavar="FILE",
        default=None,
        help=f"where to save the fitted link parameters (default {cost_model.params_path()})",
    )
    p.add_argument(
        "--no-save", action="store_true", help="fit and print the link parameters but do not save them"
    )
    p.set_defaults(func=run)


def _config(args):
    from meshspeed.bench.comm_bench import DTYPES, OPS, REDUCING, BenchConfig, parse_size

    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    bad = [o for o in ops if o not in OPS]
    if bad or not ops:
        raise ConfigError(
            f"--ops {args.ops!r}: unknown {', '.join(bad) or '(none given)'}; valid: {', '.join(OPS)}"
        )
    every = sorted({a for o in ops for a in cost_model.ALGOS[o]})
    algos = [a.strip() for a in args.algo.split(",") if a.strip()]
    if "all" in algos:
        algos = ["auto"] + every
    bad = [a for a in algos if a not in every + ["auto"]]
    if bad or not algos:
        raise ConfigError(
            f"--algo {args.algo!r}: unknown {', '.join(bad) or '(none given)'}; "
            f"valid: auto, all, {', '.join(every)}"
        )
    if args.dtype not in DTYPES:
        raise ConfigError(
            f"--dtype {args.dtype!r} is not supported; valid: float32, bfloat16, float16, int64"
        )
    if args.redop not in ("sum", "avg", "max", "min"):
        raise ConfigError(f"--redop {args.redop!r}: valid: sum, avg, max, min")
    if args.redop == "avg" and args.dtype == "int64" and any(o in REDUCING for o in ops):
        raise ConfigError("--redop avg needs a floating --dtype (int64 averages are not representable)")
    lo, hi = parse_size(args.min_bytes), parse_size(args.max_bytes)
    if lo > hi:
        raise ConfigError(f"--min-bytes {args.min_bytes} is larger than --max-bytes {args.max_bytes}")
    if args.factor < 1:
        raise ConfigError(f"--factor {args.factor} must be ≥ 1 (1 means a linear step of --min-bytes)")
    if args.iters < 1 or args.warmup < 0:
        raise ConfigError(f"--iters {args.iters} must be ≥ 1 and --warmup {args.warmup} ≥ 0")
    return BenchConfig(
        ops,
        lo,
        hi,
        args.factor,
        args.dtype,
        args.redop,
        args.warmup,
        args.iters,
        algos,
        args.check,
        args.json,
        args.plot,
        not args.no_save,
        args.params,
    )


def run(args) -> int:
    import sys

    from meshspeed.bench import comm_bench
    from meshspeed.comm import launch, launched

    try:
        cfg = _config(args)
        if args.plot:
            import importlib.util

            if importlib.util.find_spec("matplotlib") is None:
                raise ConfigError("--plot needs matplotlib: pip install matplotlib")
        if launched():
            comm_bench.worker(cfg)
            return 0
        if args.nproc < 2:
            raise ConfigError(f"--nproc {args.nproc}: bench comm needs at least 2 ranks")
    except ConfigError as err:
        print(f"meshspeed bench comm: {err}", file=sys.stderr)
        return 2
    return launch.spawn(comm_bench.worker, args.nproc, (cfg,))
