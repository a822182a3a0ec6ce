"""Analytic parameter and FLOP counts (no model is built), used for presets and MFU."""

from __future__ import annotations

from .config import ModelConfig
from .dit_config import dit_flops_per_sample, dit_macs, dit_params, n_tokens
from .vlm_config import vision_flops_per_image, vision_params


def _attention_params(c: ModelConfig) -> int:
    q_out, kv_out = c.n_heads * c.head_dim, c.num_kv_heads * c.head_dim
    bias = (q_out + 2 * kv_out) if c.qkv_bias else 0
    return c.dim * q_out * 2 + c.dim * kv_out * 2 + bias  # wq, wo, wk, wv (+ q/k/v biases)


def _ffn_params(c: ModelConfig, layer_id: int, active: bool) -> int:
    if not c.is_moe_layer(layer_id):
        return 3 * c.dim * c.ffn_dim
    per_expert = 3 * c.dim * c.moe_ffn_dim
    routed = (c.top_k if active else c.n_experts) * per_expert
    shared = c.n_shared_experts * per_expert
    return routed + shared + c.dim * c.n_experts  # + router gate


def param_count(config: ModelConfig, active: bool = False) -> int:
    """Parameters of the full model. active=True counts only the top_k routed experts of each
    MoE layer: the parameters one token actually uses (Mixtral-8x7B: ~12.9B of 46.7B)."""
    c = config
    if c.family == "dit":
        return dit_params(c)
    total = c.vocab_size * c.dim * (1 if c.tie_embeddings else 2) + c.dim  # embeddings + final norm
    for i in range(c.n_layers):
        total += _attention_params(c) + _ffn_params(c, i, active) + 2 * c.dim  # + 2 norms
    if c.family == "vlm":
        total += vision_params(c)
    return total


def matmul_params(config: ModelConfig) -> int:
    """Active parameters that take part in a matmul per token: every linear layer, the output
    projection included (even when tied), but not the embedding lookup nor norm weights."""
    c = config
    if c.family == "dit":  # per image token, the per-sample conditioning path spread over them
        return dit_macs(c)[0] // n_tokens(c)
    layers = sum(_attention_params(c) + _ffn_params(c, i, active=True) for i in range(c.n_layers))
    return layers + c.vocab_size * c.dim


def flops_per_token(config: ModelConfig, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token: 6 * N + 12 * L * H * Q * T.

    PaLM appendix B / Megatron: 6 FLOPs per matmul parameter per token (2 forward, 4 backward)
    plus the attention score and value matmuls, which grow with the sequence length T. N is the
    active matmul parameter count (`matmul_params`). Like PaLM and torchtitan, the causal mask
    is not discounted, so MFU figures compare with theirs.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} is invalid; use an integer >= 1")
    c = config
    if c.family == "dit":  # seq_len: the image tokens, fixed by the config
        return flops_per_sample(c) // n_tokens(c)
    text = 6 * matmul_params(c) + 12 * c.n_layers * c.n_heads * c.head_dim * seq_len
    if c.family == "vlm":  # one image per sequence: its encoder cost spread over the tokens
        return text + vision_flops_per_image(c) // seq_len
    return text


def flops_per_sample(config: ModelConfig, text_len: int = 0) -> int:
    """Training FLOPs of one image (family 'dit'; text_len: text tokens it cross-attends to),
    for MFU of image models: samples/s x this / peak."""
    if config.family != "dit":
        raise ValueError(f"flops_per_sample counts family 'dit' models; {config.family!r} counts per token")
    return dit_flops_per_sample(config, text_len)
