"""`meshspeed plan`: the parallel layouts for a model on a machine, ranked by predicted step time."""

from __future__ import annotations

import argparse
import json
import os
import sys

EXAMPLES = """examples:
  meshspeed plan --config configs/llama3-8b.toml --nodes 8 --gpus-per-node 8 --device h100
  meshspeed plan --model.preset llama3-70b --nproc 512 --device h200 --train.global_batch_size 512 --top 3
  meshspeed plan --config configs/tiny-moe.toml --nproc 4 --device calibrated --json > plan.json
  meshspeed train --config configs/tiny-moe.toml --layout-from plan.json     # the best layout
  meshspeed plan --calibrate                      # measure this machine (matmul rate, links)

Every layout printed passed the run plan (the checks `meshspeed train` makes) and fits the
device memory less --headroom by the run plan's own estimate. Settings given on the command line
(--parallel.tp 8, --memory.recompute full, ...) are fixed; the planner searches the rest: tp, pp,
cp, ep, ZeRO level, pipeline schedule, micro-batch size and recompute. Predicted times are a
model (compute at an achievable fraction of peak, collectives from the α-β cost model, the
schedule's simulated bubble): benchmarks/planner.py compares them with measured steps.
"""


def register(sub) -> None:
    from meshspeed.plan import config

    p = sub.add_parser(
        "plan",
        help="rank parallel layouts for a model on a machine",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", metavar="FILE.toml", help="a TOML preset (see configs/)")
    p.add_argument("--nodes", type=int, default=None, help="nodes (with --gpus-per-node; else --nproc)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="devices per node")
    p.add_argument("--device", default="h100", help="h100, h200, a100, b200, cpu, or calibrated")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense peak per device (TFLOP/s)")
    p.add_argument("--memory-gib", type=float, default=None, help="device memory (GiB)")
    p.add_argument("--mem-bw-gbs", type=float, default=None, help="device memory bandwidth (GB/s)")
    p.add_argument("--intra-gbs", type=float, default=None, help="link bandwidth inside a node (GB/s)")
    p.add_argument("--inter-gbs", type=float, default=None, help="link bandwidth between nodes (GB/s)")
    p.add_argument("--headroom", type=float, default=0.1, help="memory kept free (fraction, default 0.1)")
    p.add_argument("--top", type=int, default=5, help="layouts to print (default 5)")
    p.add_argument("--json", action="store_true", help='print {"layouts": [...]} best first')
    p.add_argument("--calibrate", action="store_true", help="measure this machine and store it")
    config.add_arguments(p)
    p.set_defaults(func=run)


def _size(n: float) -> str:
    return f"{n / 2**30:6.1f} GiB" if n >= 2**30 else f"{n / 2**20:6.1f} MiB"


def _machine(args):
    from meshspeed.plan.machine import get_machine

    return get_machine(
        args.device,
        peak_tflops=args.peak_tflops,
        memory_gib=args.memory_gib,
        mem_bw_gbs=args.mem_bw_gbs,
        intra_gbs=args.intra_gbs,
        inter_gbs=args.inter_gbs,
        gpus_per_node=args.gpus_per_node,
    )


# The largest world planned: above the biggest clusters built (~2·10^5 devices). The cost model
# reads each group's member list, so a plan's time grows with the world: about 20 s of CPU at
# 10^6 ranks, and hours at 10^7 before groups were formed in closed form.
MAX_WORLD = 2**20


def _world(args, cfg) -> int:
    from meshspeed.comm import ConfigError

    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        raise ConfigError(f"--gpus-per-node={args.gpus_per_node} must be ≥ 1; e.g. --gpus-per-node 8")
    if args.nodes is not None:
        if args.gpus_per_node is None or args.nodes < 1:
            raise ConfigError(
                f"--nodes {args.nodes} needs --gpus-per-node N (both ≥ 1); or give the world as --nproc"
            )
        world, what = args.nodes * args.gpus_per_node, f"--nodes {args.nodes} × --gpus-per-node"
    else:
        world, what = cfg.nproc, "--nproc"
    if world > MAX_WORLD:
        raise ConfigError(
            f"{what}={world:,} ranks is more than the planner takes ({MAX_WORLD:,}); plan at most "
            f"{MAX_WORLD:,} ranks (layouts repeat: plan one pod of the cluster)"
        )
    return world


def calibrate(args) -> int:
    import dataclasses
    import statistics

    from meshspeed.comm import cost_model
    from meshspeed.plan import config
    from meshspeed.plan.machine import MACHINES, measure_matmul_tflops, measure_sync_us, save_calibration

    world = config.load(args.config, config.overrides_from_args(args)).nproc
    tflops = measure_matmul_tflops()
    # tensor parallelism's pattern — compute, a blocking collective, compute — on `world` ranks
    # at once: what a step pays per collective here beyond the links' α-β (issue 45: tp layouts
    # measured 4-8x their α-β prediction on 2 shared cores)
    sizes = [g for g in range(2, world + 1) if world % g == 0]
    sync_us = {str(g): measure_sync_us(world, tflops, 1000.0, group_size=g) for g in sizes}
    links = cost_model.load("gloo")
    # `bench comm` fits each collective on its own ("native:all_gather.intra", ...); the machine
    # has one intra-node link, so take the median of those fits. Without a fit: the defaults.
    fitted = sorted(
        v[:2] for k, v in links.values.items() if k.startswith("native:") and k.endswith(".intra")
    )
    if fitted:
        a, beta = statistics.median(f[0] for f in fitted), statistics.median(f[1] for f in fitted)
    else:
        a, beta, _ = links.values["native.intra"]
    m = dataclasses.replace(
        MACHINES["cpu"],
        name="calibrated",
        peak_tflops=tflops,
        intra_gbs=1 / beta / 1e9,
        alpha_us=a * 1e6,
        gpus_per_node=args.gpus_per_node or MACHINES["cpu"].gpus_per_node,
        shared_cores=os.cpu_count() or 1,  # gloo ranks on this machine share its cores
        matmul_eff=1.0,  # the measured rate is already what a matmul achieves here
        sync_us=sync_us,
    )
    path = save_calibration(m)
    if fitted:  # say where the links came from; advise `bench comm` only when there was no fit
        where = f"links fitted by `meshspeed bench comm` ({links.source})"
    else:
        where = "links: the built-in defaults (run `meshspeed bench comm --nproc 4` first to fit them)"
    print(
        f"meshspeed plan: matmul {tflops * 1e3:.1f} GFLOP/s; {where}, "
        f"α {a * 1e6:.0f} µs, {1 / beta / 1e9:.2f} GB/s; a blocking collective between computes, "
        f"{world} ranks busy: " + ", ".join(f"{us:.0f} µs in groups of {g}" for g, us in sync_us.items())
        + f"; stored in {path}"
    )
    return 0


def run(args) -> int:
    from meshspeed.comm import ConfigError
    from meshspeed.plan import config
    from meshspeed.plan.planner import SEARCHED, rank_layouts, settings_args, train_command, why_lost

    if args.calibrate:
        return calibrate(args)
    try:
        overrides = config.overrides_from_args(args)
        cfg = config.load(args.config, overrides)
        machine = _machine(args)
        world = _world(args, cfg)
        if not 0 <= args.headroom < 1 or args.top < 1:
            raise ConfigError(f"--headroom {args.headroom} must be in [0, 1) and --top {args.top} ≥ 1")
        fixed = {}
        for key, _ in overrides:  # what the user pinned, typed as the loaded config holds it
            if key in SEARCHED:
                section, _, name = key.partition(".")
                fixed[key] = getattr(getattr(cfg, section), name)

        for key, value in (("data.path", cfg.data.path), ("data.tokenizer", cfg.data.tokenizer)):
            if value and value != "bytes" and not os.path.exists(value):  # planning reads no tokens
                print(
                    f"meshspeed plan: note: {key}={value!r} not found here; planned without it "
                    "(training needs it)",
                    file=sys.stderr,
                )

        def progress(i, n):
            if sys.stderr.isatty():
                print(f"\rmeshspeed plan: structure {i + 1}/{n}", end="", file=sys.stderr, flush=True)

        ok, rejected = rank_layouts(cfg, world, machine, fixed, args.headroom, progress)
    except ConfigError as err:
        print(f"meshspeed plan: {err}", file=sys.stderr)
        return 2
    if sys.stderr.isatty():
        print(file=sys.stderr)
    if args.json:
        print(json.dumps({"world_size": world, "machine": machine.name, "layouts": ok[: args.top]}))
        return 0 if ok else 1
    if not ok and not rejected:  # layout_space found no split: dp never divides the batch
        print(
            f"meshspeed plan: no layout to try: no split of {world:,} ranks into tp × pp × cp leaves a "
            f"data-parallel degree that divides train.global_batch_size={cfg.train.global_batch_size}; "
            f"raise it (e.g. --train.global_batch_size {world}) or plan fewer ranks"
        )
        return 1
    if not ok:
        reasons = sorted({r["rejected"] for r in rejected})[:5]
        print(
            "meshspeed plan: no layout passes the run plan and fits; first reasons:\n  "
            + "\n  ".join(reasons)
        )
        return 1
    best = ok[0]
    print(f"{len(ok)} layouts fit on {world} × {machine.name}; {len(rejected)} rejected. Best first:")
    for i, r in enumerate(ok[: args.top]):
        p = r["predicted"]
        lost = "" if i == 0 else f"  (loses on {why_lost(r, best)})"
        print(
            f"{i + 1}. {p['step_s'] * 1e3:9.1f} ms/step  {p['tokens_per_s']:12,.0f} tok/s  "
            f"MFU {p['mfu']:6.1%}  {_size(p['memory_bytes'])}/rank  bubble {p['bubble']:.2f}{lost}"
        )
        print(f"     {settings_args(r['settings'])}")
    print(f"run the best: {train_command(args.config, overrides, world, best['settings'])}")
    return 0
