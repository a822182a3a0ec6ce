"""The planner's per-module candidates for a family with an encoder (a vlm): colocated and
disaggregated `[modules]` layouts beside the one-mesh ones planner.layout_space makes. Each is
evaluated like any layout (plan/modules.py's evaluate), and only what `meshspeed train` accepts
survives (plan/modules.check_trainable)."""

from __future__ import annotations

import itertools

from meshspeed.comm.mesh import divisors
from meshspeed.plan.machine import Machine


def _encoder_splits(n: int, model) -> list[tuple[int, int]]:
    """(encoder dp, encoder tp) over n ranks, tp dividing the ViT's heads."""
    return [(n // t, t) for t in divisors(n) if model.vision_heads % t == 0]


def module_groups(
    cfg, model, world: int, machine: Machine, fixed: dict, seen: list, ladder
) -> list[list[dict]]:
    """The per-module candidates of a vlm, one group per structure, each through `ladder` (the
    planner's memory ladder), at cp = 1. Colocated: the encoder over every rank at its own
    dp x tp beside the decoder at tp x dp, except encoder dp = decoder dp at tp 1 (the one-mesh
    layout again). Disaggregated: the encoder on the last k ranks (k = 1, 2, world/4, world/2;
    never rank 0, which logs the loss), the decoder's parallel.* over the first world - k, as tp x
    dp or with pp (the encoder's ranks feed its first stage)."""
    t, gpn = cfg.train, max(machine.gpus_per_node, 1)
    structures = []  # (encoder ranks, encoder dp, encoder tp, decoder ranks)
    for enc_dp, enc_tp in _encoder_splits(world, model):
        structures.append(("", enc_dp, enc_tp, world))
    for k in sorted({1, 2, world // 4, world // 2}):
        if 1 <= k < world:
            ranks = str(world - 1) if k == 1 else f"{world - k}-{world - 1}"
            structures += [(ranks, dp, tp, world - k) for dp, tp in _encoder_splits(k, model)]
    groups = []
    for (ranks, enc_dp, enc_tp, dec_world), mbs in itertools.product(structures, (1, 2, 4)):
        # the decoder: tp x dp, and beside an encoder on its own ranks also pp (MindSpeed's
        # dist-train shape), 1F1B over whole layers
        pps = [p for p in divisors(dec_world) if p == 1 or (ranks and model.n_layers % p == 0)]
        shapes = [(tp, pp) for pp in pps for tp in divisors(dec_world // pp)]
        for tp, pp in [(tp, pp) for tp, pp in shapes if tp <= gpn and model.n_heads % tp == 0]:
            dp = dec_world // (tp * pp)
            if not ranks and tp == 1 and enc_tp == 1:
                continue  # the one-mesh data-parallel layout, planned above
            if t.global_batch_size % dp or (t.global_batch_size // dp) % mbs or enc_dp > mbs * dp:
                continue
            mods = {"modules.encoder_ranks": ranks} if ranks or cfg.modules.encoder_ranks else {}
            mods |= {"modules.encoder_dp": enc_dp, "modules.encoder_tp": enc_tp}
            group = []
            for rc, zero in ladder:
                s = {
                    "parallel.tp": tp, "parallel.pp": pp, "parallel.cp": 1, "parallel.ep": 1,
                    "parallel.zero": zero, "parallel.sequence_parallel": tp > 1,
                    "parallel.pp_schedule": "1f1b", "parallel.vpp": 1,
                    "train.micro_batch_size": mbs, "memory.recompute": rc, **mods,
                }  # fmt: skip
                s.update(fixed)
                if s not in group and not any(s in g for g in seen + groups):
                    group.append(s)
            if group:
                groups.append(group)
    return groups
