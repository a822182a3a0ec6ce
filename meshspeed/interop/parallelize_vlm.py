"""`meshspeed.parallelize` on a `transformers` Qwen2VLForConditionalGeneration (issue 43, item 4):
tensor parallelism on its language decoder, data parallelism on its vision encoder.

The decoder (`model.language_model`, `lm_head`) gets the plan parallelize applies to a
transformers Qwen2ForCausalLM (interop/hf_plan.py: meshspeed's own qwen2 family plan renamed onto
the Hugging Face modules), worked out on a view of the VLM holding only the decoder and the head
(`model` -> the language model, `lm_head`), then moved under `model.language_model`. The vision
encoder (`model.visual`: patch embedding, blocks, merger) is in no plan: every tp rank holds it
whole and, given the same samples, computes the same gradients (the gradient of the image
embeddings comes back whole through the decoder's column-parallel inputs); the trainer's data
parallelism then reduces them over the dp ranks with everything else (ZeRO-1/2/3 as for any model;
ZeRO-3's `blocks` default to the first ModuleList, which here is the encoder's `model.visual.blocks`).

Not supported here, refused in one line before anything changes: sequence parallelism, cp, pp,
ep and born-sharded loading (load_from).
"""

from __future__ import annotations

from torch import nn

from meshspeed.comm.errors import ConfigError
from meshspeed.comm.recipe import PipelineUnits, Recipe
from meshspeed.interop import hf_plan
from meshspeed.kernels.loss import cross_entropy_loss
from meshspeed.models.hf import config_from_hf

CLASSES = ("Qwen2VLForConditionalGeneration",)
DECODER = "model.language_model"


def is_vlm(model: nn.Module) -> bool:
    return type(model).__name__ in CLASSES


def check(model: nn.Module, dims, sequence_parallel: bool, load_from) -> None:
    """One line for an option this path does not build (dims: ParallelDims or its Mesh); nothing
    for a model that is not a recognised VLM."""
    if not is_vlm(model):
        return
    d = getattr(dims, "dims", dims)
    bad = [f"{k}={getattr(d, k)}" for k in ("pp", "cp", "ep") if getattr(d, k, 1) != 1]
    if sequence_parallel:
        bad.append("sequence_parallel=True")
    if load_from is not None:
        bad.append(f"load_from={load_from!r}")
    if bad:
        raise ConfigError(
            f"parallelize: {', '.join(bad)} on {type(model).__name__} is not supported (tp on its "
            "decoder, dp / ZeRO on its vision encoder are); use ParallelDims(dp=N, tp=T) without them"
        )


def _text_config(model: nn.Module):
    """The meshspeed ModelConfig of the decoder, read as a qwen2 causal LM."""
    t = model.config.text_config
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    text = {k: getattr(t, k) for k in keys}  # the shapes the plan depends on, nothing else
    text.update(
        model_type="qwen2",
        num_key_value_heads=getattr(t, "num_key_value_heads", None) or t.num_attention_heads,
        tie_word_embeddings=bool(getattr(model.config, "tie_word_embeddings", False)),
    )
    try:
        return config_from_hf(text)
    except ConfigError as e:
        raise ConfigError(f"parallelize: {type(model).__name__}'s decoder: {e}") from None


def recipe(model: nn.Module, tp: int) -> Recipe | None:
    """The recipe of a recognised VLM (None for any other model): the Qwen2 plan on its decoder."""
    if not is_vlm(model):
        return None
    config = _text_config(model)
    view = nn.Module()  # holds references only: the VLM's own modules are not moved
    view.model = model.get_submodule(DECODER)
    view.lm_head = model.lm_head
    plan = hf_plan._hf_plan(view, config, False) if tp > 1 else ()
    plan = tuple((DECODER + p[len("model") :] if p.startswith("model.") else p, s) for p, s in plan)
    return Recipe(
        name=type(model).__name__,
        build=lambda: model,
        init=hf_plan._no_init,
        loss=cross_entropy_loss,
        pipeline=PipelineUnits(f"{DECODER}.embed_tokens", f"{DECODER}.layers", (), hf_plan._no_args),
        tp_plan=plan,
        tp_styles=hf_plan.HF_STYLES,
        tp_divides={"num_attention_heads": config.n_heads, "num_key_value_heads": config.num_kv_heads},
        tied=hf_plan.tied_pairs(model),
        n_layers=config.n_layers,
        hidden_size=config.dim,
    )
