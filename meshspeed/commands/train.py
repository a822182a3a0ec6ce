"""`meshspeed train`: one command to train, on a laptop (spawned CPU workers) or under torchrun."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

QUIET_WAIT_S = 20.0

EXAMPLES = """examples:
  meshspeed train                                   # tiny model, stdlib corpus, 4 CPU workers (dp 2 x tp 2)
  meshspeed train --config configs/tiny.toml --train.steps 100 --parallel.zero 1
  meshspeed train --nproc 4 --parallel.tp 1 --parallel.zero 2 --checkpoint.interval 50
  meshspeed train --checkpoint.resume latest        # continue the run in --run.dir exactly
  meshspeed train --config configs/llama3-8b.toml --nproc 64 --parallel.tp 8 --parallel.pp 4 --dry-run
                                                    # what a layout needs, before renting a cluster
  meshspeed train --run.overwrite true              # start over in a --run.dir an earlier run used
  torchrun --nproc-per-node 8 -m meshspeed train --config configs/llama3-8b.toml
  torchrun --nproc-per-node 8 --max-restarts 3 -m meshspeed train --checkpoint.resume auto

When things go wrong: a collective that waits longer than --run.timeout (or $MESHSPEED_TIMEOUT)
fails naming the group, the collective and the ranks that never arrived; any error on any rank
ends every rank, and the last line names the first rank that failed and why (an exception, or a
signal: "rank 2 was killed by SIGKILL (exit -9): out of memory?"). A step whose loss or gradient
norm is not finite is skipped; --train.max_bad_steps in a row stop the run. Checkpoints are
verified against their SHA-256 manifest on resume; 'latest' falls back to the newest one that
verifies. See the README, "When things go wrong".

Settings come from the dataclass defaults, then --config FILE.toml, then --section.key VALUE.
Every layout trains on the same tokens per step: the global batch is fixed and each
data-parallel rank takes its slice, so losses match across layouts.
"""


def register(sub) -> None:
    from meshspeed.plan import config

    p = sub.add_parser(
        "train",
        help="train a model",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--config", metavar="FILE.toml", help="a TOML preset (see configs/); default: the tiny preset"
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="resolve and check the whole run, print the plan (layout per rank, micro-batches, "
        "pipeline bubble, parameters and estimated memory per rank) and exit without starting "
        "a worker; --nproc sets the world size (any, e.g. 64, on a laptop)",
    )
    p.add_argument("--json", action="store_true", help="with --dry-run: print the plan as one JSON object")
    p.add_argument(
        "--layout-from",
        metavar="PLAN.json",
        help="take the layout (tp, pp, cp, ep, ZeRO, schedule, micro-batch, recompute, nproc) from "
        "`meshspeed plan --json`'s best entry; settings given here still win",
    )
    config.add_arguments(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from meshspeed.checkpoint.lock import RunDirLock
    from meshspeed.comm import ConfigError, launch, launched
    from meshspeed.plan import config
    from meshspeed.plan.run_plan import describe, make_plan, world_size
    from meshspeed.train.job import prepare_run_dir, worker

    if args.json and not args.dry_run:
        print("meshspeed train: --json prints the plan of --dry-run; add --dry-run", file=sys.stderr)
        return 2
    quiet = launched() and os.environ.get("RANK", "0") != "0"  # under torchrun: rank 0 speaks
    try:
        overrides = config.overrides_from_args(args)
        if args.layout_from:  # the planner's best layout, under what the command line pins
            from meshspeed.plan.planner import layout_overrides

            overrides = layout_overrides(args.layout_from) + overrides
        cfg = config.load(args.config, overrides)
        # The whole run, resolved and checked once, before any worker starts (under torchrun,
        # in each rank before it joins the job): a bad setting costs one line.
        # A dry run plans and reads no tokens: a missing data file is a note in the plan.
        plan = make_plan(cfg, world_size(cfg), ranks=args.dry_run, need_data=not args.dry_run)
        if args.dry_run:
            if not quiet:
                print(json.dumps(plan.to_dict()) if args.json else describe(plan))
            return 0
        if not launched():  # the lock first: nothing is written in run.dir before it is ours
            launch.check_workers(cfg.nproc)
            lock = RunDirLock(cfg.run.dir).acquire()
            prepare_run_dir(cfg, lead=True)
    except ConfigError as err:
        if quiet:
            # Every rank found the same error; rank 0 says it. Exiting at once would make
            # torchrun kill rank 0 before it prints, so wait: rank 0's exit ends this process
            # (torchrun stops the others). Only if rank 0 did not fail (a file present on its
            # node only) does this rank speak after the wait.
            time.sleep(QUIET_WAIT_S)
        print(f"meshspeed train: {err}", file=sys.stderr)
        return 2
    if not quiet:
        for w in plan.warnings:
            print(f"meshspeed train: warning: {w}", file=sys.stderr, flush=True)
    vlm = plan.model.get("family") == "vlm"
    if launched() and vlm and cfg.checkpoint.export_hf:  # the launcher converts it (below)
        if not quiet:
            print(
                "meshspeed train: checkpoint.export_hf=true with a vlm is written by meshspeed's own "
                "launcher; under torchrun convert the final checkpoint after training: meshspeed "
                f"convert --checkpoint {cfg.run.dir} --to-hf {cfg.run.dir}/hf",
                file=sys.stderr,
            )
        return 2
    if launched():  # torchrun: this process is one rank; a failure is one line and a non-zero exit
        return launch.run_worker(worker, (plan.to_dict(),))
    try:
        # A CPU job forks its workers from this process, which imported the trainer once.
        fork_ok, preload = plan.device == "cpu", ("meshspeed.train.trainer",)
        rc = launch.spawn(worker, cfg.nproc, (plan.to_dict(), True), fork_ok=fork_ok, preload=preload)
        if rc == 0 and plan.model.get("family") == "dit" and cfg.flow.sample_n > 0:
            # the end-of-run samples, here in the launcher once the workers are done (train/
            # never imports infer/): a grid beside loss.png, the digit figure for digits models
            from meshspeed.infer.sample_run import after_training

            after_training(cfg)
        if rc == 0 and vlm and cfg.checkpoint.export_hf:  # Qwen2-VL's layout, from the final checkpoint
            from meshspeed.interop.hf_vlm_io import export_vlm_checkpoint

            out = os.path.join(cfg.run.dir, "hf")
            export_vlm_checkpoint(cfg.run.dir, out, overwrite=True)  # a run's own export, replaced
            print(f"  hugging face {out}")
        if rc == 0 and vlm:  # held-out captions of the final weights
            from meshspeed.infer.captions import after_training as captions_after_training

            captions_after_training(cfg)
        return rc
    finally:
        lock.release()  # the kernel drops it too if this process dies
