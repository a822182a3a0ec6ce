"""Cut a single-device model into pipeline stages for one rank, as its recipe's pipeline units
say (comm/recipe.py: an embedding, a ModuleDict of blocks keyed by str(index), head modules).

There are pp * vpp virtual stages, placed on ranks as the schedule says (actions.py: "loop",
stage s = chunk * pp + rank, or DualPipeV's "v"); each StageLayout records its (rank, chunk),
and a rank takes the stages that name it. A rank builds ONE
`nn.Module`, its *stage model*: the single-device model with every block it does not hold
deleted (the ModuleDict keeps `layers.<i>` names, so FQNs, the seeded init, checkpoints and
tensor-parallel plans are unchanged), the embedding kept only where stage 0 lives and the head
only where the last stage lives. It is cut on the meta device and born sharded
(materialize.py): a rank never allocates another stage's layers. Data parallelism, the optimizer and
checkpoints see that module as "the model". Each of the rank's vpp chunks is a `StageChunk`:
a view that runs a subset of the stage model's layers and looks its modules up at call time,
so later module swaps (tensor parallel, sparse layers) are seen by the chunks too.

Init is layout independent (CONTRACTS.md §3): each piece is drawn by (seed, FQN) from the
recipe's init and sliced.

Tied parameters are refused for pp > 1: the embedding lives on stage 0 and the head on the
last stage, so keeping them equal would need their gradients summed across those ranks and
the tied weight counted once in the gradient norm and in checkpoints; an error now is better
than silently different numerics. Untie (ModelConfig.tie_embeddings=False) to pipeline.
"""

from __future__ import annotations

import torch
from torch import nn

from meshspeed.comm import ConfigError
from meshspeed.comm.recipe import Recipe, get_optional, set_submodule
from meshspeed.parallel.materialize import build_parallel_model
from meshspeed.parallel.pipeline.actions import ScheduleError
from meshspeed.parallel.pipeline.layout import KEY, StageLayout, even_layout, parse_layout


def stage_layouts(
    recipe: Recipe, pp: int, vpp: int = 1, spec: str = "", placement: str = "loop"
) -> list[StageLayout]:
    """All pp * vpp stages of the recipe's model (explicit layout `spec`, else the even split),
    held as `placement` says, or one ConfigError line saying what to change."""
    n = recipe.n_layers
    if pp > 1 and recipe.tied:
        alias, owner = recipe.tied[0]
        raise ConfigError(
            f"parallel.pp={pp} with tied embeddings ({alias} = {owner}): the embedding (stage 0) and "
            "output head (last stage) live on different ranks; "
            "untie them (ModelConfig.tie_embeddings=False) to pipeline"
        )
    try:
        if spec and spec.strip():
            return parse_layout(spec, pp, vpp, n_layers=n, placement=placement)
        if vpp > 1 and n >= pp * vpp and n % (pp * vpp):  # fewer layers: even_layout says so
            raise ScheduleError(
                f"parallel.vpp={vpp}: n_layers={n} does not divide into pp*vpp = {pp * vpp} equal model "
                f"chunks; use a vpp with pp*vpp dividing {n} or give {KEY} explicitly "
                f"(e.g. '{_counts_hint(n, pp * vpp)}')"
            )
        return even_layout(n, pp, vpp, placement)
    except ScheduleError as e:
        raise ConfigError(str(e)) from None


def _counts_hint(n: int, stages: int) -> str:
    base, extra = divmod(n, stages)
    return ",".join(
        str(base + (1 if s >= stages - 1 - extra and s < stages - 1 else 0)) for s in range(stages)
    )


class StageChunk:
    """One virtual stage of this rank: runs `layout.layers` of the stage model (plus the
    embedding / head when it is the first / last stage). Not an nn.Module: its parameters
    belong to the stage model, which owns them once. Modules are looked up at call time, so
    later swaps (sparse layers) are seen."""

    def __init__(self, model: nn.Module, recipe: Recipe, layout: StageLayout, num_stages: int):
        self.model, self.recipe, self.layout = model, recipe, layout
        self.units = recipe.pipeline
        self.is_first, self.is_last = layout.stage == 0, layout.stage == num_stages - 1

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens [batch, seq] (first stage) or hidden [batch, seq(/tp with SP), dim] ->
        hidden states, or logits [batch, seq, vocab(/tp)] on the last stage."""
        return self.body(self.embed(x), positions)

    def embed(self, *inputs: torch.Tensor) -> torch.Tensor:
        """Stage 0: the recipe's inputs (tokens; a dit's x_t, t, y) -> what the next stage gets."""
        if not self.layout.embedding:
            return inputs[0]
        if self.units.embed is not None:  # a family packing more than the hidden states
            return self.units.embed(self.model, *inputs)
        return self.model.get_submodule(self.units.embedding)(inputs[0])

    def embedding_params(self) -> list[nn.Parameter]:
        """Every stage-0-only module's parameters: W of a split schedule owns their gradients."""
        return [p for name in self.units.first_modules() for p in self.model.get_submodule(name).parameters()]

    def body(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Everything after the embedding."""
        # Positions given explicitly: under sequence parallelism a middle stage's input holds
        # seq/tp rows, so its length is not the sequence length.
        args = self.units.layer_args(self.model, positions)
        blocks, run = self.model.get_submodule(self.units.layers), self.units.run_block
        for i in self.layout.layers:
            h = blocks[str(i)](h, *args) if run is None else run(blocks[str(i)], h, *args)
        if self.layout.head:
            if self.units.run_head is not None:
                return self.units.run_head(self.model, h)
            for name in self.units.head:
                h = self.model.get_submodule(name)(h)
        return h

    def modules(self) -> list[nn.Module]:
        m, u = self.model, self.units
        mods = [m.get_submodule(name) for name in u.first_modules()] if self.layout.embedding else []
        mods += [m.get_submodule(u.layers)[str(i)] for i in self.layout.layers]
        return mods + ([m.get_submodule(n) for n in u.head] if self.layout.head else [])

    def parameters(self) -> list[nn.Parameter]:
        seen, out = set(), []
        for mod in self.modules():
            for p in mod.parameters():
                if id(p) not in seen and p.requires_grad:
                    seen.add(id(p))
                    out.append(p)
        return out

    def aux_loss(self) -> torch.Tensor | None:
        """This chunk's auxiliary loss from its last forward (the recipe's: MoE), or None."""
        blocks = self.model.get_submodule(self.units.layers)
        return self.recipe.aux_loss([blocks[str(i)] for i in self.layout.layers])

    def __repr__(self) -> str:
        s = self.layout
        return (
            f"StageChunk(stage {s.stage}: rank {s.rank} chunk {s.chunk}, layers {list(s.layers)}"
            f"{', embedding' if s.embedding else ''}{', head+loss' if s.head else ''})"
        )


class PipelineStages:
    """This rank's share of the pipeline: `model` (the stage model: what DP, the optimizer and
    checkpoints see) and `chunks` (its vpp StageChunks, chunk order)."""

    def __init__(
        self, model: nn.Module, recipe: Recipe, layouts: list[StageLayout], rank: int, pp: int, vpp: int
    ):
        self.model, self.recipe, self.layouts = model, recipe, layouts
        self.rank, self.pp, self.vpp = rank, pp, vpp
        mine = {s.chunk: s for s in layouts if s.rank == rank}
        self.chunks = [StageChunk(model, recipe, mine[c], pp * vpp) for c in range(vpp)]
        # how the stages sit on ranks, read back from the layouts (the runtime checks its
        # schedule places them the same way)
        self.placement = "v" if vpp > 1 and pp > 1 and layouts[pp].rank == pp - 1 else "loop"

    @property
    def num_stages(self) -> int:
        return self.pp * self.vpp

    @property
    def has_head(self) -> bool:
        """Whether this rank holds the last stage (so computes the loss)."""
        return get_optional(self.model, self.recipe.pipeline.head[-1]) is not None


def keep_stage(recipe: Recipe, layouts: list[StageLayout], rank: int):
    """A function that cuts a (meta) model down to what pipeline rank `rank` holds."""
    mine = [s for s in layouts if s.rank == rank]
    keep = {str(i) for s in mine for i in s.layers}
    units = recipe.pipeline

    def cut(model: nn.Module) -> None:
        blocks = model.get_submodule(units.layers)
        for key in [k for k in blocks if k not in keep]:
            del blocks[key]
        if not any(s.embedding for s in mine):
            for name in units.first_modules():
                set_submodule(model, name, None)
        if not any(s.head for s in mine):
            for name in units.head:
                set_submodule(model, name, None)

    return cut


def stage_model(
    recipe: Recipe,
    layouts: list[StageLayout],
    rank: int,
    mesh,
    *,
    seed: int = 0,
    device: torch.device | str = "cpu",
    sequence_parallel: bool = False,
    plan=None,
    dtype: torch.dtype | None = None,
    transform=None,
) -> nn.Module:
    """The single-device model reduced to what pipeline rank `rank` holds, tensor parallel over
    mesh["tp"] (then `transform`, on meta: build_parallel_model), each piece initialised exactly
    as the full model's."""
    return build_parallel_model(
        recipe,
        mesh,
        seed=seed,
        device=device,
        dtype=dtype,
        sequence_parallel=sequence_parallel,
        plan=plan,
        keep=keep_stage(recipe, layouts, rank),
        transform=transform,
    )


def build_stages(
    recipe: Recipe,
    mesh,
    *,
    vpp: int = 1,
    layout: str = "",
    seed: int = 0,
    device: torch.device | str = "cpu",
    sequence_parallel: bool = False,
    plan=None,
    dtype: torch.dtype | None = None,
    layouts: list[StageLayout] | None = None,
    transform=None,
    placement: str = "loop",
) -> PipelineStages:
    """This rank's pipeline stages (pp and rank from `mesh`), tensor parallel over mesh["tp"].
    `layouts`: the stages already resolved (the trainer's run plan), else from `layout` and
    `placement` (the schedule's: get_schedule(name).placement)."""
    pp, rank = mesh.dims.pp, mesh.coords["pp"]
    layouts = layouts if layouts is not None else stage_layouts(recipe, pp, vpp, layout, placement)
    model = stage_model(
        recipe,
        layouts,
        rank,
        mesh,
        seed=seed,
        device=device,
        sequence_parallel=sequence_parallel,
        plan=plan,
        dtype=dtype,
        transform=transform,
    )
    return PipelineStages(model, recipe, layouts, rank, pp, vpp)
