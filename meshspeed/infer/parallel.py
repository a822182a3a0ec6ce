"""Generation under the training layouts: tensor parallel (the model built sharded, the same
per-layer communication as training) and data parallel (prompts split over replicas, the
generated ids gathered back in prompt order through meshspeed.comm).

and pipeline parallel (each rank its stage of the training split; prompts in micro-batches
flowing through the stages: infer/pipeline.py).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from meshspeed import comm
from meshspeed.comm.algorithms import bounds
from meshspeed.comm.recipe import Recipe
from meshspeed.infer.generate import Stats, generate
from meshspeed.infer.pipeline import generate_pipeline
from meshspeed.parallel.materialize import build_parallel_model
from meshspeed.parallel.pipeline.stage import build_stages


def build_inference_model(
    recipe: Recipe, mesh, *, seed: int = 0, dtype: torch.dtype | None = None
) -> tuple[nn.Module, object | None]:
    """This rank's model for inference and, under pp, its PipelineStages (else None), on the
    mesh's device (cuda:local_rank under nccl): tensor parallel over mesh["tp"], no sequence
    parallelism (decode steps have one token per sequence, which no sequence split can cut);
    under pp only this rank's stage of the training split."""
    device = mesh.ctx.device if mesh is not None else "cpu"
    if mesh is not None and mesh.dims.pp > 1:
        stages = build_stages(recipe, mesh, seed=seed, device=device, dtype=dtype, sequence_parallel=False)
        return stages.model.eval(), stages
    model = build_parallel_model(recipe, mesh, seed=seed, device=device, dtype=dtype, sequence_parallel=False)
    return model.eval(), None


def _gather_lists(local: list[list[int]], group: comm.Group) -> list[list[int]]:
    """Every member's token lists, concatenated in member order (uneven lengths); the tensors
    travel on the backend's device (NCCL moves no CPU tensor)."""
    dev = group.ctx.device
    lens = torch.tensor([len(x) for x in local], dtype=torch.long, device=dev)
    counts = comm.all_gather(torch.tensor([len(local)], dtype=torch.long, device=dev), group).tolist()
    all_lens = comm.all_gather(lens, group, sizes=counts).tolist()
    flat = torch.tensor([t for x in local for t in x], dtype=torch.long, device=dev)
    per_member = [sum(all_lens[sum(counts[:r]) : sum(counts[: r + 1])]) for r in range(group.size)]
    all_flat = comm.all_gather(flat, group, sizes=per_member).tolist()
    out, at = [], 0
    for n in all_lens:
        out.append(all_flat[at : at + n])
        at += n
    return out


def generate_parallel(
    model: nn.Module,
    prompts: list[list[int]],
    mesh,
    *,
    stats: Stats | None = None,
    stages=None,
    **kwargs,
) -> list[list[int]]:
    """Generated ids of every prompt, in prompt order, on every rank.

    Replica r of mesh["dp"] generates prompts bounds(n, dp)[r]..[r+1] (tensor_split pieces) with
    their global row indices, so sampled tokens equal a single process's. kwargs: generate()'s.
    `stages`: this rank's PipelineStages under pp (build_inference_model's second result).
    """
    run = partial(generate_pipeline, stages, mesh) if stages is not None else partial(generate, model)

    dp = mesh.group("dp") if mesh is not None and mesh.dims.dp > 1 else None
    if dp is None:
        return run(prompts, stats=stats, **kwargs)
    offs = bounds(len(prompts), dp.size)
    lo, hi = offs[dp.rank], offs[dp.rank + 1]
    local = (
        run(prompts[lo:hi], rows=list(range(lo, hi)), n_total=len(prompts), stats=stats, **kwargs)
        if hi > lo
        else []
    )
    return _gather_lists(local, dp)
