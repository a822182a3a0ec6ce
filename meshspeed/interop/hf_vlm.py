"""Hugging Face Qwen2-VL <-> meshspeed family 'vlm': config and weights, both ways.

Why Qwen2-VL (not Llava): its shape is the one meshspeed's `vlm` is meant to have — a ViT with
2D positions, a 2 x 2 patch merger and a Qwen2 (Llama-shaped) decoder — and M-RoPE, the reason
one might avoid it, costs little here: meshspeed's decoder already takes per-token rotary tables
[batch, seq, head_dim/2], and under the rotate-half -> interleaved permutation that the text
families' converter applies to wq/wk (models/hf.py), Hugging Face's frequency i stays frequency
i, so M-RoPE is "frequency i reads the position of its section's axis" (vlm.mrope_tables). Llava
would have meant a CLIP ViT (class token, learned 1D positions) and no merger.

What differs only in layout, converted exactly:
- the ViT's fused qkv Linear is cut into wq, wk, wv (each then splits over tp by heads);
- the patch embedding: Hugging Face's Conv3d over (time = temporal_patch_size, p, p) sees a still
  image as temporal_patch_size equal frames, so it equals a Linear whose weight is the sum of
  its time taps (import); export writes the weight / T into each tap (their sum is the weight);
- decoder q/k rows permuted per head (models/hf.py), as for Qwen2.

    cfg = hf_vlm.config_from_hf(hf_model.config.to_dict(), image_size=32)
    state = hf_vlm.state_from_hf(hf_model.state_dict(), cfg)   # -> VLM.load_state_dict
    hf_state = hf_vlm.state_to_hf(model.state_dict(), cfg)      # -> Qwen2VLForConditionalGeneration
"""

from __future__ import annotations

import torch

from meshspeed.comm.errors import ConfigError
from meshspeed.models.config import ModelConfig
from meshspeed.models.hf import hf_tensors, to_interleaved, to_rotate_half

VISION = "model.visual"
TEXT = "model.language_model"
TEMPORAL_PATCH = 2  # Qwen2-VL's temporal_patch_size, written on export


def _get(d: dict, key: str, default=None):
    value = d.get(key, default)
    if value is None and default is None:
        raise ConfigError(f"Qwen2-VL config lacks {key!r}")
    return value


def config_from_hf(hf: dict, image_size: int = 32, max_seq_len: int | None = None) -> ModelConfig:
    """The 'vlm' ModelConfig of a Qwen2VLConfig dict (`config.to_dict()` or config.json).
    Qwen2-VL takes any resolution; meshspeed's ViT a fixed `image_size`."""
    if hf.get("model_type") != "qwen2_vl":
        raise ConfigError(
            f"config.json model_type={hf.get('model_type')!r} is not supported here; use 'qwen2_vl'"
        )
    text, vision = hf["text_config"], hf["vision_config"]
    checks = [
        (vision, "vision_config.hidden_act", "hidden_act", "quick_gelu"),
        (vision, "vision_config.in_channels", "in_channels", 3),
        (text, "text_config.hidden_act", "hidden_act", "silu"),
    ]
    for d, name, key, want in checks:
        if d.get(key, want) != want:
            raise ConfigError(f"config.json {name}={d[key]!r} is not supported by meshspeed; use {want!r}")
    if text.get("use_sliding_window"):
        raise ConfigError("config.json text_config.use_sliding_window=true is not supported; use false")
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    vrope = vision.get("rope_parameters") or {}
    if vrope.get("rope_theta", 10000.0) != 10000.0:
        raise ConfigError(
            f"config.json vision_config.rope_theta={vrope['rope_theta']} is not supported; use 10000"
        )
    mlp_ratio = vision.get("mlp_ratio", 4)
    return ModelConfig(
        family="vlm",
        dim=_get(text, "hidden_size"),
        n_layers=_get(text, "num_hidden_layers"),
        n_heads=_get(text, "num_attention_heads"),
        n_kv_heads=text.get("num_key_value_heads"),
        vocab_size=_get(text, "vocab_size"),
        ffn_hidden=_get(text, "intermediate_size"),
        norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 1e6))),
        max_seq_len=max_seq_len or _get(text, "max_position_embeddings"),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        image_size=image_size,
        patch_size=_get(vision, "patch_size"),
        vision_dim=_get(vision, "embed_dim"),
        vision_layers=_get(vision, "depth"),
        vision_heads=_get(vision, "num_heads"),
        vision_ffn_hidden=int(vision["embed_dim"] * mlp_ratio),
        merge_size=vision.get("spatial_merge_size", 2),
        image_token_id=_get(hf, "image_token_id"),
        mrope_section=tuple(rope["mrope_section"]) if "mrope_section" in rope else None,
    )


def config_to_hf(config: ModelConfig) -> dict:
    """Keyword arguments of transformers' Qwen2VLConfig for `config` (family 'vlm')."""
    from meshspeed.models.vlm_config import mrope_section, vision_ffn_dim

    if vision_ffn_dim(config) % config.vision_dim:
        raise ConfigError(
            f"ModelConfig.vision_ffn_hidden={config.vision_ffn_hidden} is not a multiple of "
            f"vision_dim={config.vision_dim}; Qwen2-VL writes the MLP width as mlp_ratio * embed_dim"
        )
    # Placeholder ids Qwen2-VL requires besides the image's: the ids just below it (unused by
    # meshspeed; any in-vocabulary value loads).
    img = config.image_token_id
    return dict(
        model_type="qwen2_vl",
        text_config=dict(
            vocab_size=config.vocab_size,
            hidden_size=config.dim,
            intermediate_size=config.ffn_dim,
            num_hidden_layers=config.n_layers,
            num_attention_heads=config.n_heads,
            num_key_value_heads=config.num_kv_heads,
            rms_norm_eps=config.norm_eps,
            max_position_embeddings=config.max_seq_len,
            hidden_act="silu",
            rope_parameters={
                "rope_type": "default",
                "rope_theta": config.rope_theta,
                "mrope_section": list(mrope_section(config)),
            },
            bos_token_id=None,
            eos_token_id=None,
        ),
        vision_config=dict(
            depth=config.vision_layers,
            embed_dim=config.vision_dim,
            hidden_size=config.dim,
            num_heads=config.vision_heads,
            mlp_ratio=vision_ffn_dim(config) // config.vision_dim,
            patch_size=config.patch_size,
            spatial_merge_size=config.merge_size,
            temporal_patch_size=TEMPORAL_PATCH,
            in_channels=3,
            hidden_act="quick_gelu",
        ),
        image_token_id=img,
        video_token_id=(img - 1) % config.vocab_size,
        vision_start_token_id=(img - 2) % config.vocab_size,
        vision_end_token_id=(img - 3) % config.vocab_size,
        tie_word_embeddings=config.tie_embeddings,
    )


def _vision_names(config: ModelConfig) -> dict[str, str]:
    """meshspeed FQN -> Hugging Face name, for the ViT and merger tensors that map one to one."""
    out = {
        "embed.projector.norm.weight": f"{VISION}.merger.ln_q.weight",
        "embed.projector.norm.bias": f"{VISION}.merger.ln_q.bias",
        "embed.projector.w1.weight": f"{VISION}.merger.mlp.0.weight",
        "embed.projector.w1.bias": f"{VISION}.merger.mlp.0.bias",
        "embed.projector.w2.weight": f"{VISION}.merger.mlp.2.weight",
        "embed.projector.w2.bias": f"{VISION}.merger.mlp.2.bias",
    }
    for i in range(config.vision_layers):
        ms, hf = f"embed.vision.layers.{i}", f"{VISION}.blocks.{i}"
        for ours, theirs in (
            ("attention_norm", "norm1"),
            ("ffn_norm", "norm2"),
            ("attention.wo", "attn.proj"),
            ("feed_forward.w1", "mlp.fc1"),
            ("feed_forward.w2", "mlp.fc2"),
        ):
            for p in ("weight", "bias"):
                out[f"{ms}.{ours}.{p}"] = f"{hf}.{theirs}.{p}"
    return out


def _text_tensors(config: ModelConfig) -> dict:
    """The decoder's mapping: the text families' (models/hf.py), renamed for Qwen2-VL's nesting."""
    out = {}
    for fqn, src in hf_tensors(config).items():
        names = tuple(TEXT + n[len("model") :] if n.startswith("model.") else n for n in src.names)
        key = "embed.tok_embeddings.weight" if fqn == "tok_embeddings.weight" else fqn
        out[key] = type(src)(names, src.head_dim, src.stacked)
    return out


def state_from_hf(hf_state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """A Qwen2VLForConditionalGeneration state dict -> the VLM's (load_state_dict, strict)."""
    missing = []

    def get(name: str) -> torch.Tensor:
        if name not in hf_state:
            missing.append(name)
            return torch.empty(0)
        return hf_state[name]

    out = {fqn: get(name) for fqn, name in _vision_names(config).items()}
    conv = get(f"{VISION}.patch_embed.proj.weight")  # [D, 3, T, p, p]
    if conv.dim() == 5:
        out["embed.vision.patch_embed.weight"] = conv.sum(2).reshape(conv.shape[0], -1)
    d = config.vision_dim
    for i in range(config.vision_layers):
        hf, ms = f"{VISION}.blocks.{i}.attn.qkv", f"embed.vision.layers.{i}.attention"
        for p in ("weight", "bias"):
            for w, part in zip(("wq", "wk", "wv"), get(f"{hf}.{p}").split(d)):
                out[f"{ms}.{w}.{p}"] = part
    for fqn, src in _text_tensors(config).items():
        value = get(src.names[0])
        out[fqn] = to_interleaved(value, src.head_dim) if src.head_dim and value.numel() else value
    if config.tie_embeddings:  # one Parameter under two names in a state dict
        out["output.weight"] = out["embed.tok_embeddings.weight"]
    if missing:
        raise ConfigError(f"the Qwen2-VL state dict lacks {len(missing)} tensors, e.g. {missing[0]}")
    return {k: v.clone() for k, v in out.items()}


def state_to_hf(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """The VLM's full state dict -> a Qwen2VLForConditionalGeneration one (loads strict)."""
    out = {name: state[fqn].contiguous() for fqn, name in _vision_names(config).items()}
    w = state["embed.vision.patch_embed.weight"]  # [D, 3*p*p]
    p = config.patch_size
    tap = (w / TEMPORAL_PATCH).reshape(w.shape[0], 3, 1, p, p)
    out[f"{VISION}.patch_embed.proj.weight"] = tap.expand(-1, -1, TEMPORAL_PATCH, -1, -1).contiguous()
    for i in range(config.vision_layers):
        ms = f"embed.vision.layers.{i}.attention"
        for q in ("weight", "bias"):
            parts = [state[f"{ms}.{w_}.{q}"] for w_ in ("wq", "wk", "wv")]
            out[f"{VISION}.blocks.{i}.attn.qkv.{q}"] = torch.cat(parts).contiguous()
    for fqn, src in _text_tensors(config).items():
        value = state[fqn]
        out[src.names[0]] = (to_rotate_half(value, src.head_dim) if src.head_dim else value).contiguous()
    return out
