"""The config's transformations of a built (born-sharded) model or pipeline stage, in the order
they compose. Each one swaps modules or attention cores from outside; the model code stays
single-device."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import torch
from torch import nn

from meshspeed import comm
from meshspeed.kernels.choose import KernelChooser
from meshspeed.memory import apply_recompute, apply_swap_activations
from meshspeed.memory.chunked_loss import fused_head
from meshspeed.models.layers import set_kernels
from meshspeed.models.llama import attention_core
from meshspeed.parallel.context import apply_context_parallel
from meshspeed.parallel.tensor import ColumnParallelLinear, RowParallelLinear, loss_fn, set_tp_overlap
from meshspeed.parallel.tp_overlap import default_chunks, overlap_cost

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclasses.dataclass
class ModelFeatures:
    """What apply_model_features decided, for the trainer's loss and its start-up lines.

    head: the loss head's implementation ("ref": projection, then the loss; "torch" / "triton":
    kernels.linear_ce, fused and chunked). compiled: blocks put through torch.compile.
    kernels: op -> implementation chosen (train.fused_kernels). loss: the recipe's loss through
    torch.compile (train.compile), for the plain head."""

    head: str = "ref"
    compiled: int = 0
    loss: Callable | None = None
    kernels: dict = dataclasses.field(default_factory=dict)
    lines: list = dataclasses.field(default_factory=list)


def _agree(group: comm.Group):
    """Ranks holding the same replicated values must run the same kernels: every one times,
    the slowest rank's times decide (one all-reduce per choice, same order on every rank)."""

    def agree(secs: list[float]) -> list[float]:
        t = torch.tensor(secs, dtype=torch.float64, device=group.ctx.device)
        return comm.all_reduce(t, group, "max").tolist()

    return agree


def choose_kernels(model: nn.Module, cfg, mesh, device, recipe) -> ModelFeatures:
    """train.fused_kernels: every kernel site of `model` gets its fastest implementation at its
    shape (kernels.choose), the same on every tensor-parallel rank; with train.compile the
    blocks stay on the reference (inductor fuses them itself) and only the loss head is chosen.
    The head (projection + loss, or kernels.linear_ce) is chosen where the fused loss computes
    it (memory.chunked_loss.fused_head) and without pipeline parallelism, whose last stage
    scores through memory.chunked_loss's own switch."""
    t, p = cfg.train, cfg.parallel
    feats = ModelFeatures()
    chooser = KernelChooser(device, agree=_agree(mesh["tp"]) if p.tp > 1 else None, say=feats.lines.append)
    dtype, seq = DTYPES[t.dtype], t.seq_len // p.cp
    if not t.compile:
        set_kernels(model, chooser.pick, t.micro_batch_size, seq, dtype)
    head = getattr(model, recipe.pipeline.head[-1], None)
    if p.pp == 1 and head is not None and fused_head(head, loss_fn(model, recipe.loss)) is not None:
        vocab, dim = head.weight.shape  # this rank's slice of the vocabulary
        feats.head = chooser.pick("linear_ce", (t.micro_batch_size * seq, dim, vocab), dtype)
    feats.kernels = {k[0]: v for k, v in chooser.table.items()}
    return feats


def _eager(fn):
    """Run `fn` outside the compiled graph: a clean graph break at a module that talks to
    other ranks (meshspeed.comm's collectives are Python dynamo does not trace) or whose
    forward another feature replaced (activation recompute frees storages by hand)."""
    return torch.compiler.disable(fn, recursive=True)


def overlap_choices(model: nn.Module, cfg) -> list[str]:
    """parallel.tp_overlap with the cost model's K: work K out now for the shapes the layers
    will see (kept on each layer, as its forward would) and say it once per kind of layer;
    K = 1 runs the plain sequence-parallel path (parallel/tp_overlap.chunks_for)."""
    t, p = cfg.train, cfg.parallel
    dtype, seq = DTYPES[t.dtype], t.seq_len // p.cp
    seen: dict = {}
    for m in model.modules():
        if not (isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and m.tp_overlap):
            continue
        kind, g = ("column", m.group.size) if isinstance(m, ColumnParallelLinear) else ("row", m.group.size)
        # column: x [b, seq/tp, in] (gathered inside); row: x [b, seq, in/tp]
        shape = (t.micro_batch_size, seq // g if kind == "column" else seq, m.weight.shape[1])
        elem = torch.empty((), dtype=dtype).element_size()
        k = default_chunks(m.group, *overlap_cost(kind, shape, elem, tuple(m.weight.shape), g))
        m.tp_overlap_auto[(shape, dtype)] = k
        seen[(kind, shape, tuple(m.weight.shape))] = k
    return [
        f"tp_overlap {kind} x{list(shape)} w{list(w)}: K={k}"
        + (" (plain: nothing to hide)" if k == 1 else "")
        for (kind, shape, w), k in seen.items()
    ]


def _blocks(model: nn.Module, recipe) -> list[nn.Module]:
    container = getattr(model, recipe.pipeline.layers, None)
    if container is None:  # a pipeline stage without blocks
        return []
    return list(container.values() if isinstance(container, nn.ModuleDict) else container)


def compile_blocks(model: nn.Module, recipe, fullgraph: bool, backend: str = "inductor") -> int:
    """Each block of the recipe's layer container through torch.compile: its forward, so the
    module hooks ZeRO-3 gathers with stay outside, and before recompute, so `full` checkpoints
    the compiled block. Compilation is lazy: what the block calls is traced at its first
    forward, after mark_eager. The blocks share one graph (their parameters are its inputs).
    Returns the blocks compiled."""
    blocks = _blocks(model, recipe)
    for block in blocks:
        block.forward = torch.compile(block.forward, fullgraph=fullgraph, backend=backend)
    return len(blocks)


def traceable(m: nn.Module) -> bool:
    """A module (or attention core) whose communication dynamo traces: tensor / sequence parallel
    layers (comm.autograd switches to comm/traceable.py's functional collectives while compiling)
    and the context-parallel core (its all-to-alls the same way, the ring as custom operators)."""
    return bool(getattr(type(m), "ms_traceable", False))


def eager_parts(model: nn.Module, recipe) -> list[str]:
    """Modules inside the blocks that hold a process group whose collectives dynamo cannot trace
    (expert-parallel layers): each would be a graph break, so the blocks cannot compile whole."""
    return [
        f"{i}.{name}"
        for i, block in enumerate(_blocks(model, recipe))
        for name, m in block.named_modules()
        if m is not block and isinstance(getattr(m, "group", None), comm.Group) and not traceable(m)
    ]


def mark_eager(model: nn.Module, recipe) -> None:
    """Inside the compiled blocks, a module holding a process group whose collectives are not
    traceable (expert parallel layers; tensor and sequence parallel ones stay in the graph), a
    forward another feature replaced (activation recompute) and an attention core that is not
    the plain one (context parallel, swapped, recomputed) run eagerly, between compiled pieces."""
    for block in _blocks(model, recipe):
        for m in block.modules():
            if m is block:
                continue
            replaced = "forward" in m.__dict__
            if replaced or (isinstance(getattr(m, "group", None), comm.Group) and not traceable(m)):
                m.forward = _eager(m.forward)
            core = getattr(m, "core", None)
            if callable(core) and core is not attention_core and not traceable(core):
                m.core = _eager(core)


def apply_model_features(model: nn.Module, cfg, mesh, recipe, device, cp=None) -> ModelFeatures:
    """After expert parallelism (applied on meta, while building: the expert weights are born
    sharded) and before the data-parallel buckets are built. cp: the context-parallel core
    (parallel/context.py) when parallel.cp > 1."""
    p, t, m = cfg.parallel, cfg.train, cfg.memory
    feats = choose_kernels(model, cfg, mesh, device, recipe) if t.fused_kernels else ModelFeatures()
    if p.tp_overlap:  # plan/config checked sequence_parallel; 0 chunks = the cost model's K per layer
        set_tp_overlap(model, True, p.tp_overlap_chunks or None)
        if not p.tp_overlap_chunks:
            feats.lines += overlap_choices(model, cfg)
    if t.compile:
        whole = compile_fullgraph(cfg) and not eager_parts(model, recipe)
        feats.compiled = compile_blocks(model, recipe, fullgraph=whole, backend=compile_backend())
        feats.loss = torch.compile(recipe.loss, fullgraph=True, backend=compile_backend())
    if cp is not None:
        apply_context_parallel(model, cp, tokens=recipe.cp_tokens)
    # after the cp core is in: selective recompute wraps whichever attention core runs
    apply_recompute(model, m.recompute, m.recompute_layers or None, recipe.pipeline.layers)
    if m.swap_activations:  # the attention cores' saved tensors to host memory (memory/swap.py)
        apply_swap_activations(model, device, m.swap_layers or None, recipe.pipeline.layers)
    if t.compile:  # after every swap above: those pieces stay eager
        mark_eager(model, recipe)
    return feats


def compile_fullgraph(cfg) -> bool:
    """Blocks compile whole (no graph break) unless a layout puts untraceable collectives
    (expert parallelism), hand-freed storages, a swapped or recomputed attention core or
    context parallelism over packed documents inside them. Tensor, sequence and context
    parallelism compile whole: their communication is traced."""
    p, m = cfg.parallel, cfg.memory
    cp_whole = p.cp == 1 or not cfg.data.packing  # packed documents' masks are built eagerly
    return cp_whole and p.ep == 1 and m.recompute in ("none", "full") and not m.swap_activations


def compile_backend() -> str:
    """torch.compile's backend for the blocks: inductor, or MESHSPEED_COMPILE_BACKEND (tests trace
    with "aot_eager": the same graphs, forward and backward, without inductor's C++ build)."""
    return os.environ.get("MESHSPEED_COMPILE_BACKEND", "inductor")
