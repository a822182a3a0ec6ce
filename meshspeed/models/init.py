"""Seeded parameter init that does not depend on the parallel layout.

Each parameter draws from its own CPU torch.Generator seeded by (seed, fully-qualified name).
So its values depend on neither construction order, nor which layers this pipeline stage
holds, nor the device, nor the parameter dtype; a tensor-parallel or expert-parallel shard
takes `init_tensor(name, full_shape, ...)` and slices it.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from .config import ModelConfig

# FQN components inserted by wrappers (torch.compile, activation checkpointing, FSDP1); they are
# dropped so a wrapped model initialises exactly like the bare one.
_WRAPPER_PARTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


def canonical_name(name: str, config: ModelConfig | None = None) -> str:
    """The FQN used for seeding: wrapper components removed, a tied output named as the embedding
    (so a last pipeline stage holding only `output` gets the same values as stage 0's embedding)."""
    name = ".".join(p for p in name.split(".") if p not in _WRAPPER_PARTS)
    if config is not None and config.tie_embeddings and name == "output.weight":
        return "tok_embeddings.weight"
    return name


def param_seed(seed: int, name: str) -> int:
    """Stable 63-bit seed from (seed, name). blake2b, not hash(): Python salts str hashes per
    process, and a 64-bit digest makes collisions between thousands of names negligible."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def init_std(name: str, config: ModelConfig) -> float | None:
    """Std of the normal init for parameter `name`; None means ones (RMSNorm weights), 0.0
    zeros (biases, as in Hugging Face's and Megatron's inits)."""
    parts = canonical_name(name).split(".")
    if parts[-1] == "bias":
        return 0.0
    owner = parts[-2] if parts[-1] == "weight" and len(parts) > 1 else parts[-1]
    if owner.endswith("norm"):
        return None
    # wo and w2 (dense, expert or shared) write into the residual stream: depth-scaled.
    if owner in ("wo", "w2"):
        return config.depth_init_std
    return config.init_std


def init_tensor(
    name: str,
    shape: torch.Size | tuple[int, ...],
    config: ModelConfig,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The full (unsharded) initial value of parameter `name`, on the CPU.

    Drawn in float32 whatever `dtype`, so a bf16 model holds the rounded fp32 init.
    """
    std = init_std(name, config)
    if std is None:
        return torch.ones(shape, dtype=dtype)
    if std == 0.0:
        return torch.zeros(shape, dtype=dtype)
    gen = torch.Generator(device="cpu").manual_seed(param_seed(seed, canonical_name(name, config)))
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=gen).to(dtype)


@torch.no_grad()
def init_weights(model: nn.Module, seed: int = 0, config: ModelConfig | None = None) -> None:
    """Initialise every parameter of `model` (a Transformer or a stage of one) from `seed`,
    and recompute the RoPE tables."""
    config = config if config is not None else model.config
    for m in model.modules():
        if hasattr(m, "tie_weights"):
            m.tie_weights()  # to_empty() unties; re-tie before drawing so both names share values
    for name, p in model.named_parameters():  # a tied weight is listed (and drawn) once
        if p.is_meta:
            raise ValueError(
                f"parameter {name} is on the meta device; call "
                "model.to_empty(device=...) before init_weights (or use build_model)"
            )
        p.copy_(init_tensor(name, p.shape, config, seed))
    for m in model.modules():
        if hasattr(m, "init_rope"):
            m.init_rope()
