"""The recipe of a live `transformers` model (LlamaForCausalLM, MistralForCausalLM,
Qwen2ForCausalLM), inferred from its config and module tree, so that `meshspeed.parallelize`
splits the user's own object with meshspeed's tensor-parallel styles.

Nothing here is a second Llama plan. The plan is meshspeed's own family recipe
(models/llama.py, qwen2.py) applied to the meshspeed model of the same config, built on the meta
device; each module it claims is renamed to the Hugging Face module holding the same weights
by the name mapping of models/hf.py (`layers.3.attention.wq` -> `model.layers.3.self_attn.q_proj`).
The rotary layouts differ only inside a head, so a row split by heads is the same split in both.

Three styles change because the model's forward is Hugging Face's, not meshspeed's:

    output -> colwise_gathered     logits come back whole ([batch, seq, V]), so the model's own
                                   `labels=` loss and `.logits` keep their meaning
    tok_embeddings -> hf_embedding the embedding's output stays whole over the sequence: the
                                   model derives positions and the causal mask from its length
    wq/wk/wv -> colwise_gathered_input  (sequence parallelism) the attention reshapes by its
                                   input's length, so its input is gathered once by a hook and
                                   the three projections take the whole sequence

With sequence parallelism two hooks (`sequence_hooks`) keep the residual stream [batch, seq/tp,
dim] between the first block's input and the final norm: the first block's input is split, and
each attention's input is gathered (backward: every tp rank's part of its gradient is summed
by the projections' copy_to and this rank's rows kept). Norms and the MLP run as in
meshspeed's own model (sequence_norm, colwise / rowwise with the gather and reduce-scatter).
"""

from __future__ import annotations

import re

from torch import nn

from meshspeed import comm
from meshspeed.comm.errors import ConfigError
from meshspeed.comm.recipe import PipelineUnits, Recipe, Style, build_on_meta
from meshspeed.kernels.loss import cross_entropy_loss
from meshspeed.models import recipe_for
from meshspeed.models.hf import MODEL_TYPES, config_from_hf, hf_tensors
from meshspeed.parallel.tensor import ColumnParallelLinear, VocabParallelEmbedding, tp_plan

HF_CLASSES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

EXTRA_STYLES: dict[str, Style] = {
    "colwise_gathered": Style(
        nn.Linear,
        "output features split, then gathered whole (a head whose logits a plain loss reads)",
        lambda m, g, sp: ColumnParallelLinear(m, g, sp, gather_output=True),
    ),
}
HF_STYLES: dict[str, Style] = {
    **EXTRA_STYLES,
    "hf_embedding": Style(
        nn.Embedding,
        "rows split over the vocabulary; output summed, whole over the sequence",
        lambda m, g, sp: VocabParallelEmbedding(m, g, False),
    ),
    "colwise_gathered_input": Style(
        nn.Linear,
        "output features split; input already whole over the sequence (gathered by a hook)",
        lambda m, g, sp: ColumnParallelLinear(m, g, False),
    ),
}
_RENAMED = {"colwise_vocab": "colwise_gathered", "vocab_embedding": "hf_embedding"}
_ATTENTION_INPUTS = (".self_attn.q_proj", ".self_attn.k_proj", ".self_attn.v_proj")


def hf_model_config(model: nn.Module):
    """The meshspeed ModelConfig of a recognised `transformers` model, or None."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in MODEL_TYPES or not hasattr(config, "to_dict"):
        return None
    if not (hasattr(model, "lm_head") and hasattr(model, "model")):
        return None  # a base model or another head: not the causal-LM layout the plan names
    try:
        return config_from_hf(config.to_dict())
    except ConfigError as e:
        raise ConfigError(
            f"parallelize: {type(model).__name__}: {e}; pass plan= to split it by module names instead"
        ) from None


def tied_pairs(model: nn.Module) -> tuple[tuple[str, str], ...]:
    """(alias, owner) parameter names that are one Parameter (tied embeddings)."""
    owner: dict[int, str] = {}
    pairs = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in owner:
            pairs.append((name, owner[id(p)]))
        else:
            owner[id(p)] = name
    return tuple(pairs)


def _hf_plan(model: nn.Module, config, sequence_parallel: bool) -> tuple[tuple[str, str], ...]:
    ms = recipe_for(config)
    module_of = {
        fqn.rpartition(".")[0]: src.names[0].rpartition(".")[0]
        for fqn, src in hf_tensors(config).items()
        if not src.stacked
    }
    module_of.setdefault("output", "lm_head")  # tied: hf_tensors lists the embedding's Parameter only
    entries: list[tuple[str, str]] = []
    for fqn, style in tp_plan(ms).assign(build_on_meta(ms)):
        hf = module_of.get(fqn)
        if hf is None or not _has(model, hf):
            raise ConfigError(
                f"parallelize: {type(model).__name__} has no module {hf or fqn!r} for meshspeed's "
                f"{fqn} ({style}); pass plan= naming its modules (docs/parallelize.md)"
            )
        style = _RENAMED.get(style, style)
        if sequence_parallel and hf.endswith(_ATTENTION_INPUTS):
            style = "colwise_gathered_input"
        pattern = re.sub(r"\.layers\.\d+\.", ".layers.*.", hf)
        if (pattern, style) not in entries:
            entries.append((pattern, style))
    return tuple(entries)


def _has(model: nn.Module, fqn: str) -> bool:
    try:
        model.get_submodule(fqn)
    except AttributeError:
        return False
    return True


def hf_recipe(model: nn.Module, tp: int, sequence_parallel: bool) -> Recipe | None:
    """The recipe of `model` if it is a recognised `transformers` causal LM, else None."""
    config = hf_model_config(model)
    if config is None:
        return None
    name = type(model).__name__
    if config.n_experts and tp > 1:
        raise ConfigError(
            f"parallelize: tp={tp} for {name} is not supported (its experts have no plan here); "
            "use tp=1 (dp / ZeRO), or `meshspeed train --model.init_from` for tp and ep"
        )
    plan = _hf_plan(model, config, sequence_parallel) if tp > 1 else ()
    return Recipe(
        name=name,
        build=lambda: model,
        init=_no_init,
        loss=cross_entropy_loss,
        pipeline=PipelineUnits("model.embed_tokens", "model.layers", ("model.norm", "lm_head"), _no_args),
        tp_plan=plan,
        tp_styles=HF_STYLES,
        tp_divides={"num_attention_heads": config.n_heads, "num_key_value_heads": config.num_kv_heads},
        tied=tied_pairs(model),
        n_layers=config.n_layers,
        hidden_size=config.dim,
    )


def _no_init(fqn, shape, seed):
    raise ConfigError(f"{fqn}: a live Hugging Face model keeps its own weights; nothing is drawn")


def _no_args(model, positions):
    return ()


def _on_hidden(fn):
    """A forward pre-hook (with kwargs) applying fn to the module's `hidden_states` input."""

    def hook(module, args, kwargs):
        if args:
            return (fn(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}

    return hook


def sequence_hooks(model: nn.Module, group: comm.Group) -> list:
    """Sequence parallelism on a Hugging Face decoder: split the first block's input along the
    sequence, gather each attention's input (see the module docstring). Returns the handles."""

    def split(h):  # [batch, seq, dim] -> [batch, seq/tp, dim]
        if h.shape[1] % group.size:
            raise ConfigError(
                f"sequence parallelism needs the sequence length divisible by tp={group.size}, "
                f"got seq={h.shape[1]}; pad the batch to a multiple of {group.size} or pass "
                "sequence_parallel=False"
            )
        return comm.split_to(h, group, 1)

    layers = model.get_submodule("model.layers")
    handles = [layers[0].register_forward_pre_hook(_on_hidden(split), with_kwargs=True)]
    for layer in layers:  # [batch, seq/tp, dim] -> [batch, seq, dim]; backward keeps my rows
        gather = _on_hidden(lambda h: comm.gather_from(h, group, 1))
        handles.append(layer.self_attn.register_forward_pre_hook(gather, with_kwargs=True))
    return handles
