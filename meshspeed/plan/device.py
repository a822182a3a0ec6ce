"""run.device resolved in the run plan: the node's GPUs counted before any worker starts.

The workers follow the plan's choice (comm.init(device=plan.device)): the same decision on
every rank, made once, and visible in `--dry-run` and meta.json before a GPU is touched.
"""

from __future__ import annotations

import math
import os

from meshspeed.comm.context import DeviceChoice, choose_device, fit_degrees
from meshspeed.comm.context import local_gpus as count_gpus


def _gpu_hint(cfg, gpus: int, nodes: int, torchrun: bool) -> str:
    """What to type to give every rank a GPU of its own: `gpus` ranks on each of `nodes` nodes,
    the parallel degrees that no longer divide them set to 1 (and an explicit dp to automatic)."""
    p = cfg.parallel
    fit = fit_degrees(gpus, {"tp": p.tp, "pp": p.pp, "cp": p.cp})
    flags = [f"--parallel.{k} {v}" for k, v in fit.items() if v != getattr(p, k)]
    if p.dp and p.dp * math.prod(fit.values()) != gpus * nodes:
        flags.append("--parallel.dp 0")
    if torchrun:
        return f"launch with torchrun --nproc-per-node {gpus}" + (f" and {' '.join(flags)}" if flags else "")
    return " ".join(["add", f"--nproc {gpus}", *flags])


def plan_device(
    cfg, world_size: int, local_gpus: int | None = None, local_ranks: int | None = None
) -> DeviceChoice:
    """run.device for the ranks of this node: `world_size` of them when meshspeed spawns them,
    torchrun's LOCAL_WORLD_SIZE under torchrun. The GPU count and the local ranks can be given
    (tests, or a plan made for another machine); by default they are counted here."""
    from meshspeed.comm import launched

    torchrun = launched()
    if local_ranks is None:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if torchrun else world_size
    gpus = count_gpus() if local_gpus is None else local_gpus
    nodes = max(1, world_size // max(local_ranks, 1))
    return choose_device(cfg.run.device, local_ranks, gpus, fix=_gpu_hint(cfg, gpus, nodes, torchrun))
