"""`meshspeed sample`: images from a diffusion transformer's run directory or checkpoint, by ODE
steps of its rectified flow, with classifier-free guidance, on one process or dp over the batch."""

from __future__ import annotations

import sys

EXAMPLES = """examples:
  meshspeed sample --run runs/dit-tiny --out samples/                 # every class, 8 images each
  meshspeed sample --run runs/dit-tiny --classes 3,7 --n 16 --guidance 2 --sampler heun --nproc 2
  meshspeed sample --checkpoint runs/dit-tiny/step-000400 --steps 64 --seed 1 --score
"""


def register(sub) -> None:
    import argparse

    p = sub.add_parser(
        "sample",
        help="sample images from a diffusion transformer (dit) run or checkpoint (dp)",
        description=(
            "Draw images from a 'dit' model: noise at t = 1 integrated to t = 0 along the model's "
            "velocity (Euler or Heun steps), classifier-free guidance as one batched forward. "
            "Image i's noise comes from (--seed, i) alone, so the same seeds give the same images "
            "whatever --nproc. Writes one PNG per image and grid.png (a row per class); prints "
            "images/s."
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = p.add_argument_group("model (one of)")
    src.add_argument("--run", metavar="DIR", help="a training run directory (its newest verified checkpoint)")
    src.add_argument("--checkpoint", metavar="PATH", help="a meshspeed checkpoint directory (step-NNNNNN)")
    what = p.add_argument_group("what to draw")
    what.add_argument(
        "--classes", metavar="IDS", help="comma-separated class ids, e.g. 0,1,2 (default: every class)"
    )
    what.add_argument(
        "--prompts", metavar="FILE", help="text prompts, one per line (text-conditioned models)"
    )
    what.add_argument("--n", type=int, default=8, help="images per class or prompt (default 8)")
    how = p.add_argument_group("how")
    how.add_argument("--steps", type=int, default=32, help="ODE steps from noise to image (default 32)")
    how.add_argument(
        "--sampler",
        default="euler",
        metavar="{euler,heun}",
        help="euler (default: one model call per step) or heun (two, second order)",
    )
    how.add_argument(
        "--guidance",
        type=float,
        default=1.0,
        help="classifier-free guidance scale s: v = v_uncond + s·(v_cond − v_uncond); 1 (default) = "
        "the conditional model alone, > 1 sharper classes",
    )
    how.add_argument("--seed", type=int, default=0, help="noise seed; the same seed, the same images")
    how.add_argument(
        "--no-ema",
        action="store_true",
        help="sample with the trained weights even when the checkpoint holds their EMA (flow.ema_decay; "
        "used by default)",
    )
    p.add_argument("--out", default="samples", metavar="DIR", help="folder for the PNGs (default samples/)")
    p.add_argument(
        "--score",
        action="store_true",
        help="digits models: print the share of samples a digit classifier recognises as their class "
        "and the FID on its features",
    )
    p.add_argument(
        "--nproc", type=int, default=1, help="local worker processes, each its share of the images"
    )
    p.add_argument(
        "--run.device",
        dest="device",
        default="auto",
        metavar="{auto,cpu,cuda}",
        help="auto (default): CUDA when every rank gets a GPU of its own, else the CPU; cpu; cuda",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    from meshspeed.comm import ConfigError, launch
    from meshspeed.infer.sample_run import resolve, worker

    opts = {k: v for k, v in vars(args).items() if k != "func"}
    try:
        job = resolve(opts)
    except (ConfigError, ValueError) as err:
        print(f"meshspeed sample: {err}", file=sys.stderr)
        return 2
    if job["device_notice"]:
        print(f"meshspeed sample: warning: {job['device_notice']}", file=sys.stderr, flush=True)
    if args.nproc == 1:
        return launch.run_worker(worker, (job,))
    preload = ("meshspeed.checkpoint.dcp", "meshspeed.infer.parallel", "meshspeed.infer.sample_run")
    return launch.spawn(worker, args.nproc, (job,), fork_ok=job["device"] == "cpu", preload=preload)
