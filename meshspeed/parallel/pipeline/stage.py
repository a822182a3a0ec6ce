"""Cut the single-device Transformer into pipeline stages for one rank.

There are pp * vpp virtual stages; stage s = chunk * pp + rank (actions.py). A rank builds ONE
`nn.Module`, its *stage model*: the single-device Transformer with every layer it does not
hold deleted (the ModuleDict keeps `layers.<i>` names, so FQNs, the seeded init, checkpoints
and tensor-parallel plans are unchanged), `tok_embeddings` kept only where stage 0 lives and
`norm` + `output` only where the last stage lives. Data parallelism, the optimizer and
checkpoints see that module as "the model". Each of the rank's vpp chunks is a `StageChunk`:
a view that runs a subset of the stage model's layers and looks its modules up at call time,
so later module swaps (tensor parallel, sparse layers) are seen by the chunks too.

Init is layout independent (CONTRACTS.md §3): parameters are drawn by (seed, FQN) on the
stage model, then `parallelize` slices the tensor-parallel shards.

Tied embeddings are refused for pp > 1: the embedding lives on stage 0 and the head on the
last stage, so keeping them equal would need their gradients summed across those ranks and
the tied weight counted once in the gradient norm and in checkpoints; an error now is better
than silently different numerics. Untie (ModelConfig.tie_embeddings=False) to pipeline.
"""

from __future__ import annotations

import torch
from torch import nn

from meshspeed.comm import ConfigError
from meshspeed.models.init import init_weights
from meshspeed.models.llama import Transformer
from meshspeed.models.moe import MoE
from meshspeed.parallel.pipeline.actions import ScheduleError
from meshspeed.parallel.pipeline.layout import KEY, StageLayout, even_layout, parse_layout


def stage_layouts(config, pp: int, vpp: int = 1, spec: str = "") -> list[StageLayout]:
    """All pp * vpp stages of `config` (explicit layout `spec`, else the even split), or one
    ConfigError line saying what to change."""
    n = config.n_layers
    if pp > 1 and getattr(config, "tie_embeddings", False):
        raise ConfigError(f"parallel.pp={pp} with tied embeddings: the embedding (stage 0) and output head "
                          "(last stage) live on different ranks; set ModelConfig.tie_embeddings=False to pipeline")
    try:
        if spec and spec.strip():
            return parse_layout(spec, pp, vpp, n_layers=n)
        if vpp > 1 and n >= pp * vpp and n % (pp * vpp):  # fewer layers: even_layout says so
            raise ScheduleError(
                f"parallel.vpp={vpp}: n_layers={n} does not divide into pp*vpp = {pp * vpp} equal model chunks; "
                f"use a vpp with pp*vpp dividing {n} or give {KEY} explicitly (e.g. '{_counts_hint(n, pp * vpp)}')")
        return even_layout(n, pp, vpp)
    except ScheduleError as e:
        raise ConfigError(str(e)) from None


def _counts_hint(n: int, stages: int) -> str:
    base, extra = divmod(n, stages)
    return ",".join(str(base + (1 if s >= stages - 1 - extra and s < stages - 1 else 0)) for s in range(stages))


class StageChunk:
    """One virtual stage of this rank: runs `layout.layers` of the stage model (plus the
    embedding / norm + head when it is the first / last stage). Not an nn.Module: its
    parameters belong to the stage model, which owns them once."""

    def __init__(self, model: Transformer, layout: StageLayout, num_stages: int):
        self.model, self.layout = model, layout
        self.is_first, self.is_last = layout.stage == 0, layout.stage == num_stages - 1

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens [batch, seq] (first stage) or hidden [batch, seq(/tp with SP), dim] ->
        hidden states, or logits [batch, seq, vocab(/tp)] on the last stage."""
        return self.body(self.embed(x), positions)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.tok_embeddings(x) if self.layout.embedding else x

    def body(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Everything after the embedding."""
        m = self.model
        # Positions given explicitly: under sequence parallelism a middle stage's input holds
        # seq/tp rows, so its length is not the sequence length.
        cos, sin = m.rope_cos[positions], m.rope_sin[positions]
        for i in self.layout.layers:
            h = m.layers[str(i)](h, cos, sin)
        if self.layout.head:
            h = m.output(m.norm(h))
        return h

    def modules(self) -> list[nn.Module]:
        m = self.model
        mods = [m.tok_embeddings] if self.layout.embedding else []
        mods += [m.layers[str(i)] for i in self.layout.layers]
        return mods + ([m.norm, m.output] if self.layout.head else [])

    def parameters(self) -> list[nn.Parameter]:
        seen, out = set(), []
        for mod in self.modules():
            for p in mod.parameters():
                if id(p) not in seen and p.requires_grad:
                    seen.add(id(p))
                    out.append(p)
        return out

    def aux_loss(self) -> torch.Tensor | None:
        """Sum of this chunk's MoE auxiliary losses from its last forward (None for dense)."""
        losses = []
        for i in self.layout.layers:
            ff = self.model.layers[str(i)].feed_forward
            if isinstance(ff, MoE) and (aux := ff.aux_loss()) is not None:
                losses.append(aux)
        return torch.stack(losses).sum() if losses else None

    def __repr__(self) -> str:
        s = self.layout
        return (f"StageChunk(stage {s.stage}: rank {s.rank} chunk {s.chunk}, layers {list(s.layers)}"
                f"{', embedding' if s.embedding else ''}{', norm+head+loss' if s.head else ''})")


class PipelineStages:
    """This rank's share of the pipeline: `model` (the stage model: what DP, the optimizer and
    checkpoints see) and `chunks` (its vpp StageChunks, chunk order)."""

    def __init__(self, model: Transformer, layouts: list[StageLayout], rank: int, pp: int, vpp: int):
        self.model, self.layouts, self.rank, self.pp, self.vpp = model, layouts, rank, pp, vpp
        self.chunks = [StageChunk(model, layouts[c * pp + rank], pp * vpp) for c in range(vpp)]

    @property
    def num_stages(self) -> int:
        return self.pp * self.vpp


def stage_model(config, layouts: list[StageLayout], rank: int, *, seed: int = 0,
                device: torch.device | str = "cpu") -> Transformer:
    """The single-device Transformer reduced to what pipeline rank `rank` holds, initialised
    exactly as the full model would be (init by FQN)."""
    mine = [s for s in layouts if s.rank == rank]
    keep = {str(i) for s in mine for i in s.layers}
    with torch.device("meta"):  # no memory for the layers about to be dropped
        model = Transformer(config)
    for key in [k for k in model.layers if k not in keep]:
        del model.layers[key]
    if not any(s.embedding for s in mine):
        model.tok_embeddings = None
    if not any(s.head for s in mine):
        model.norm = None
        model.output = None
    model.to_empty(device=device)
    init_weights(model, seed)
    return model


def build_stages(config, mesh, *, vpp: int = 1, layout: str = "", seed: int = 0,
                 device: torch.device | str = "cpu", sequence_parallel: bool = False,
                 plan=None) -> PipelineStages:
    """This rank's pipeline stages (pp and rank from `mesh`), tensor parallel over mesh["tp"]."""
    from meshspeed.parallel.tensor import parallelize

    pp, rank = mesh.dims.pp, mesh.coords["pp"]
    layouts = stage_layouts(config, pp, vpp, layout)
    model = stage_model(config, layouts, rank, seed=seed, device=device)
    parallelize(model, mesh, sequence_parallel=sequence_parallel, plan=plan)
    return PipelineStages(model, layouts, rank, pp, vpp)
