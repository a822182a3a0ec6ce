"""`meshspeed.parallelize`: your own model and your own loop, split by meshspeed.

    ctx = meshspeed.comm.init()
    mesh = meshspeed.comm.ParallelDims(dp=2, tp=2).build(ctx)
    model, opt = meshspeed.parallelize(model, mesh, zero=1, lr=3e-4)   # model: split in place
    for x in batches:                                                  # this dp rank's samples
        model(input_ids=x, labels=x).loss.backward()
        opt.step(); opt.zero_grad()
    state = meshspeed.gather_for_save(model)                           # full tensors, every rank
    if ctx.rank == 0: model.save_pretrained(out, state_dict=state)

What is split and how:
- a `transformers` LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM: meshspeed's own
  family plan, renamed onto the Hugging Face modules (interop/hf_plan.py); tp with optional
  sequence parallelism;
- a `transformers` Qwen2VLForConditionalGeneration: that plan on its language decoder, its vision
  encoder data parallel, whole on every tp rank (interop/parallelize_vlm.py);
- any nn.Module with `plan=` (module-name patterns -> styles, tensor_plan.py): tp by that plan;
- any nn.Module at tp=1: data parallelism alone, no plan needed;
- a diffusers DiTTransformer2DModel: dp / ZeRO (its blocks' embedders in ZeRO-3's root unit)
  and cp over its image tokens (interop/diffusers_parallel.py);
- a `transformers` MixtralForCausalLM at tp=1: its experts split over ep (dims ep > 1, which
  borrows dp ranks as in `meshspeed train`), each layer's tokens exchanged all-to-all
  (interop/hf_experts.py); the router and attention data parallel.
Then, for all of them, the trainer's data parallelism (buckets reduced during backward, ZeRO-1/2/3,
parallel/data.py, zero3.py) and its AdamW (parallel/optim.py), which is torch.optim.AdamW's
update; every parameter is decayed as torch's is unless `no_decay(name, param)` says otherwise.
Memory options: recompute="full" (memory/recompute.py, each block rerun in backward) and, for
the Hugging Face causal LMs, chunked_loss (interop/hf_loss.py, the labels= loss without logits).

A model that is not recognised, with tp > 1 and no plan, is refused with one line naming a
module that nothing placed.

A model built under `torch.device("meta")` is born sharded with `load_from=DIR` (a
`save_pretrained` directory): it is split first, then each rank reads only its own slices
(interop/load_sharded.py). A meta model without load_from is refused in one line.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from meshspeed import comm
from meshspeed.comm import placement
from meshspeed.comm.errors import ConfigError
from meshspeed.comm.recipe import PipelineUnits, Recipe
from meshspeed.interop import diffusers_parallel, hf_experts, hf_loss, load_sharded, parallelize_vlm
from meshspeed.interop.hf_plan import (
    EXTRA_STYLES,
    HF_CLASSES,
    hf_model_config,
    hf_recipe,
    sequence_hooks,
    tied_pairs,
)
from meshspeed.kernels.loss import cross_entropy_loss
from meshspeed.memory.recompute import apply_recompute
from meshspeed.parallel import optim, tensor
from meshspeed.parallel.data import DataParallel
from meshspeed.parallel.optim import ZeroAdamW, build_data_parallel

__all__ = ["Parallelized", "clip_grad_norm_", "gather_for_save", "parallelize"]

ATTR = "meshspeed"  # the attribute of the parallelised model holding its Parallelized


@dataclass
class Parallelized:
    """What parallelize did to a model (`model.meshspeed`): its mesh, data parallelism, the
    tensor-parallel plan applied (None at tp=1) and the hooks it added."""

    mesh: comm.Mesh
    dp: DataParallel
    plan: tensor.TensorPlan | None
    sequence_parallel: bool
    hooks: list = field(default_factory=list)

    @property
    def dp_rank(self) -> int:
        return self.mesh.coords["dp"]

    @property
    def dp_size(self) -> int:
        return self.mesh["dp"].size


def _mesh(dims, ctx) -> comm.Mesh:
    if isinstance(dims, comm.Mesh):
        mesh = dims
    elif isinstance(dims, comm.ParallelDims):
        mesh = dims.build(ctx if ctx is not None else comm.init())
    else:
        raise ConfigError(
            f"parallelize: dims={dims!r} must be a meshspeed.comm.ParallelDims (or the Mesh it builds), "
            "e.g. ParallelDims(dp=2, tp=2)"
        )
    if mesh.dims.pp != 1:
        raise ConfigError(
            f"parallelize: pp={mesh.dims.pp} is not supported on your own model (dp, tp, ep, ZeRO and, "
            "for a diffusers DiT, cp are); use `meshspeed train` for pipeline parallelism"
        )
    return mesh


RECOMPUTE = ("none", "full")


def _check_memory(model: nn.Module, recompute: str, chunked_loss: bool) -> None:
    """One line for a memory option this model cannot take (before anything changes)."""
    if recompute not in RECOMPUTE:
        raise ConfigError(
            f"parallelize: recompute={recompute!r} is not known; valid: {', '.join(map(repr, RECOMPUTE))} "
            "('full': each block runs again in backward, keeping only its input)"
        )
    if not chunked_loss:
        return
    name = type(model).__name__
    if hf_model_config(model) is None:
        raise ConfigError(
            f"parallelize: chunked_loss=True needs a Hugging Face causal LM ({', '.join(HF_CLASSES)}, "
            f"MixtralForCausalLM) whose forward takes labels=; {name} computes its own loss, so chunk "
            "it there (meshspeed.kernels.linear_ce.linear_cross_entropy) or pass chunked_loss=False"
        )
    if getattr(model.config, "output_router_logits", False):
        raise ConfigError(
            f"parallelize: chunked_loss=True on {name} with output_router_logits=True: the balancing "
            "loss is added by its own forward; set output_router_logits=False or chunked_loss=False"
        )


def _check_experts(model: nn.Module, mesh: comm.Mesh, load_from) -> bool:
    """Whether `model` has Hugging Face stacked experts to split over ep; refuses in one line the
    layouts this path does not build (before anything changes)."""
    ep, tp, name = mesh.dims.ep, mesh["tp"].size, type(model).__name__
    has = bool(hf_experts.expert_modules(model))
    if ep > 1 and not has:
        raise ConfigError(
            f"parallelize: ep={ep} but {name} has no experts meshspeed can split "
            f"({', '.join(hf_experts.EXPERT_CLASSES)}: MixtralForCausalLM); use ep=1"
        )
    if has and tp > 1:
        raise ConfigError(
            f"parallelize: tp={tp} on {name}: its experts are split by expert parallelism here, not "
            "tp; use ParallelDims(dp=N, ep=E) with tp=1 (E divides N and the expert count)"
        )
    if has and load_from is not None:
        raise ConfigError(
            f"parallelize: load_from={load_from!r} on {name}: born-sharded loading does not read "
            "per-expert checkpoint files; load with from_pretrained, then parallelize"
        )
    return has and ep > 1


def _diffusers_root(model: nn.Module) -> None:
    """diffusers' DiTTransformer2DModel runs block 0's conditioning embedder again after the last
    block (for proj_out's adaLN), outside block 0's forward: ZeRO-3 keeps every block's embedder
    in the root unit (gathered through forward and backward), not in its block (zero3.py)."""
    if type(model).__name__ == "DiTTransformer2DModel":
        object.__setattr__(model, "ms_zero3_root", ("transformer_blocks.*.norm1.emb.*",))


def _unplaced(model: nn.Module, tp: int) -> ConfigError:
    """One line: the first module a tp plan would have to place, and how to pass one."""
    name, mod = next(
        ((n, m) for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))),
        ("", model),
    )
    where = f"{name!r} ({type(mod).__name__})" if name else f"the model ({type(mod).__name__})"
    return ConfigError(
        f"parallelize: tp={tp} but {type(model).__name__} is not a model meshspeed recognises "
        f"({', '.join(HF_CLASSES)}), so nothing places {where}; pass plan={{'{name or '<module>'}': "
        "'colwise', ...}} (module-name patterns -> colwise / rowwise / replicate ..., docs/parallelize.md), "
        "or tp=1 for data parallelism alone"
    )


def _custom_recipe(model: nn.Module, blocks: str | None) -> Recipe:
    return Recipe(
        name=type(model).__name__,
        build=lambda: model,
        init=lambda fqn, shape, seed: None,
        loss=cross_entropy_loss,
        pipeline=PipelineUnits("", blocks or "", (), lambda m, p: ()),
        tp_styles=EXTRA_STYLES,
        tied=tied_pairs(model),
    )


def _blocks(model: nn.Module, given: str | None) -> str:
    """The blocks ZeRO-3 gathers and recompute reruns: given, or the first ModuleList /
    ModuleDict holding parameters (`model.layers` of a Hugging Face causal LM)."""
    if given:
        return given
    for name, m in model.named_modules():
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and len(m) and any(True for _ in m.parameters()):
            return name
    raise ConfigError(
        f"parallelize: zero=3 and recompute work one block at a time, and {type(model).__name__} "
        "has no ModuleList / ModuleDict of blocks; pass blocks='<name of the container>' (or zero<3, "
        "recompute='none')"
    )


def parallelize(
    model: nn.Module,
    dims,
    *,
    ctx=None,
    plan=None,
    sequence_parallel: bool = False,
    zero: int = 1,
    blocks: str | None = None,
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    no_decay=None,
    bucket_mb: float = 25.0,
    load_from: str | None = None,
    recompute: str = "none",
    chunked_loss: bool = False,
    cp_impl: str = "ring",
    cp_ulysses: int = 1,
) -> tuple[nn.Module, ZeroAdamW]:
    """Split `model` in place over `dims` and return it with its AdamW.

    dims: a comm.ParallelDims (built with `ctx`, else comm.init()) or the Mesh it built; dp and
    tp, and ep for a Mixtral (pp, cp stay 1). The model must hold its full initial weights, the
    same on every rank (seed it alike), on this rank's device, in one dtype; or be built on the
    meta device and given `load_from`.
    plan: {module-name pattern: style} or [(pattern, style)], first match wins, for tp > 1 on a
    model meshspeed does not recognise (styles: colwise, rowwise, colwise_gathered, colwise_vocab,
    vocab_embedding, sequence_norm, replicate; docs/parallelize.md). A recognised Hugging Face
    causal LM needs none. sequence_parallel: the residual stream split over tp along the sequence
    (recognised models, or a plan written for it). zero: 0, 1, 2 or 3 (3: parameters gathered one
    block of `blocks` at a time, default the model's first ModuleList). lr, betas, eps,
    weight_decay: torch.optim.AdamW's, with its defaults; no_decay(name, param) -> True exempts a
    parameter from decay. The model then trains with `loss.backward(); opt.step(); opt.zero_grad()`
    on each dp rank's own samples (`model.meshspeed.dp_rank` of `dp_size`); every tp rank of a
    replica must see the same samples.
    load_from: a directory `save_pretrained` wrote, for a model built under
    `torch.device("meta")`: each rank reads only its own slices of the weights after the split
    (interop/load_sharded.py), so none ever holds the whole model.
    recompute: "full" keeps only each block's input for backward and runs the block again there
    (activation checkpointing of every block of `blocks`); "none" keeps everything.
    chunked_loss: a Hugging Face causal LM's `labels=` loss is taken a chunk of rows at a time
    without the full logits (interop/hf_loss.py; `.logits` is None when labels are given).
    cp > 1 in dims (a diffusers DiTTransformer2DModel only): its image tokens split over cp, the
    attention through meshspeed's cp core, `cp_impl` ring / ulysses / hybrid (`cp_ulysses` the
    Ulysses degree of hybrid); every cp rank of a replica sees the same samples, as tp ranks do
    (interop/diffusers_parallel.py).
    """
    if hasattr(model, ATTR):
        raise ConfigError("parallelize: this model was parallelized already; pass the single-device model")
    parallelize_vlm.check(model, dims, sequence_parallel, load_from)  # a Qwen2-VL: its options
    mesh = _mesh(dims, ctx)
    tp = mesh["tp"].size
    # every check before the first change: a refused model is left as it was
    dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
    if len(dtypes) != 1:
        raise ConfigError(
            f"parallelize: the trainable parameters have dtypes {sorted(map(str, dtypes)) or 'none'}; "
            "give the model one dtype (model.float() or model.to(torch.bfloat16))"
        )
    if zero not in (0, 1, 2, 3):
        raise ConfigError(f"parallelize: zero={zero!r} is not a ZeRO stage; valid: 0, 1, 2, 3")
    _check_memory(model, recompute, chunked_loss)
    cp = mesh["cp"].size
    if cp > 1:
        diffusers_parallel.check_context(model, mesh)
    units = _blocks(model, blocks) if zero == 3 or recompute != "none" else None
    split_ep = _check_experts(model, mesh, load_from)
    loading = load_sharded.plan_load(model, load_from) if load_sharded.check_meta(model, load_from) else None
    # tp = 1 needs no recipe: dp / ZeRO place any module (ZeRO-3's blocks: _blocks finds them)
    recipe = hf_recipe(model, tp, sequence_parallel) if plan is None and tp > 1 else None
    recipe = recipe or (parallelize_vlm.recipe(model, tp) if plan is None and tp > 1 else None)
    applied, hooks = None, []
    if tp > 1 and recipe is None and plan is None:
        raise _unplaced(model, tp)
    r = recipe or _custom_recipe(model, blocks)
    if tp > 1:
        tensor.parallelize(model, mesh, r, sequence_parallel=sequence_parallel, plan=plan)
        applied = model.ms_tp_plan
    if loading is not None:  # after the split: each rank reads only the pieces it now owns
        load_sharded.load_pieces(model, loading, r, mesh)
    if tp > 1 and recipe is not None and sequence_parallel:
        hooks = sequence_hooks(model, mesh["tp"])
    if split_ep:  # each member keeps its block of experts; DataParallel reduces them over edp
        hf_experts.split_experts(model, mesh["ep"])
    if cp > 1:  # before recompute wraps the blocks: their attention is swapped in place
        diffusers_parallel.apply_context(model, mesh, cp_impl, cp_ulysses)
    if recompute == "full":  # the block's forward, inside its module hooks (ZeRO-3, SP split)
        apply_recompute(model, "full", layers_attr=units)
    if chunked_loss:  # after the split: the head is then this rank's slice of the vocabulary
        hf_loss.chunk_loss_forward(model)
    _diffusers_root(model)
    dp, opt = build_data_parallel(
        model,
        mesh,
        zero=zero,
        bucket_mb=bucket_mb,
        dtype=next(iter(dtypes)),
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        no_decay=no_decay or (lambda name, p: False),
        units=units if zero == 3 else None,
        # cp ranks hold other tokens of the same samples: their gradients are reduced like dp's
        group="dp_cp" if cp > 1 else "dp",
    )
    object.__setattr__(model, ATTR, Parallelized(mesh, dp, applied, sequence_parallel, hooks))
    return model, opt


def _state(model: nn.Module) -> Parallelized:
    st = getattr(model, ATTR, None)
    if not isinstance(st, Parallelized):
        raise ConfigError(
            "this model was not made by meshspeed.parallelize; call parallelize(model, dims) first"
        )
    return st


def gathered(model: nn.Module):
    """Inside, every parameter of `model` holds this rank's whole local piece (ZeRO-3 gathers
    them; collective over dp). Nothing to do at ZeRO 0-2."""
    dp = _state(model).dp
    return dp.zero3.gathered() if dp.zero3 is not None else contextlib.nullcontext()


@torch.no_grad()
def gather_for_save(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state_dict with every tensor whole (tp pieces gathered, ZeRO-3 shards
    gathered): what `save_pretrained(dir, state_dict=...)` or `torch.save` should write.
    Collective: call it on every rank; each gets the same tensors (copies; tied parameters stay
    one tensor)."""
    st = _state(model)
    out, seen = {}, {}
    with gathered(model):
        for name, t in model.state_dict(keep_vars=True).items():
            if id(t) not in seen:
                full = placement.full_tensor(t, st.mesh, placement.sharding_of(t))
                seen[id(t)] = full.detach().clone()
            out[name] = seen[id(t)]
    return out


def clip_grad_norm_(model: nn.Module, max_norm: float = math.inf) -> torch.Tensor:
    """The global gradient norm of the whole (unsplit) model, after backward, the same on every
    rank; with a finite max_norm the gradients are scaled as torch.nn.utils.clip_grad_norm_
    scales them. Collective over all ranks."""
    st = _state(model)
    return optim.clip_grad_norm_(st.dp, max_norm, st.mesh)
