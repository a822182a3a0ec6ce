"""Building blocks shared by the dense and MoE models: RMSNorm, rotary embeddings, SwiGLU.

RMSNorm and FeedForward compute through meshspeed.kernels: the torch reference by default, the
fused Triton kernels once `set_fused_kernels(model)` switched them (train.fused_kernels).
"""

from __future__ import annotations

import torch
from torch import nn

from meshspeed.kernels.fused import rms_norm_fused, rms_norm_ref, swiglu_fused, swiglu_ref


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, normalised in float32 so bf16 activations keep precision."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.fused = False  # set_fused_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (rms_norm_fused if self.fused else rms_norm_ref)(x, self.weight, self.eps)


def precompute_rope(
    head_dim: int, max_seq_len: int, theta: float, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each [max_seq_len, head_dim // 2] float32.

    Channel pair i rotates at frequency theta^(-2i / head_dim), computed in float32 exactly as
    Meta's reference so that Llama checkpoints load without a permutation.
    """
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=device)[: head_dim // 2].float() / head_dim)
    )
    t = torch.arange(max_seq_len, device=device).float()
    angles = torch.outer(t, inv_freq)  # [max_seq_len, head_dim // 2]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent channel pairs (2i, 2i+1) of x [batch, seq, heads, head_dim].

    This is Meta's / torchtitan's interleaved layout (x viewed as complex numbers times
    e^{i * angle}), not Hugging Face's rotate-half layout. cos/sin: [seq, head_dim // 2] or
    [batch, seq, head_dim // 2] (per-sample positions). Computed in float32.
    """
    if cos.dim() == 2:
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    else:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    x0, x1 = x.float().unflatten(-1, (-1, 2)).unbind(-1)  # each [batch, seq, heads, head_dim // 2]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x). w1 = gate, w3 = up, w2 = down (torchtitan names)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.fused = False  # set_fused_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2((swiglu_fused if self.fused else swiglu_ref)(self.w1(x), self.w3(x)))


def set_fused_kernels(model: nn.Module, enabled: bool = True) -> int:
    """Switch every RMSNorm and FeedForward of `model` (tensor-parallel or not: the kernels are
    per token / per element) to the fused Triton kernels or back. Returns the modules switched."""
    mods = [m for m in model.modules() if isinstance(m, (RMSNorm, FeedForward))]
    mods += [m.inner for m in model.modules() if isinstance(getattr(m, "inner", None), RMSNorm)]
    for m in mods:
        m.fused = enabled
    return len(mods)
