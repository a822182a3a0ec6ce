"""Generation under the training layouts: tensor parallel (the model built sharded, the same
per-layer communication as training) and data parallel (prompts split over replicas, the
generated ids gathered back in prompt order through meshspeed.comm).

Pipeline parallelism is not wired yet (see the README's inference section).
"""

from __future__ import annotations

import torch
from torch import nn

from meshspeed import comm
from meshspeed.comm.algorithms import bounds
from meshspeed.comm.recipe import Recipe
from meshspeed.infer.generate import Stats, generate
from meshspeed.parallel.materialize import build_parallel_model


def build_inference_model(
    recipe: Recipe, mesh, *, seed: int = 0, dtype: torch.dtype | None = None
) -> nn.Module:
    """This rank's model for inference: tensor parallel over mesh["tp"], no sequence parallelism
    (decode steps have one token per sequence, which no sequence split can cut)."""
    if mesh is not None and mesh.dims.pp > 1:
        raise comm.ConfigError(
            f"parallel.pp={mesh.dims.pp}: pipeline-parallel generation is not implemented yet; "
            "use parallel.tp and parallel.dp"
        )
    return build_parallel_model(recipe, mesh, seed=seed, dtype=dtype, sequence_parallel=False).eval()


def _gather_lists(local: list[list[int]], group: comm.Group) -> list[list[int]]:
    """Every member's token lists, concatenated in member order (uneven lengths)."""
    lens = torch.tensor([len(x) for x in local], dtype=torch.long)
    counts = comm.all_gather(torch.tensor([len(local)], dtype=torch.long), group).tolist()
    all_lens = comm.all_gather(lens, group, sizes=counts).tolist()
    flat = torch.tensor([t for x in local for t in x], dtype=torch.long)
    per_member = [sum(all_lens[sum(counts[:r]) : sum(counts[: r + 1])]) for r in range(group.size)]
    all_flat = comm.all_gather(flat, group, sizes=per_member).tolist()
    out, at = [], 0
    for n in all_lens:
        out.append(all_flat[at : at + n])
        at += n
    return out


def generate_parallel(
    model: nn.Module, prompts: list[list[int]], mesh, *, stats: Stats | None = None, **kwargs
) -> list[list[int]]:
    """Generated ids of every prompt, in prompt order, on every rank.

    Replica r of mesh["dp"] generates prompts bounds(n, dp)[r]..[r+1] (tensor_split pieces) with
    their global row indices, so sampled tokens equal a single process's. kwargs: generate()'s.
    """
    dp = mesh.group("dp") if mesh is not None and mesh.dims.dp > 1 else None
    if dp is None:
        return generate(model, prompts, stats=stats, **kwargs)
    offs = bounds(len(prompts), dp.size)
    lo, hi = offs[dp.rank], offs[dp.rank + 1]
    local = (
        generate(model, prompts[lo:hi], rows=list(range(lo, hi)), n_total=len(prompts), stats=stats, **kwargs)
        if hi > lo
        else []
    )
    return _gather_lists(local, dp)
