"""`meshspeed train`: one command to train, on a laptop (spawned CPU workers) or under torchrun."""

from __future__ import annotations

import argparse
import sys

EXAMPLES = """examples:
  meshspeed train                                   # tiny model, stdlib corpus, 4 CPU workers (dp 2 x tp 2)
  meshspeed train --config configs/tiny.toml --train.steps 100 --parallel.zero 1
  meshspeed train --nproc 4 --parallel.tp 1 --parallel.zero 2 --checkpoint.interval 50
  meshspeed train --checkpoint.resume latest        # continue the run in --run.dir exactly
  torchrun --nproc-per-node 8 -m meshspeed train --config configs/llama3-8b.toml

Settings come from the dataclass defaults, then --config FILE.toml, then --section.key VALUE.
Every layout trains on the same tokens per step: the global batch is fixed and each
data-parallel rank takes its slice, so losses match across layouts.
"""


def register(sub) -> None:
    from meshspeed.train import config

    p = sub.add_parser("train", help="train a model", description=__doc__, epilog=EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", metavar="FILE.toml", help="a TOML preset (see configs/); default: the tiny preset")
    config.add_arguments(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from meshspeed.comm import ConfigError, launch, launched
    from meshspeed.train import config

    try:
        cfg = config.load(args.config, config.overrides_from_args(args))
        if not launched():
            config.resolve_layout(cfg, cfg.nproc)  # fail here, once, not in every worker
    except ConfigError as err:
        print(f"meshspeed train: {err}", file=sys.stderr)
        return 2
    from meshspeed.train.trainer import worker

    if launched():
        worker(cfg.to_dict())
        return 0
    return launch.spawn(worker, cfg.nproc, (cfg.to_dict(),))
