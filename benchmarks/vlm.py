"""A vision-language model's step under per-module layouts, side by side on CPU gloo, with the
run plan's prediction beside each (issue 43 item 7).

Spawns N local gloo workers. Every layout runs the same global batch of the same model (a
preset of family vlm, default vlm-tiny, same seeded weights) through benchmarks/vlm_layouts.py,
the step the parity tests prove equal to one device (tests/parallel/test_seam.py): the encoder
(ViT + projector) on its own ModuleMesh, the decoder on another, the image features re-sliced
between them by meshspeed/parallel/seam.py, each module's gradients reduced over its own dp:

  same degrees      colocated, encoder dp N and decoder dp N (the one-mesh data-parallel step)
  per-module        colocated, encoder dp N while the decoder runs tp 2 x dp N/2
  disagg 1+(N-1)    the encoder on rank 0, the decoder dp N-1 on the rest
  disagg N/2+N/2    the encoder dp N/2 on the first half, the decoder dp N/2 on the second

Forward + backward + the gradient reductions, no optimizer (the same for every layout). Timing:
after `--warmup` untimed steps, the layouts run interleaved (A B C D, then again) `--steps`
times; a step's time is the slowest rank's, the reported value the median. Memory is counted
per rank, not estimated: the storages of the module's own parameters and gradients plus the
distinct storages autograd saved for backward (meshspeed.memory.count_saved); the layout's value
is its fullest rank. Beside each: the run plan's prediction for the same settings (`meshspeed
train --dry-run` with [modules]: plan/modules.py), same parts (no optimizer state), and the
ratio measured / predicted. The machine is usually shared: read times with `uptime` beside them.

    python -m benchmarks.vlm [--nproc 4] [--batch 12] [--steps 3] [--json rows.json]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from benchmarks import harness
from benchmarks.vlm_layouts import Layout, Modules, batch, is_encoder, reference
from meshspeed.memory import count_saved
from meshspeed.models import get_preset, preset_names
from meshspeed.plan import config
from meshspeed.plan.run_plan import make_plan

DEFAULTS = dict(nproc=4, preset="vlm-tiny", batch=12, text=40, steps=3, warmup=1)


def layouts(n: int) -> list[tuple[str, Layout]]:
    every = tuple(range(n))
    out = [("same degrees", Layout(every, n, 1, every, n, 1))]
    if n % 2 == 0:
        out.append(("per-module", Layout(every, n, 1, every, n // 2, 2)))
    out.append((f"disagg 1+{n - 1}", Layout((0,), 1, 1, every[1:], n - 1, 1)))
    if n % 2 == 0 and n >= 4:
        h = n // 2
        out.append((f"disagg {h}+{h}", Layout(every[:h], h, 1, every[h:], h, 1)))
    return out


def predicted(args, lay: Layout, seq: int) -> dict:
    """The run plan's per-module prediction for this layout (plan/modules.py)."""
    settings = [
        ("model.preset", args.preset), ("train.objective", "sft"), ("train.seq_len", str(seq)),
        ("train.global_batch_size", str(args.batch)),
        ("train.micro_batch_size", str(args.batch // lay.dec_dp)),
        ("data.path", "synthetic.jsonl"),  # the benchmark's own batch: no caption-length check
        ("parallel.tp", str(lay.dec_tp)), ("parallel.dp", str(lay.dec_dp)),
        ("modules.encoder_dp", str(lay.enc_dp)), ("modules.encoder_tp", str(lay.enc_tp)),
    ]  # fmt: skip
    if lay.disaggregated:
        settings.append(("modules.encoder_ranks", ",".join(map(str, lay.enc_ranks))))
    with tempfile.TemporaryDirectory() as d:
        cfg = config.load(None, settings + [("run.dir", d)])
        m = make_plan(cfg, args.nproc, ranks=False, local_gpus=0, local_ranks=0, need_data=False).modules
    mem = m["memory"]
    parts = ("params", "grads", "activations")  # no optimizer here: the benchmark steps none
    fullest = max(sum(mem[k][p] for p in parts) for k in mem)
    return {"step_s": m["predicted"]["step_s"], "bytes": fullest, "seam_s": m["predicted"]["seam_s"]}


def _own_bytes(mods: Modules) -> int:
    """The module's own parameters and gradients on this rank (the copies hold the whole tiny
    model; a per-module build would hold only its part)."""
    own = []
    for model, enc in ((mods.enc, True), (mods.dec, False)):
        if model is not None:
            for n, p in model.named_parameters():
                if is_encoder(n) == enc:
                    own += [p, p.grad]
    return harness.storage_bytes(own)


def worker(args_dict: dict, out: str) -> None:
    from meshspeed import comm

    args = argparse.Namespace(**args_dict)
    torch.set_num_threads(1)  # ranks share the cores: one thread each, as every benchmark here
    ctx = comm.init()
    cfg = get_preset(args.preset)
    data = batch(cfg, args.batch, args.text)
    ref, ref_loss, _ = reference(cfg, data)
    runs = [(name, lay, Modules(ctx, ref, lay)) for name, lay in layouts(ctx.world_size)]
    times: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    mem, losses = {}, {}
    for step in range(args.warmup + args.steps):
        for name, _, mods in runs:  # interleaved: the machine's noise falls on every layout alike
            mods.zero_grad()
            both = torch.nn.ModuleList([m for m in (mods.enc, mods.dec) if m is not None])
            t0 = time.perf_counter()
            with count_saved(both) as saved:
                loss = mods.step(data)
            dt = harness.rank_max(ctx, time.perf_counter() - t0)
            if step >= args.warmup:
                times[name].append(dt)
            mem[name] = harness.rank_max(ctx, saved.bytes + _own_bytes(mods))
            if loss is not None:
                losses[name] = float(loss)
    agree = {name: abs(v - float(ref_loss)) <= 1e-5 * abs(float(ref_loss)) for name, v in losses.items()}
    ok = {name: harness.all_ranks_ok(ctx, agree.get(name, True)) for name in times}
    if ctx.rank == 0:
        harness.emit(out, {"times": times, "mem": mem, "ok": ok, "seq": data[0].shape[1]})
    ctx.close()


def main(argv=None):
    p = harness.parser(__doc__)
    for k, v in DEFAULTS.items():
        p.add_argument(f"--{k}", type=type(v), default=v)
    p.add_argument("--json", default="", help="write the rows to this file")
    args = p.parse_args(argv)
    harness.require_positive(p, args, "nproc", "batch", "text", "steps")
    if args.nproc < 2:
        p.error(f"--nproc {args.nproc}: the layouts need at least 2 ranks")
    if args.preset not in preset_names() or get_preset(args.preset).family != "vlm":
        p.error(f"--preset {args.preset}: not a vlm preset; try vlm-tiny")
    bad = sorted({lay.dec_dp for _, lay in layouts(args.nproc) if args.batch % lay.dec_dp})
    if bad:
        p.error(f"--batch {args.batch}: must be a multiple of each layout's decoder dp {bad}")
    res = harness.spawn_collect(worker, args.nproc, vars(args), name="vlm")
    rows = []
    print(f"vlm layouts, {args.preset}, {args.batch} images x {res['seq']} tokens, {args.nproc} gloo ranks")
    head = ("layout", "step ms", "pred ms", "meas/pred", "peak MiB", "pred MiB", "meas/pred")
    print(f"{head[0]:<16} " + " ".join(f"{h:>9}" for h in head[1:]))
    base = None
    for name, lay in layouts(args.nproc):
        ms = statistics.median(res["times"][name]) * 1e3
        pred = predicted(args, lay, res["seq"])
        mib, pmib = res["mem"][name] / 2**20, pred["bytes"] / 2**20
        base = base or ms
        flag = "" if res["ok"][name] else "  LOSS MISMATCH"
        print(f"{name:<16} {ms:9.1f} {pred['step_s'] * 1e3:9.1f} {ms / (pred['step_s'] * 1e3):9.2f} "
              f"{mib:9.2f} {pmib:9.2f} {mib / pmib:9.2f}{flag}")  # fmt: skip
        rows.append({"layout": name, "spec": str(lay), "step_ms": ms, "pred_ms": pred["step_s"] * 1e3,
                     "peak_bytes": res["mem"][name], "pred_bytes": pred["bytes"], "loss_ok": res["ok"][name],
                     "vs_same_degrees": ms / base})  # fmt: skip
    print("step time / same degrees: " + ", ".join(f"{r['layout']} {r['vs_same_degrees']:.2f}" for r in rows))
    if args.json:
        harness.write_json(args.json, "rows", args, rows=rows)
    return rows


if __name__ == "__main__":
    main()
