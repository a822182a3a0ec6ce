"""Single-device models (Llama-style dense and MoE, Qwen2), each with its recipe beside it (how it
may be split: meshspeed.comm.recipe), presets, seeded init, counts."""

from .config import ModelConfig, llama_ffn_hidden
from .flops import flops_per_token, matmul_params, param_count
from .init import canonical_name, init_std, init_tensor, init_weights, param_seed
from .layers import FeedForward, RMSNorm, apply_rope, precompute_rope
from .llama import Attention, Transformer, TransformerBlock, cross_entropy_loss, repeat_kv
from .moe import GroupedExperts, MoE, TensorParallelMoE, TopKRouter, grouped_mm_available
from .presets import PRESETS, get_preset, preset_names
from .qwen2 import Qwen2
from .registry import build_model, recipe_for

__all__ = [
    "PRESETS",
    "Attention",
    "FeedForward",
    "GroupedExperts",
    "ModelConfig",
    "MoE",
    "RMSNorm",
    "Qwen2",
    "TensorParallelMoE",
    "TopKRouter",
    "Transformer",
    "TransformerBlock",
    "apply_rope",
    "build_model",
    "canonical_name",
    "cross_entropy_loss",
    "flops_per_token",
    "get_preset",
    "grouped_mm_available",
    "init_std",
    "init_tensor",
    "init_weights",
    "llama_ffn_hidden",
    "matmul_params",
    "param_count",
    "param_seed",
    "precompute_rope",
    "preset_names",
    "recipe_for",
    "repeat_kv",
]
