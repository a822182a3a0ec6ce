"""A vision-language model's training step under per-module layouts, in the real trainer on CPU
gloo, with the planner's prediction beside each (issue 43 items 6-7).

Spawns N local gloo workers. Every layout trains the same model (a preset of family vlm, default
vlm-tiny) on the same data (the built-in digits captions) with the same global batch, through
`meshspeed.train.trainer.Trainer` and, on an encoder-only rank, `modules_run.EncoderWorker`: the
step `meshspeed train` runs (forward, backward, the gradient reductions, one gradient norm over
both modules, AdamW), built from the run plan as the CLI builds it:

  one mesh          parallel.* only: dp N (the encoder replicated with the decoder)
  colocated         modules.encoder_dp N beside the decoder at tp 2 x dp N/2
  disagg 1+(N-1)    modules.encoder_ranks N-1: the encoder on the last rank, the decoder dp N-1
  disagg N/2+N/2    the encoder dp N/2 on the last half, the decoder dp N/2 on the first

Timing: after `--warmup` untimed steps the layouts' steps run interleaved (A B C D, then again)
`--steps` times, so a change of the machine's load falls on every layout alike; a step's time is
the slowest rank's, the value printed the median. Memory, each layout alone beforehand: the
bytes of every tensor alive on the rank after one step (parameters, gradient buckets, AdamW
state; what the process held before building the trainer subtracted) plus the most one more
step allocates and holds at once (torch.profiler's memory events: memory.cpu_peak_bytes),
maximum over ranks. Beside each: the planner's evaluation of the same settings
(plan/planner.evaluate: the run plan's memory of the fullest rank, and the predicted step with
its optimizer; per-module layouts through plan/modules.py), on the machine `meshspeed plan
--calibrate` stored here, else the named `cpu` defaults, and measured / predicted. The machine is
usually shared: read times with `uptime` beside them.

    python -m benchmarks.vlm [--nproc 4] [--batch 24] [--micro 2] [--steps 5] [--json rows.json]
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import statistics
import tempfile
import time
import warnings

import torch

from benchmarks import harness
from meshspeed.models import get_preset, preset_names
from meshspeed.plan import config
from meshspeed.plan.machine import calibration_path, get_machine
from meshspeed.plan.planner import evaluate

DEFAULTS = dict(nproc=4, preset="vlm-tiny", batch=24, micro=2, steps=5, warmup=1)
SEQ = 28  # 16 image tokens + "the digit 7" + its end token (tests/train/test_vlm_trainer.py)


def layouts(n: int) -> list[tuple[str, dict]]:
    """(name, the settings `meshspeed train` takes) of each layout at n ranks."""
    out = [("one mesh", {"parallel.tp": 1})]
    if n % 2 == 0:
        out.append(("colocated", {"parallel.tp": 2, "modules.encoder_dp": n}))
    out.append((f"disagg 1+{n - 1}", {"parallel.tp": 1, "modules.encoder_ranks": str(n - 1)}))
    if n % 2 == 0 and n >= 4:
        h = n // 2
        out.append((f"disagg {h}+{h}", {"parallel.tp": 1, "modules.encoder_ranks": f"{h}-{n - 1}"}))
    return out


def decoder_dp(n: int, settings: dict) -> int:
    ranks = settings.get("modules.encoder_ranks", "")
    enc = len(range(int(ranks.split("-")[0]), n)) if ranks else 0
    return (n - enc) // settings["parallel.tp"]


def base_settings(args) -> list[tuple[str, str]]:
    return [
        ("model.preset", args.preset), ("train.objective", "sft"), ("data.path", "digits"),
        ("train.seq_len", str(SEQ)), ("train.global_batch_size", str(args.batch)),
        ("train.micro_batch_size", str(args.micro)), ("train.dtype", "float32"),
        ("train.eval_interval", "0"), ("train.warmup_steps", "1"), ("train.steps", "1000"),
    ]  # fmt: skip


def _cfg(args, settings: dict, run_dir: str):
    pairs = base_settings(args) + [(k, str(v)) for k, v in settings.items()] + [("run.dir", run_dir)]
    return config.load(None, pairs)


def machine():
    """What the planner predicts with here: this machine's calibration, else the cpu defaults."""
    return get_machine("calibrated" if os.path.exists(calibration_path()) else "cpu")


def predicted(args, settings: dict) -> dict:
    with tempfile.TemporaryDirectory() as d:
        r = evaluate(_cfg(args, {}, d), args.nproc, machine(), settings, headroom=0.0)
    if "rejected" in r:
        raise SystemExit(f"benchmarks/vlm: the planner refuses {settings}: {r['rejected']}")
    return r["predicted"]


def _build(args, ctx, settings: dict, run_dir: str):
    from meshspeed.plan.run_plan import make_plan
    from meshspeed.train.modules_run import EncoderWorker, encoder_only
    from meshspeed.train.trainer import Trainer

    cfg = _cfg(args, settings, run_dir)
    plan = make_plan(cfg, ctx.world_size, ranks=False)
    plan.device, plan.device_info["backend"] = ctx.device.type, ctx.backend
    return (EncoderWorker if encoder_only(plan, ctx) else Trainer)(cfg, ctx, plan)


def _live_bytes() -> int:
    """Bytes of the distinct storages of every tensor this process holds."""
    gc.collect()
    with warnings.catch_warnings():  # isinstance on torch.distributed's deprecated aliases warns
        warnings.simplefilter("ignore")
        return harness.storage_bytes([o for o in gc.get_objects() if isinstance(o, torch.Tensor)])


def _peak(args, ctx, settings: dict, run_dir: str) -> int:
    """This rank's bytes for one layout alone: what a trained step leaves alive + the most the
    next step allocates and holds at once."""
    from meshspeed.memory.count import cpu_peak_bytes

    before = _live_bytes()
    trainer = _build(args, ctx, settings, run_dir)
    trainer.train_step(0)  # AdamW's state exists after the first step
    live = _live_bytes() - before
    peak = cpu_peak_bytes(functools.partial(trainer.train_step, 1))
    del trainer
    gc.collect()
    return live + peak


def worker(args_dict: dict, out: str) -> None:
    from meshspeed import comm

    args = argparse.Namespace(**args_dict)
    torch.set_num_threads(1)  # ranks share the cores: one thread each, as every benchmark here
    ctx = comm.init()
    runs = layouts(ctx.world_size)
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {name: os.path.join(tmp, f"{i}") for i, (name, _) in enumerate(runs)}  # this rank's
        # once untimed first: what a process builds once for any trainer (data, groups) is not
        # the layout's
        _peak(args, ctx, runs[0][1], dirs[runs[0][0]] + "w")
        mem = {name: harness.rank_max(ctx, _peak(args, ctx, s, dirs[name] + "m")) for name, s in runs}
        trainers = {name: _build(args, ctx, s, dirs[name]) for name, s in runs}
        times: dict[str, list[float]] = {name: [] for name, _ in runs}
        for step in range(args.warmup + args.steps):
            for name, trainer in trainers.items():  # interleaved: noise falls on every layout alike
                t0 = time.perf_counter()
                trainer.train_step(step)
                dt = harness.rank_max(ctx, time.perf_counter() - t0)
                if step >= args.warmup:
                    times[name].append(dt)
    if ctx.rank == 0:
        harness.emit(out, {"times": times, "mem": mem})
    ctx.close()


def main(argv=None):
    p = harness.parser(__doc__)
    for k, v in DEFAULTS.items():
        p.add_argument(f"--{k}", type=type(v), default=v)
    p.add_argument("--json", default="", help="write the rows to this file")
    args = p.parse_args(argv)
    harness.require_positive(p, args, "nproc", "batch", "micro", "steps")
    if args.nproc < 2:
        p.error(f"--nproc {args.nproc}: the layouts need at least 2 ranks")
    if args.preset not in preset_names() or get_preset(args.preset).family != "vlm":
        p.error(f"--preset {args.preset}: not a vlm preset; try vlm-tiny")
    dps = sorted({decoder_dp(args.nproc, s) for _, s in layouts(args.nproc)})
    if any(args.batch % d for d in dps):
        p.error(f"--batch {args.batch}: must be a multiple of each layout's decoder dp {dps}")
    if any((args.batch // d) % args.micro for d in dps):
        p.error(f"--micro {args.micro}: must divide --batch / decoder dp for each of {dps}")
    preds = {name: predicted(args, s) for name, s in layouts(args.nproc)}  # refused: before spawning
    res = harness.spawn_collect(worker, args.nproc, vars(args), name="vlm")
    m = machine()
    print(
        f"vlm layouts in the trainer, {args.preset}, {args.batch} images x {SEQ} tokens "
        f"(micro-batch {args.micro}), {args.nproc} gloo ranks; predicted on machine {m.name!r} "
        f"({m.peak_tflops * 1e3:.1f} GFLOP/s x {m.matmul_eff:g}, {m.shared_cores} shared cores)"
    )
    head = ("layout", "step ms", "pred ms", "meas/pred", "peak MiB", "pred MiB", "meas/pred")
    print(f"{head[0]:<16} " + " ".join(f"{h:>9}" for h in head[1:]))
    rows, base = [], None
    for name, settings in layouts(args.nproc):
        ms = statistics.median(res["times"][name]) * 1e3
        pred = preds[name]
        pms, mib, pmib = pred["step_s"] * 1e3, res["mem"][name] / 2**20, pred["memory_bytes"] / 2**20
        base = base or ms
        print(f"{name:<16} {ms:9.1f} {pms:9.1f} {ms / pms:9.2f} {mib:9.2f} {pmib:9.2f} {mib / pmib:9.2f}")
        rows.append({"layout": name, "settings": settings, "step_ms": ms, "pred_ms": pms,
                     "peak_bytes": res["mem"][name], "pred_bytes": pred["memory_bytes"],
                     "vs_one_mesh": ms / base, "machine": m.name})  # fmt: skip
    print("step time / one mesh: " + ", ".join(f"{r['layout']} {r['vs_one_mesh']:.2f}" for r in rows))
    if args.json:
        harness.write_json(args.json, "rows", args, rows=rows)
    return rows


if __name__ == "__main__":
    main()
