"""The dit family's recipe (comm/recipe.py): its seeded init, its tensor-parallel plan and the
styles that plan needs beyond the built-in ones, its pipeline units and its loss.

Tensor + sequence parallelism (Megatron's layout over image tokens): q/k/v and fc1 colwise,
wo and fc2 rowwise, the residual stream [B, N/tp, dim] under SP. Three things the built-in
styles cannot say, added here from comm's differentiable pairs (parallel/ never imports us):

    modulation      the adaLN Linear silu(c) -> 6·dim (2·dim in the final layer). Its input c
                    is per sample, whole on every rank (never sequence-sharded: colwise would
                    all-gather it along dim 1). Weight split by output rows (a third of a
                    block's parameters), input through copy_to, output all-gathered whole;
                    backward, the output gradient is reduce-scattered under SP (each rank's
                    tokens give a partial sum) and sliced without SP (it is already whole).
    sequence_split  the patch embedding: run whole (it is cheap), then each rank keeps its
                    N/tp tokens (split_to; backward all-gathers, so its weights' gradients are
                    whole on every rank). Identity without SP.
    sequence_gather the final Linear: runs on this rank's tokens with copy_to'd parameters, then
                    the tokens are all-gathered for unpatchify. Identity without SP.
    colwise_context k/v of the text cross-attention: columns split, input (text tokens, whole on
                    every rank) through copy_to even under SP.

The timestep and class embedders stay replicated: their gradients arrive whole through the
modulations' copy_to. Full (non-causal) attention is recipe data: `causal=False`, and so is
where context parallelism cuts and rejoins the image tokens: `cp_tokens`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from meshspeed import comm
from meshspeed.comm.placement import Shard, chunk_bounds, shard_parameter
from meshspeed.comm.recipe import PipelineUnits, Recipe, Style

from .config import ModelConfig
from .dit import DiT
from .dit_config import n_tokens
from .init import canonical_name, param_seed

# --- init ------------------------------------------------------------------------------------


def init_tensor(name: str, shape: torch.Size | tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """The full initial value of parameter `name`, float32 on the CPU, from (seed, name) only.

    DiT's init: adaLN modulations and the final Linear zero (adaLN-Zero: every block starts as
    the identity and the model outputs 0); biases zero; the timestep MLP and the class table
    N(0, 0.02); every other Linear (the patch projection included) Xavier-uniform."""
    name = canonical_name(name)
    if name.endswith("modulation.weight") or name.startswith("final_layer.linear.") or name.endswith(".bias"):
        return torch.zeros(shape)
    gen = torch.Generator(device="cpu").manual_seed(param_seed(seed, name))
    if name.startswith(("t_embedder.", "y_embedder.")):
        return torch.empty(shape).normal_(0.0, 0.02, generator=gen)
    bound = math.sqrt(6.0 / (shape[0] + shape[1]))
    return torch.empty(shape).uniform_(-bound, bound, generator=gen)


@torch.no_grad()
def init_weights(model: nn.Module, seed: int = 0) -> None:
    for name, p in model.named_parameters():
        p.copy_(init_tensor(name, p.shape, seed))
    model.init_pos()


# --- tensor-parallel styles ------------------------------------------------------------------


def _sizes(n: int, group) -> list[int]:
    offs = chunk_bounds(n, group.size)  # parameter pieces follow torch.chunk
    return [offs[i + 1] - offs[i] for i in range(group.size)]


class ModulationParallelLinear(nn.Module):
    """adaLN Linear with output rows split over tp; returns the whole [B, out] on every rank."""

    def __init__(self, linear: nn.Linear, group, sequence_parallel: bool):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.full_out = linear.out_features
        self.weight = shard_parameter(linear.weight, "tp", Shard(0), group)
        self.bias = shard_parameter(linear.bias, "tp", Shard(0), group)

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        y = F.linear(comm.copy_to(c, self.group), self.weight, self.bias)  # [B, out/tp]
        sizes = _sizes(self.full_out, self.group)
        gather = comm.gather_sp if self.sequence_parallel else comm.gather_from
        return gather(y, self.group, -1, sizes)  # [B, out]


class SequenceSplit(nn.Module):
    """Runs `inner` whole, keeps this rank's tokens [B, N/tp, ...]."""

    def __init__(self, module: nn.Module, group):
        super().__init__()
        self.group = group
        object.__setattr__(self, "inner", module)  # not a child: FQNs (x_embedder.proj) unchanged
        for name, child in module.named_children():
            self.add_module(name, child)

    def init_pos(self) -> None:  # the family's finish() recomputes the positions through us
        self.inner.init_pos()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inner(x)
        if h.shape[1] % self.group.size:
            raise comm.ConfigError(
                f"sequence parallelism over {h.shape[1]} image tokens needs parallel.tp={self.group.size} "
                "to divide them; choose tp among the divisors or turn sequence_parallel off"
            )
        return comm.split_to(h, self.group, 1)


class SequenceGather(nn.Module):
    """A per-token Linear on this rank's tokens, then all tokens gathered [B, N, out]."""

    def __init__(self, linear: nn.Linear, group):
        super().__init__()
        self.group = group
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        y = F.linear(h, comm.copy_to(self.weight, self.group), comm.copy_to(self.bias, self.group))
        return comm.gather_from(y, self.group, 1)


class ContextColumnLinear(nn.Module):
    """Column-parallel Linear whose input (text tokens) is whole on every rank, SP or not."""

    def __init__(self, linear: nn.Linear, group):
        super().__init__()
        self.group = group
        self.weight = shard_parameter(linear.weight, "tp", Shard(0), group)
        self.bias = shard_parameter(linear.bias, "tp", Shard(0), group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(comm.copy_to(x, self.group), self.weight, self.bias)


DIT_TP_STYLES = {
    "modulation": Style(
        nn.Linear,
        "adaLN Linear of c: rows split, output gathered whole (grad reduce-scattered with SP)",
        lambda m, g, sp: ModulationParallelLinear(m, g, sp),
    ),
    "sequence_split": Style(
        nn.Module,
        "run whole, keep this rank's tokens under SP",
        lambda m, g, sp: SequenceSplit(m, g) if sp else m,
    ),
    "sequence_gather": Style(
        nn.Linear,
        "per-token Linear on the token shard, tokens gathered under SP",
        lambda m, g, sp: SequenceGather(m, g) if sp else m,
    ),
    "colwise_context": Style(
        nn.Linear,
        "columns split; input (text tokens) whole on every rank",
        lambda m, g, sp: ContextColumnLinear(m, g),
    ),
}


def tp_plan(config: ModelConfig) -> tuple[tuple[str, str], ...]:
    plan = [
        ("x_embedder", "sequence_split"),
        ("blocks.*.modulation", "modulation"),
        ("blocks.*.attention.wq", "colwise"),
        ("blocks.*.attention.wk", "colwise"),
        ("blocks.*.attention.wv", "colwise"),
        ("blocks.*.attention.wo", "rowwise"),
    ]
    if config.text_dim:
        plan += [
            ("blocks.*.cross.wq", "colwise"),
            ("blocks.*.cross.wk", "colwise_context"),
            ("blocks.*.cross.wv", "colwise_context"),
            ("blocks.*.cross.wo", "rowwise"),
        ]
    plan += [
        ("blocks.*.mlp.fc1", "colwise"),
        ("blocks.*.mlp.fc2", "rowwise"),
        ("final_layer.modulation", "modulation"),
        ("final_layer.linear", "sequence_gather"),
    ]
    return tuple(plan)


def flow_mse(pred: torch.Tensor, target: torch.Tensor, *_ignored) -> torch.Tensor:
    """Plain MSE of the velocity (the first target channels: learn_sigma's extra ones unused)."""
    return F.mse_loss(pred[:, : target.shape[1]].float(), target.float())


# --- pipeline units ----------------------------------------------------------------------------
# Every block needs c [B, dim], made once on stage 0 from t and y: it travels as row 0 of the one
# activation the runtime passes between stages, h' = [c, h] [B, 1 + N(/tp)(/cp), dim], and its
# gradient comes back in the same row (comm/recipe.PipelineUnits). Under sequence or context
# parallelism each rank packs its token shard with its whole c, so no split ever cuts the row.


def pack(h: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """h [B, N, dim], c [B, dim] -> [B, 1 + N, dim] (c first)."""
    return torch.cat([c[:, None].to(h.dtype), h], dim=1)


def unpack(hc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return hc[:, 1:], hc[:, 0]


def stage_embed(model: nn.Module, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return pack(*model.embed(x, t, y))


def stage_block(block: nn.Module, hc: torch.Tensor) -> torch.Tensor:
    h, c = unpack(hc)
    return pack(block(h, c), c)


def stage_head(model: nn.Module, hc: torch.Tensor) -> torch.Tensor:
    return model.head(*unpack(hc))


def layer_args(model: nn.Module, positions: torch.Tensor) -> tuple:
    """Nothing beyond the packed activation: positions are added at the patch embedding. Text
    tokens would be a per-micro-batch input of every stage, which the pipeline does not carry."""
    if model.config.text_dim:
        raise comm.ConfigError(
            "parallel.pp > 1 with a text-conditioned dit (model.text_dim > 0): the text tokens are "
            "not carried between pipeline stages yet; use pp = 1"
        )
    return ()


def recipe(config: ModelConfig) -> Recipe:
    return Recipe(
        name="dit",
        build=lambda: DiT(config),
        init=lambda fqn, shape, seed: init_tensor(fqn, shape, seed),
        loss=flow_mse,
        pipeline=PipelineUnits(
            embedding="x_embedder",
            layers="blocks",
            head=("final_layer",),
            layer_args=layer_args,
            also_first=("t_embedder", "y_embedder") if config.n_classes else ("t_embedder",),
            inputs=("x_t", "t", "y"),  # train/objectives/flow.py's rows
            seq_len=n_tokens(config),
            carry=1,
            embed=stage_embed,
            run_block=stage_block,
            run_head=stage_head,
        ),
        tp_plan=tp_plan(config),
        tp_styles=DIT_TP_STYLES,
        tp_divides={"n_heads": config.n_heads},
        n_layers=config.n_layers,
        hidden_size=config.dim,
        finish=lambda model: model.init_pos(),
        causal=False,
        # context parallelism splits the patch tokens after their positions are added and
        # gathers them before unpatchify; c and the text tokens stay whole on every cp rank
        cp_tokens=("x_embedder", "final_layer"),
    )
