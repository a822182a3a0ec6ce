"""Named model shapes. The big ones reproduce the published parameter counts exactly
(tests/models/test_presets.py builds them on the meta device and counts)."""

from __future__ import annotations

import dataclasses

from .config import ModelConfig

# Stored as keyword dicts, not instances, so a caller mutating its config cannot change a preset.
# The DiT paper's 256² setting (Peebles & Xie): 32×32×4 latents in 2×2 patches, ImageNet's 1,000
# classes, the checkpoints' learn_sigma outputs; the S/B/XL presets differ only in their size.
DIT_PAPER = dict(
    family="dit",
    image_size=32,
    patch_size=2,
    in_channels=4,
    n_classes=1000,
    learn_sigma=True,
    norm_eps=1e-6,
)

# Qwen2 decoders: their own presets, and the vlm presets' language models (Qwen2-VL's decoder is
# Qwen2's; the vlm presets add the ViT and the merger).
TINY_QWEN2 = dict(
    family="qwen2",
    dim=128,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=256,
    ffn_hidden=384,
    norm_eps=1e-6,
    rope_theta=1e6,
    max_seq_len=256,
)
QWEN2_7B = dict(
    family="qwen2",
    dim=3584,
    n_layers=28,
    n_heads=28,
    n_kv_heads=4,
    vocab_size=152064,
    ffn_hidden=18944,
    norm_eps=1e-6,
    rope_theta=1e6,
    max_seq_len=32768,
)

PRESETS: dict[str, dict] = {
    # Trains in seconds on a laptop CPU: byte vocabulary, ~0.46M parameters.
    "tiny": dict(
        dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_hidden=384, max_seq_len=256
    ),
    # tiny with 4 routed experts (top-2) and one shared expert in every layer.
    "tiny-moe": dict(
        dim=128,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=256,
        ffn_hidden=384,
        max_seq_len=256,
        n_experts=4,
        top_k=2,
        n_shared_experts=1,
        moe_ffn_hidden=128,
    ),
    # ~25M parameters, still the byte vocabulary: a real run on one GPU in minutes.
    "small": dict(
        dim=512, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=256, multiple_of=256, max_seq_len=1024
    ),
    # Meta Llama-3-8B: 8,030,261,248 parameters.
    "llama3-8b": dict(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=1024,
        ffn_dim_multiplier=1.3,
        norm_eps=1e-5,
        rope_theta=500000.0,
        max_seq_len=8192,
    ),
    # Meta Llama-3-70B: 70,553,706,496 parameters.
    "llama3-70b": dict(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=4096,
        ffn_dim_multiplier=1.3,
        norm_eps=1e-5,
        rope_theta=500000.0,
        max_seq_len=8192,
    ),
    # Mistral Mixtral-8x7B: 46,702,792,704 parameters (8 experts, top-2, no shared expert).
    "mixtral-8x7b": dict(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=32000,
        ffn_hidden=14336,
        norm_eps=1e-5,
        rope_theta=1e6,
        max_seq_len=32768,
        n_experts=8,
        top_k=2,
        router_softmax="after_topk",
    ),
    # DeepSeekMoE-16B (fine-grained experts): 16,375,728,128 parameters, ~2.8B active per token.
    # 64 routed experts of width 1408 (top-6, softmax over all, no renormalisation), 2 shared
    # experts fused into one SwiGLU of 2 × 1408, the first layer dense (FFN 10944), MHA 16 heads.
    "deepseek-moe-16b": dict(
        dim=2048,
        n_layers=28,
        n_heads=16,
        n_kv_heads=16,
        vocab_size=102400,
        ffn_hidden=10944,
        norm_eps=1e-6,
        rope_theta=10000.0,
        max_seq_len=4096,
        n_experts=64,
        top_k=6,
        n_shared_experts=2,
        moe_ffn_hidden=1408,
        first_k_dense=1,
        router_softmax="before_topk",
        aux_loss_coef=0.001,
    ),
    # The same layout at tiny size: 16 routed experts (top-4), 2 shared, first layer dense.
    "tiny-fine-moe": dict(
        dim=128,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=256,
        ffn_hidden=384,
        max_seq_len=256,
        n_experts=16,
        top_k=4,
        n_shared_experts=2,
        moe_ffn_hidden=32,
        first_k_dense=1,
        router_softmax="before_topk",
    ),
    # Qwen2 family at tiny size (q/k/v biases, untied embeddings): tests and quick runs.
    "tiny-qwen2": TINY_QWEN2,
    # Qwen2-7B: 7,615,616,512 parameters (28 layers, GQA 28/4, untied 152,064-token vocabulary).
    "qwen2-7b": QWEN2_7B,
    # Vision-language at CPU size (family vlm, Qwen2-VL's shape): 32 x 32 images in 4 x 4
    # patches, merged 2 x 2 into 16 image tokens; learns the built-in shapes captions in minutes.
    "vlm-tiny": dict(
        TINY_QWEN2,
        family="vlm",
        max_seq_len=128,
        image_size=32,
        patch_size=4,
        vision_dim=64,
        vision_layers=2,
        vision_heads=4,
        merge_size=2,
        image_token_id=255,
        # The ViT has no absolute positions (Qwen2-VL's RoPE only): where things are reaches the
        # features only through attention, whose q/k barely move from a 0.02 init. 0.08 measured on
        # 2 CPU cores, 300 steps: digits held-out 19% -> 64%; the shapes' relation word 51% -> 93%.
        init_std=0.08,
    ),
    # Qwen2-VL-7B's shape for dry runs and the planner: the Qwen2-7B decoder, a 32-block ViT of
    # width 1280 (16 heads, patch 14) and the 2 x 2 merger; 448 x 448 images (256 image tokens).
    # 8,290,622,976 parameters: transformers' 8,291,375,616 less the Conv3d's second time tap,
    # which a still image sums into one (interop/hf_vlm.py).
    "qwen2-vl-7b": dict(
        QWEN2_7B,
        family="vlm",
        image_size=448,
        patch_size=14,
        vision_dim=1280,
        vision_layers=32,
        vision_heads=16,
        merge_size=2,
        image_token_id=151655,
    ),
    # --- family dit (diffusion transformers; DiT-*/2 at ImageNet 256: VAE latents 32x32x4) ---
    # 8x8 single-channel digits, 16 image tokens, 10 classes (+ the null class): ~0.8M parameters,
    # trains on a 2-core CPU in minutes (configs/dit-tiny.toml).
    "dit-tiny": dict(
        family="dit",
        dim=96,
        n_layers=4,
        n_heads=4,
        n_kv_heads=4,  # DiT's attention is multi-head (no GQA)
        image_size=8,
        patch_size=2,
        in_channels=1,
        n_classes=10,
    ),
    # The DiT paper's shapes (Peebles & Xie, table 1) with its checkpoints' learn_sigma outputs:
    # 33M, 130M and 675M parameters.
    "dit-s-2": dict(DIT_PAPER, dim=384, n_layers=12, n_heads=6, n_kv_heads=6),
    "dit-b-2": dict(DIT_PAPER, dim=768, n_layers=12, n_heads=12, n_kv_heads=12),
    "dit-xl-2": dict(DIT_PAPER, dim=1152, n_layers=28, n_heads=16, n_kv_heads=16),
    # FLUX.1-dev's size for dry runs and the planner (11.9B parameters; its 19 double- and 38
    # single-stream blocks are not modelled): width 3072 / 24 heads, 1024² images as FLUX packs
    # them (16-channel latents in 2x2 patches: 64 channels at 64x64, patch 1, 4096 tokens), every
    # block cross-attending to T5-XXL tokens (4096 wide); 56 single-stream dit blocks give the
    # parameter count.
    "flux-shape": dict(
        family="dit",
        dim=3072,
        n_layers=56,
        n_heads=24,
        n_kv_heads=24,  # DiT's attention is multi-head (no GQA)
        image_size=64,
        patch_size=1,
        in_channels=64,
        n_classes=0,
        text_dim=4096,
    ),
}


def preset_names() -> list[str]:
    return list(PRESETS)


def get_preset(name: str, **overrides) -> ModelConfig:
    """A fresh ModelConfig for preset `name`, with `overrides` applied (and validated)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid presets: {', '.join(PRESETS)}")
    unknown = sorted(set(overrides) - set(ModelConfig.field_names()))
    if unknown:
        raise ValueError(
            f"unknown ModelConfig field(s) {', '.join(unknown)} overriding preset "
            f"{name!r}; valid fields: {', '.join(ModelConfig.field_names())}"
        )
    return dataclasses.replace(ModelConfig(**PRESETS[name]), **overrides)
