"""The Hugging Face mapping of the Llama-shaped families, beside their models: config.json <->
ModelConfig, tensor names, and the rotary layout. Pure data and tensor reshuffles; the files are
read and written by meshspeed/interop/hf_import.py.

    HF model_type        meshspeed                     HF class written back
    llama, mistral       family "llama", dense         LlamaForCausalLM
    mixtral              family "llama", MoE           MixtralForCausalLM
    qwen2                family "qwen2"                Qwen2ForCausalLM

Rotary layout. meshspeed (like Meta's reference and torchtitan) rotates the adjacent channel
pairs (2i, 2i+1) of each head at frequency i; Hugging Face's rotate-half rotates (i, i + d/2).
With the same frequencies, the two differ only by a permutation of each head's channels applied
alike to q and k, and attention scores q·k do not change under a common permutation of the
channels. So permuting, head by head, the output rows of wq and wk (and Qwen2's q/k biases)
converts one checkpoint into the other exactly: a reorder, no arithmetic, no rounding. v, wo
and everything else keep their layout. For head h of width d, j in {0, 1}, i < d/2:

    Hugging Face row  h*d + j*(d/2) + i   ==   meshspeed row  h*d + 2*i + j

(the inverse of `permute` in transformers' convert_llama_weights_to_hf.py, which goes from
Meta's layout to Hugging Face's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshspeed.comm.errors import ConfigError

from .config import ModelConfig

MODEL_TYPES = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2"}

# Fields that do not change the function the weights compute (bookkeeping, generation, the
# initialiser of a fresh model, inference-only caches): accepted and not used.
_IGNORED = frozenset(
    """
    _name_or_path architectures model_type transformers_version torch_dtype dtype use_cache
    initializer_range bos_token_id eos_token_id pad_token_id sep_token_id decoder_start_token_id
    output_attentions output_hidden_states return_dict id2label label2id problem_type
    chunk_size_feed_forward is_encoder_decoder tokenizer_class use_bfloat16 task_specific_params
    finetuning_task prefix max_length
    pretraining_tp max_window_layers
""".split()
)  # pretraining_tp: the same matmuls, sliced; max_window_layers: read with use_sliding_window
# Fields meshspeed reads; anything not here or above is an error naming it.
_MAPPED = frozenset(
    """
    vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads
    head_dim max_position_embeddings rms_norm_eps rope_theta rope_scaling rope_parameters
    tie_word_embeddings hidden_act attention_bias mlp_bias attention_dropout sliding_window
    use_sliding_window layer_types num_local_experts num_experts_per_tok router_aux_loss_coef
    output_router_logits router_jitter_noise
""".split()
)


def _bad(field: str, value, want: str) -> ConfigError:
    return ConfigError(f"config.json {field}={value!r} is not supported by meshspeed; {want}")


def _rope(hf: dict) -> dict:
    """ModelConfig rope fields from either spelling: transformers 5's `rope_parameters` or
    the `rope_theta` + `rope_scaling` of older configs (which win, as in transformers)."""
    params = dict(hf.get("rope_parameters") or {})
    key = "rope_parameters"
    if hf.get("rope_scaling"):
        params, key = dict(hf["rope_scaling"]), "rope_scaling"
    theta = hf.get(
        "rope_theta", params.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta"))
    )
    out = {"rope_theta": float(theta if theta is not None else 10000.0)}
    if any(isinstance(v, dict) for v in params.values()):  # per-layer-type RoPE (Gemma-style)
        raise _bad(key, params, "one RoPE for every layer")
    kind = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise _bad(f"{key}.partial_rotary_factor", params["partial_rotary_factor"], "RoPE covers whole heads")
    if kind == "default":
        return out
    if kind != "llama3":
        raise _bad(f"{key}.rope_type", kind, "supported: 'default' (none) and 'llama3'")
    try:
        return {
            **out,
            "rope_scaling": "llama3",
            "rope_scaling_factor": float(params["factor"]),
            "rope_low_freq_factor": float(params["low_freq_factor"]),
            "rope_high_freq_factor": float(params["high_freq_factor"]),
            "rope_original_max_seq_len": int(params["original_max_position_embeddings"]),
        }
    except KeyError as e:
        raise ConfigError(f"config.json {key} with rope_type 'llama3' lacks {e.args[0]!r}") from None


def config_from_hf(hf: dict) -> ModelConfig:
    """The ModelConfig of a Hugging Face config.json (a dict); a ConfigError naming the first
    field meshspeed cannot reproduce."""
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise _bad("model_type", model_type, f"supported: {', '.join(MODEL_TYPES)}")
    for field in hf:
        if field not in _IGNORED and field not in _MAPPED:
            raise _bad(
                field, hf[field], "meshspeed does not know this field (remove it if it changes nothing)"
            )
    checks = [
        ("hidden_act", "silu", "SwiGLU needs 'silu'"),
        ("attention_bias", False, "no attention biases"),
        ("mlp_bias", False, "no MLP biases"),
        ("attention_dropout", 0.0, "meshspeed has no dropout"),
        ("router_jitter_noise", 0.0, "meshspeed's router adds no noise"),
    ]
    for field, want, why in checks:
        if field in hf and hf[field] != want and (want or hf[field]):  # None/0/False all mean "off"
            raise _bad(field, hf[field], f"use {want!r} ({why})")
    for field in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
    ):
        if not isinstance(hf.get(field), int):
            raise ConfigError(
                f"config.json lacks {field} (or it is not an integer: {hf.get(field)!r}); "
                f"is this a {model_type} config.json?"
            )
    dim, heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, dim // heads) or dim % heads:
        raise _bad(
            "head_dim",
            hf.get("head_dim"),
            f"meshspeed's head dim is hidden_size / num_attention_heads = {dim / heads:g}",
        )
    max_len = int(hf.get("max_position_embeddings", 2048))
    # A sliding window equals full causal attention on sequences no longer than the window, so
    # the model is capped there (its forward refuses longer ones) instead of refused.
    window = hf.get("sliding_window")
    if model_type == "qwen2" and not hf.get("use_sliding_window", False):
        window = None
    if "sliding_attention" in (hf.get("layer_types") or ()) and window is None:
        raise _bad("layer_types", "sliding_attention", "no sliding_window given")
    if bad := [t for t in hf.get("layer_types") or () if t not in ("full_attention", "sliding_attention")]:
        raise _bad("layer_types", bad[0], "meshspeed has full (and capped sliding) attention only")
    if window is not None:
        max_len = min(max_len, int(window))
    kw = dict(
        family=MODEL_TYPES[model_type],
        dim=dim,
        n_layers=hf["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        vocab_size=hf["vocab_size"],
        ffn_hidden=hf["intermediate_size"],
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_seq_len=max_len,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        **_rope(hf),
    )
    if model_type == "mixtral":
        top_k = hf.get("num_experts_per_tok", 2)
        # HF's Mixtral balancing loss is top_k times meshspeed's (moe.py), and only on when asked
        aux = float(hf.get("router_aux_loss_coef", 0.0)) * top_k if hf.get("output_router_logits") else 0.0
        kw.update(
            n_experts=hf.get("num_local_experts", 8),
            top_k=top_k,
            moe_ffn_hidden=hf["intermediate_size"],
            router_softmax="after_topk",
            aux_loss_coef=aux,
            z_loss_coef=0.0,
        )
    try:
        return ModelConfig(**kw)
    except ValueError as e:
        raise ConfigError(f"config.json gives a model meshspeed cannot build: {e}") from None


def check_exportable(config: ModelConfig, setting: str = "") -> None:
    """A ConfigError naming the ModelConfig field that no Hugging Face class reproduces (after
    `setting`, e.g. "checkpoint.export_hf=true: ", when a setting asked for the export)."""
    if not config.n_experts:
        return
    rules = [
        ("family", config.family, "llama", "Qwen2 MoE export is not supported"),
        ("n_shared_experts", config.n_shared_experts, 0, "Mixtral has no shared expert"),
        ("first_k_dense", config.first_k_dense, 0, "every Mixtral layer is MoE"),
        ("moe_every", config.moe_every, 1, "every Mixtral layer is MoE"),
        (
            "router_softmax",
            config.router_softmax,
            "after_topk",
            "Mixtral renormalises the top-k weights, which equals softmax after top-k",
        ),
    ]
    for field, value, want, why in rules:
        if value != want:
            raise ConfigError(
                f"{setting}ModelConfig.{field}={value!r} cannot be exported to Hugging Face; "
                f"it needs {want!r} ({why})"
            )


def config_to_hf(config: ModelConfig, dtype: torch.dtype = torch.float32, extra: dict | None = None) -> dict:
    """The config.json of `config` (after check_exportable). `extra`: fields kept from an
    imported config.json (token ids...) where they do not contradict this one. Rope settings are
    written as `rope_theta`/`rope_scaling`, which transformers 4.43+ and 5 both read."""
    check_exportable(config)
    moe = config.n_experts > 0
    model_type = "mixtral" if moe else ("qwen2" if config.family == "qwen2" else "llama")
    if model_type == "llama" and (extra or {}).get("model_type") == "mistral":
        model_type = "mistral"  # Llama's architecture under the name its user knows
    arch = {
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "mixtral": "MixtralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
    }[model_type]
    out = {k: v for k, v in (extra or {}).items() if k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    out.update(
        architectures=[arch],
        model_type=model_type,
        vocab_size=config.vocab_size,
        hidden_size=config.dim,
        intermediate_size=config.moe_ffn_dim if moe else config.ffn_dim,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        hidden_act="silu",
        max_position_embeddings=config.max_seq_len,
        rms_norm_eps=config.norm_eps,
        rope_theta=config.rope_theta,
        rope_scaling=None,
        tie_word_embeddings=config.tie_embeddings,
        attention_dropout=0.0,
        torch_dtype=str(dtype).removeprefix("torch."),
        use_cache=True,
    )
    if config.rope_scaling == "llama3":
        out["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": config.rope_scaling_factor,
            "low_freq_factor": config.rope_low_freq_factor,
            "high_freq_factor": config.rope_high_freq_factor,
            "original_max_position_embeddings": config.rope_original_max_seq_len,
        }
    if model_type == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    if model_type == "qwen2":
        out.update(use_sliding_window=False, sliding_window=None)
    if model_type == "mistral":  # full attention: max_position_embeddings is already within any window
        out.update(sliding_window=None)
    if moe:
        out.update(
            num_local_experts=config.n_experts,
            num_experts_per_tok=config.top_k,
            sliding_window=None,
            router_aux_loss_coef=config.aux_loss_coef / config.top_k,
            output_router_logits=config.aux_loss_coef > 0,
            router_jitter_noise=0.0,
        )
    return out


# --- tensors ------------------------------------------------------------------------------


@dataclass(frozen=True)
class HFTensor:
    """Where one meshspeed parameter lives in a Hugging Face checkpoint: one tensor, or (experts)
    several stacked along a new dim 0; `head_dim` > 0: rows are heads of that width in HF's
    rotate-half layout, to be permuted (see the module docstring)."""

    names: tuple[str, ...]
    head_dim: int = 0
    stacked: bool = False


def hf_tensors(config: ModelConfig) -> dict[str, HFTensor]:
    """meshspeed parameter FQN -> its Hugging Face source, for the whole model (a tied `output`
    is the embedding's Parameter and is not listed, as in named_parameters)."""
    d = config.head_dim
    out = {
        "tok_embeddings.weight": HFTensor(("model.embed_tokens.weight",)),
        "norm.weight": HFTensor(("model.norm.weight",)),
    }
    if not config.tie_embeddings:
        out["output.weight"] = HFTensor(("lm_head.weight",))
    for i in range(config.n_layers):
        hf, ms = f"model.layers.{i}", f"layers.{i}"
        out[f"{ms}.attention_norm.weight"] = HFTensor((f"{hf}.input_layernorm.weight",))
        out[f"{ms}.ffn_norm.weight"] = HFTensor((f"{hf}.post_attention_layernorm.weight",))
        for w, proj, rope in (
            ("wq", "q_proj", d),
            ("wk", "k_proj", d),
            ("wv", "v_proj", 0),
            ("wo", "o_proj", 0),
        ):
            out[f"{ms}.attention.{w}.weight"] = HFTensor((f"{hf}.self_attn.{proj}.weight",), rope)
            if config.qkv_bias and w != "wo":
                out[f"{ms}.attention.{w}.bias"] = HFTensor((f"{hf}.self_attn.{proj}.bias",), rope)
        if config.is_moe_layer(i):  # Mixtral: per-expert Linear weights, stacked here [E, ...]
            moe = f"{hf}.block_sparse_moe"
            out[f"{ms}.feed_forward.router.gate.weight"] = HFTensor((f"{moe}.gate.weight",))
            for w in ("w1", "w2", "w3"):
                out[f"{ms}.feed_forward.experts.{w}"] = HFTensor(
                    tuple(f"{moe}.experts.{e}.{w}.weight" for e in range(config.n_experts)), stacked=True
                )
        else:
            for w, proj in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")):
                out[f"{ms}.feed_forward.{w}.weight"] = HFTensor((f"{hf}.mlp.{proj}.weight",))
    return out


def interleaved_rows(n_rows: int, head_dim: int) -> torch.Tensor:
    """Row index: meshspeed row r holds Hugging Face row [r] (n_rows = heads * head_dim)."""
    return torch.arange(n_rows).view(-1, 2, head_dim // 2).transpose(1, 2).reshape(-1)


def to_interleaved(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Hugging Face (rotate-half) rows -> meshspeed (interleaved) rows, along dim 0."""
    return t[interleaved_rows(t.shape[0], head_dim)]


def to_rotate_half(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """meshspeed (interleaved) rows -> Hugging Face (rotate-half) rows: the inverse permutation."""
    return t[torch.argsort(interleaved_rows(t.shape[0], head_dim))]


def to_hf(fqn: str, value: torch.Tensor, source: HFTensor) -> dict[str, torch.Tensor]:
    """The Hugging Face tensors of meshspeed parameter `fqn` holding the full `value`."""
    if source.head_dim:
        value = to_rotate_half(value, source.head_dim)
    if source.stacked:
        if value.shape[0] != len(source.names):
            raise ConfigError(f"{fqn} holds {value.shape[0]} experts but the config has {len(source.names)}")
        return {n: v.contiguous() for n, v in zip(source.names, value.unbind(0))}
    return {source.names[0]: value.contiguous()}
