"""`meshspeed pipeline show`: print, simulate and draw a pipeline schedule.

Pure data and arithmetic (meshspeed.parallel.pipeline): no devices, no torch.distributed.
"""

from __future__ import annotations

import argparse
import sys
from fractions import Fraction

COST_HELP = """\
cost convention:
  --cost-f/-b/-w are the times of ONE microbatch through ONE RANK'S WHOLE SHARE of the
  model (with --vpp chunks per rank each chunk costs 1/vpp of that). B is the input-gradient
  part of the backward and W the weight-gradient part: zero-bubble runs them as separate
  steps, every other schedule runs one full backward costing b + w. --cost-p2p is the
  latency of one send->recv message (sends are asynchronous, receives block).
  The defaults f = b = w = 1, p2p = 0 (full backward = 2 forwards) make 1F1B's bubble exactly
  (pp-1)/(m+pp-1): 3/11 at --pp 4 --microbatches 8. Costs accept 2, 0.5 or 1/3.

bubble = idle time of all ranks / (pp * makespan).
peak activations = per rank, the most (microbatch, chunk) pairs whose F has run and whose last
  backward piece (B, or W for zero-bubble, since W still reads the saved inputs) has not;
  with vpp > 1 each counts 1/vpp of a rank's layers.
F|B overlap = adjacent F->B pairs on a rank where the B does not depend on that F, so the two
  could run concurrently and hide each other's communication (the point of the extra warmup).

examples:
  meshspeed pipeline show --schedule 1f1b --pp 4 --microbatches 8
  meshspeed pipeline show --schedule interleaved --pp 4 --microbatches 8 --vpp 2 --png il.png
  meshspeed pipeline show --schedule all --pp 4 --microbatches 8 --vpp 2
"""


def _cost(text: str) -> Fraction:
    try:
        value = Fraction(text)
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"cost {text!r} is not a number; use e.g. 1, 0.5 or 1/3") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"cost {text!r} is negative; costs are times >= 0")
    return value


def register(subparsers) -> None:
    from meshspeed.parallel.pipeline import SCHEDULES

    parser = subparsers.add_parser("pipeline", help="pipeline-parallel schedules: print, simulate, draw")
    sub = parser.add_subparsers(dest="pipeline_command", metavar="ACTION")
    show = sub.add_parser(
        "show",
        help="print a schedule per rank, its simulated timeline, bubble and peak activations",
        description="Build a pipeline schedule, check it (complete, ordered, deadlock-free), simulate it\n"
        "with the given per-action costs and print it.\n\nschedules:\n"
        + "\n".join(f"  {name:<25} {fn.summary}" for name, fn in SCHEDULES.items()),
        epilog=COST_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    show.add_argument(
        "--schedule",
        default="1f1b",
        choices=list(SCHEDULES) + ["all"],
        help="schedule name, or 'all' to compare every schedule in one table (default 1f1b)",
    )
    show.add_argument("--pp", type=int, default=4, help="pipeline ranks (default 4)")
    show.add_argument("--microbatches", "-m", type=int, default=8, help="microbatches per step (default 8)")
    show.add_argument(
        "--vpp",
        type=int,
        default=None,
        help="model chunks per rank for the interleaved schedules (default 2; the others always use 1)",
    )
    show.add_argument(
        "--cost-f", type=_cost, default=Fraction(1), help="forward time per microbatch per rank (default 1)"
    )
    show.add_argument(
        "--cost-b", type=_cost, default=Fraction(1), help="input-gradient backward time (default 1)"
    )
    show.add_argument(
        "--cost-w", type=_cost, default=Fraction(1), help="weight-gradient backward time (default 1)"
    )
    show.add_argument(
        "--cost-p2p",
        type=_cost,
        default=Fraction(0),
        help="latency of one point-to-point message (default 0)",
    )
    show.add_argument(
        "--comms",
        action="store_true",
        help="list the SEND/RECV actions too (sF3.1>2 = send F3.1's output to rank 2)",
    )
    show.add_argument("--width", type=int, default=120, help="ASCII timeline width in columns (default 120)")
    show.add_argument(
        "--png",
        metavar="PATH",
        help="write a timeline PNG (needs matplotlib); with --schedule all one file per schedule, "
        "named PATH-<schedule>.png",
    )
    show.add_argument("--json", metavar="PATH", help="write schedule + simulated timeline as JSON")
    show.set_defaults(func=run_show)
    parser.set_defaults(func=lambda args: (parser.print_help(), 0)[1])


def _num(x) -> str:
    """Exact values print as decimals when short (28.5), else as fractions (85/3)."""
    if isinstance(x, Fraction):
        if x.denominator == 1:
            return str(x.numerator)
        d = x.denominator
        while d % 2 == 0:
            d //= 2
        while d % 5 == 0:
            d //= 5
        return f"{float(x):g}" if d == 1 else f"{x.numerator}/{x.denominator}"
    return f"{x:g}"


def _vpp_for(name: str, requested: int | None) -> int:
    from meshspeed.parallel.pipeline import get_schedule

    if get_schedule(name).interleaved:
        return 2 if requested is None else requested
    return 1 if requested is None else requested


def _png_path(path: str, name: str, many: bool) -> str:
    if not many:
        return path
    stem, dot, ext = path.rpartition(".")
    return f"{stem}-{name}.{ext}" if dot else f"{path}-{name}.png"


def run_show(args) -> int:
    from meshspeed.parallel.pipeline import SCHEDULES, Costs, ScheduleError, evaluate

    try:
        costs = Costs(args.cost_f, args.cost_b, args.cost_w, args.cost_p2p)
        if args.schedule == "all":
            # Non-interleaved schedules cannot take vpp > 1; they run at vpp 1 in the comparison.
            runs = [
                (name, _vpp_for(name, args.vpp if fn.interleaved else None)) for name, fn in SCHEDULES.items()
            ]
        else:
            runs = [(args.schedule, _vpp_for(args.schedule, args.vpp))]
        results = [evaluate(name, args.pp, vpp, args.microbatches, costs) for name, vpp in runs]
    except ScheduleError as e:
        hint = f"; use e.g. --microbatches {e.microbatches}" if e.microbatches else ""
        print(f"meshspeed pipeline show: error: {e}{hint}", file=sys.stderr)
        return 2

    if len(results) == 1:
        _print_one(results[0], args)
    else:
        _print_table(results, args)
    return _write_files(results, args)


def _cost_line(r, table: bool = False) -> str:
    c = r.costs
    if table:
        full = f"; non-split schedules run one full backward costing b+w={_num(c.b + c.w)}"
    else:
        full = "" if r.split else f" (one full backward costs b+w={_num(c.b + c.w)})"
    return f"costs f={_num(c.f)} b={_num(c.b)} w={_num(c.w)} p2p={_num(c.p2p)} per microbatch per rank{full}"


def _print_one(r, args) -> None:
    from meshspeed.parallel.pipeline import ascii_timeline, closed_form, fb_overlap, format_schedule

    print(f"schedule {r.name}  pp={r.pp}  vpp={r.vpp}  microbatches={r.microbatches}")
    print(_cost_line(r))
    print()
    actions = r.schedule if args.comms else [[a for a in acts if a.is_compute] for acts in r.schedule]
    print(
        "actions per rank (F3.1 = forward of microbatch 3 on chunk 1):" if r.vpp > 1 else "actions per rank:"
    )
    print(format_schedule(actions, show_chunk=r.vpp > 1))
    print()
    print(ascii_timeline(r, width=args.width))
    print()
    closed = closed_form(r.name, r.pp, r.vpp, r.microbatches, r.costs)
    closed_text = f"   closed form {closed[1]} = {_frac(closed[0])}" if closed else ""
    indep, total = fb_overlap(r.schedule, r.pp)
    rows = [
        ("makespan", _num(r.makespan)),
        ("bubble", _frac(r.bubble) + closed_text),
        ("bubble per rank", "  ".join(_frac(b, short=True) for b in r.bubble_per_rank)),
        (
            "peak activations",
            "  ".join(f"rank {i}: {n}" for i, n in enumerate(r.peak_activations))
            + ("  (microbatch-chunks)" if r.vpp > 1 else "  (microbatches)"),
        ),
        ("F|B overlap", f"{indep}/{total} adjacent F->B pairs independent"),
    ]
    for key, value in rows:
        print(f"{key:<18}{value}")


def _frac(x, short: bool = False) -> str:
    if isinstance(x, Fraction):
        if short:
            return f"{x.numerator}/{x.denominator}" if x.denominator != 1 else str(x.numerator)
        return (
            f"{x.numerator}/{x.denominator} = {float(x):.4f}"
            if x.denominator != 1
            else f"{x.numerator} = {float(x):.4f}"
        )
    return f"{x:.4f}"


def _print_table(results, args) -> None:
    from meshspeed.parallel.pipeline import closed_form, fb_overlap

    r0 = results[0]
    print(f"pp={r0.pp}  microbatches={r0.microbatches}")
    print(_cost_line(r0, table=True))
    print()
    header = ("schedule", "vpp", "makespan", "bubble", "closed form", "peak act/rank", "F|B overlap")
    rows = []
    for r in results:
        closed = closed_form(r.name, r.pp, r.vpp, r.microbatches, r.costs)
        indep, total = fb_overlap(r.schedule, r.pp)
        rows.append(
            (
                r.name,
                str(r.vpp),
                _num(r.makespan),
                _frac(r.bubble),
                f"{closed[1]} = {_frac(closed[0], short=True)}" if closed else "-",
                ",".join(map(str, r.peak_activations)),
                f"{indep}/{total}",
            )
        )
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    for row in [header] + rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    print()
    print(
        "peak act/rank counts microbatch-chunks (each 1/vpp of a rank's layers); see --help for definitions"
    )


def _write_files(results, args) -> int:
    from meshspeed.parallel.pipeline import draw_png, to_json

    if args.json:
        import json

        docs = [json.loads(to_json(r)) for r in results]
        with open(args.json, "w") as f:
            json.dump(docs[0] if len(docs) == 1 else {"schedules": docs}, f, indent=2)
        print(f"wrote {args.json}")
    if args.png:
        for r in results:
            try:
                path = draw_png(r, _png_path(args.png, r.name, len(results) > 1))
            except RuntimeError as e:
                print(f"meshspeed pipeline show: error: {e}", file=sys.stderr)
                return 2
            print(f"wrote {path}")
    return 0
