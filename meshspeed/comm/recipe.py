"""Recipe: what a model family declares, beside its model code, about how it may be split.

It lives in comm, beside the placement vocabulary, because both sides need the type and
neither may import the other: `models/` writes recipes, `parallel/` reads them and never
imports `models/`. A new family is a model file plus a recipe, and nothing in `parallel/`
changes. A recipe is data (FQN patterns, names) plus the few
callables only the family can supply (how to build it, its initial values, the extra inputs
its blocks take). The fields:

    build()                 the single-device model (called under the meta device)
    init(fqn, shape, seed)  the full initial value of a parameter: layout independent, so a
                            rank materialises its piece of exactly what one device would hold
    finish(model)           recompute derived buffers (RoPE tables) once parameters are real
    tp_plan                 ordered (FQN pattern, style) pairs, first match wins (tensor.py)
    tp_styles               styles the family adds (e.g. its MoE layer's), same shape as built-ins
    tp_divides              {config field: value} that the tp degree must divide (heads...)
    pipeline                PipelineUnits: which modules a pipeline stage may hold
    experts                 (FQN pattern, expert dim) of stacked expert weights
    tied                    (alias FQN, owner FQN) parameters that are one Parameter
    n_layers, hidden_size   block count; width of the hidden states between pipeline stages
    loss                    plain (unsharded) loss: (logits, targets, ignore_index) -> mean
    aux_loss(modules)       the family's auxiliary loss over some of its modules (MoE), or None
    causal                  whether its self-attention is causal (decoders) or full (DiT's image
                            tokens): context parallelism may skip blocks only when causal
    cp_tokens               (entry FQN, exit FQN) for a family whose input is not a token
                            sequence (an image): context parallelism cuts the entry's output
                            [B, N, ...] to each rank's tokens and gathers the exit's output
                            whole; what else the blocks take (conditioning, text) stays whole.
                            Empty: the trainer feeds each cp rank its slice of the tokens.
    sp_split                the module whose output sequence parallelism cuts to this rank's
                            [B, seq/tp, ...] rows, for a family whose embedding must see the
                            whole sequence (a vlm scatters image features into placeholders
                            anywhere in it): the modules inside it run as without SP, whole on
                            every tp rank, and the cut's backward all-gathers. Empty: the token
                            embedding's reduce-scatter cuts (vocab_embedding).
    encoder                 EncoderUnit: a sub-model `[modules]` may give a layout of its own
                            (its ranks, dp, tp), joined to the rest through parallel/seam.py
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode


@dataclass(frozen=True)
class Style:
    """A tensor-parallel style: the module type it applies to, what it does, and how to build
    the parallel module `(module, tp group, sequence_parallel) -> module`."""

    applies_to: type
    doc: str
    build: Callable[[nn.Module, object, bool], nn.Module]


@dataclass(frozen=True)
class PipelineUnits:
    """The modules a pipeline stage holds. `layers` names an nn.ModuleDict of blocks keyed by
    str(index) (deleting some keeps the others' FQNs); stage 0 runs `embedding` first and the
    last stage runs `head` in order after the last block. Each block is called as
    `block(h, *layer_args(model, positions))`.

    Between stages travels ONE tensor per micro-batch, [micro, seq(/tp), hidden]. A family whose
    blocks need more than the hidden states (a dit's conditioning c [micro, dim], with its
    gradient back) packs it into `carry` extra rows of that tensor, so the runtime's messages
    stay one fixed-shape tensor and the gradient of the packed rows travels back like any
    other (a second message per micro-batch would touch every send, receive, leaf and split
    backward of the runtime). The optional fields say how:

        also_first  more modules only stage 0 holds (dit: the timestep and class embedders)
        inputs      the micro-batch keys stage 0 runs on, in order (default: the tokens)
        seq_len     rows per sample between stages when the input is not train.seq_len tokens
                    (dit: its image tokens); 0: the caller's seq_len
        carry       rows packed ahead of the sequence: messages are [micro, carry + seq, hidden]
        embed       (model, *inputs) -> the packed activation, on stage 0
        run_block   (block, packed, *layer_args) -> packed: unpack, run, re-pack
        run_head    (model, packed) -> the model's output, on the last stage
    """

    embedding: str
    layers: str
    head: tuple[str, ...]
    layer_args: Callable[[nn.Module, torch.Tensor], tuple]
    also_first: tuple[str, ...] = ()
    inputs: tuple[str, ...] = ("tokens",)
    seq_len: int = 0
    carry: int = 0
    embed: Callable[..., torch.Tensor] | None = None
    run_block: Callable[..., torch.Tensor] | None = None
    run_head: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None

    def first_modules(self) -> tuple[str, ...]:
        """Every module only stage 0 holds."""
        return (self.embedding, *self.also_first)


def _no_aux(modules: Iterable[nn.Module]) -> torch.Tensor | None:
    return None


@dataclass(frozen=True)
class EncoderUnit:
    """A sub-model that may run in a layout of its own (`[modules]`: a vlm's image encoder).

    prefixes    the FQN prefixes of its parameters (everything else is the decoder's)
    blocks      the FQN of its container of blocks (ZeRO-3 gathers each on its own)
    input       the micro-batch key it reads (one row per record: "images")
    encode      (model, inputs [n, ...]) -> rows [n, *row_shape] for the decoder
    decode      (model, item, rows) -> the decoder's output on the micro-batch `item`, the
                encoder's rows given instead of computed (the model's own forward)
    embed       (model, tokens, rows) -> the decoder's embedding unit on the rows (a pipeline's
                first stage runs it in place of PipelineUnits.embed)
    row_shape   one record's rows (a vlm: [image tokens, dim])
    """

    prefixes: tuple[str, ...]
    blocks: str
    input: str
    encode: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    decode: Callable[[nn.Module, dict, torch.Tensor], torch.Tensor]
    embed: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    row_shape: tuple[int, ...]

    def owns(self, fqn: str) -> bool:
        return any(fqn == p or fqn.startswith(p + ".") for p in self.prefixes)


@dataclass(frozen=True)
class Recipe:
    name: str
    build: Callable[[], nn.Module]
    init: Callable[[str, torch.Size, int], torch.Tensor]
    loss: Callable[..., torch.Tensor]
    pipeline: PipelineUnits
    tp_plan: tuple[tuple[str, str], ...] = ()
    tp_styles: dict[str, Style] = field(default_factory=dict)
    tp_divides: dict[str, int] = field(default_factory=dict)
    experts: tuple[tuple[str, int], ...] = ()
    tied: tuple[tuple[str, str], ...] = ()
    n_layers: int = 0
    hidden_size: int = 0
    finish: Callable[[nn.Module], None] = lambda model: None
    aux_loss: Callable[[Iterable[nn.Module]], torch.Tensor | None] = _no_aux
    causal: bool = True
    cp_tokens: tuple[str, ...] = ()
    sp_split: str = ""
    encoder: EncoderUnit | None = None

    def __str__(self) -> str:
        lines = [
            f"recipe {self.name}: {self.n_layers} blocks in {self.pipeline.layers!r}, "
            f"embedding {self.pipeline.embedding!r}, head {', '.join(self.pipeline.head)}"
        ]
        lines += [f"  tp {p} -> {s}" for p, s in self.tp_plan]
        lines += [f"  expert {p} (expert dim {d})" for p, d in self.experts]
        lines += [f"  tied {a} = {o}" for a, o in self.tied]
        if not self.causal:
            lines.append("  attention: full (context parallelism visits every ring block)")
        if self.cp_tokens:
            lines.append(f"  cp tokens: cut after {self.cp_tokens[0]}, gathered after {self.cp_tokens[1]}")
        if self.sp_split:
            lines.append(f"  sequence parallel: cut after {self.sp_split}, whole inside it")
        if self.pipeline.carry:
            lines.append(f"  pipeline: {self.pipeline.carry} row(s) carried ahead of the sequence")
        return "\n".join(lines)


class _SkipInitOnMeta(TorchFunctionMode):
    """Skips a module's default initialisers while it is built on the meta device. They compute
    nothing there, and the first one imports torch's Python meta decompositions and dynamo
    (measured on 2 CPU cores: 2.4 s in a worker that imported the trainer, 4.7 s in the CLI),
    once in every process. Every value is set after materialisation (`Recipe.init`)."""

    # nn.init's functions and the in-place Tensor methods they call
    _SKIP = frozenset(
        {"normal_", "uniform_", "trunc_normal_", "zeros_", "ones_", "constant_", "zero_", "fill_"}
    )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")  # nn.init passes it by name
        if getattr(func, "__name__", "") in self._SKIP and getattr(target, "is_meta", False):
            return target
        return func(*args, **kwargs)


def build_on_meta(recipe: Recipe) -> nn.Module:
    """`recipe.build()` on the meta device, without the default initialisers."""
    with torch.device("meta"), _SkipInitOnMeta():
        return recipe.build()


def set_submodule(model: nn.Module, fqn: str, module: nn.Module | None) -> None:
    parent, _, name = fqn.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)


def get_optional(model: nn.Module, fqn: str) -> nn.Module | None:
    """The submodule at `fqn`, or None where a pipeline stage dropped it (or a parent)."""
    m = model
    for part in fqn.split("."):
        m = getattr(m, part, None)
        if m is None:
            return None
    return m


def tie(model: nn.Module, recipe: Recipe) -> None:
    """Make each tied alias the owner's Parameter again (materialising or sharding creates new
    Parameters and would silently untie them). Skipped where a stage lacks either side."""
    for alias, owner in recipe.tied:
        a_mod, _, a_name = alias.rpartition(".")
        o_mod, _, o_name = owner.rpartition(".")
        am, om = get_optional(model, a_mod), get_optional(model, o_mod)
        if am is not None and om is not None:
            setattr(am, a_name, getattr(om, o_name))
