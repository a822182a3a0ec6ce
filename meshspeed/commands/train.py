"""`meshspeed train`: one command to train, on a laptop (spawned CPU workers) or under torchrun."""

from __future__ import annotations

import argparse
import os
import sys

EXAMPLES = """examples:
  meshspeed train                                   # tiny model, stdlib corpus, 4 CPU workers (dp 2 x tp 2)
  meshspeed train --config configs/tiny.toml --train.steps 100 --parallel.zero 1
  meshspeed train --nproc 4 --parallel.tp 1 --parallel.zero 2 --checkpoint.interval 50
  meshspeed train --checkpoint.resume latest        # continue the run in --run.dir exactly
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
    from meshspeed.train import config

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
    config.add_arguments(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from meshspeed.comm import ConfigError, launch, launched
    from meshspeed.train import config
    from meshspeed.train.job import prepare_run_dir, worker

    try:
        cfg = config.load(args.config, config.overrides_from_args(args))
        if not launched():
            config.resolve_layout(cfg, cfg.nproc)  # fail here, once, not in every worker
            prepare_run_dir(cfg, lead=True)
    except ConfigError as err:
        if not launched() or os.environ.get("RANK", "0") == "0":  # under torchrun: every rank has it
            print(f"meshspeed train: {err}", file=sys.stderr)
        return 2
    if launched():  # torchrun: this process is one rank; a failure is one line and a non-zero exit
        return launch.run_worker(worker, (cfg.to_dict(),))
    return launch.spawn(worker, cfg.nproc, (cfg.to_dict(), True))
