"""Building blocks shared by the dense and MoE models: RMSNorm, rotary embeddings, SwiGLU.

RMSNorm (alone and with the residual add before it), FeedForward's SwiGLU and the attention's
RoPE compute through meshspeed.kernels by implementation name: the torch reference ("ref") by
default; `set_kernels(model, pick)` gives each module the implementation `pick` chose for its
shape (train.fused_kernels: kernels.choose times them), `set_fused_kernels` the Triton ones.
"""

from __future__ import annotations

import torch
from torch import nn

from meshspeed.kernels.add_norm import ADD_RMS_NORM
from meshspeed.kernels.fused import RMS_NORM, SWIGLU
from meshspeed.kernels.rope import rope_ref


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, normalised in float32 so bf16 activations keep precision.

    forward(x, residual): h = x + residual first, returns (h, norm(h)) (one fused pass where
    the add_rms_norm implementation chosen is one)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.impl, self.add_impl = "ref", "ref"  # set_kernels

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return RMS_NORM[self.impl](x, self.weight, self.eps)
        return ADD_RMS_NORM[self.add_impl](x, residual, self.weight, self.eps)


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
    [batch, seq, head_dim // 2] (per-sample positions). Computed in float32
    (kernels.rope.rope_ref; the attention rotates q and k together through kernels.rope).
    """
    return rope_ref(x, cos, sin)


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x). w1 = gate, w3 = up, w2 = down (torchtitan names)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.impl = "ref"  # set_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(SWIGLU[self.impl](self.w1(x), self.w3(x)))


def _norms(model: nn.Module) -> list[tuple[nn.Module, int]]:
    """Every RMSNorm with the tensor-parallel degree its rows are split over: a sequence-parallel
    wrapper (parallel.tensor.SequenceParallel) holds it as `inner` and runs it on seq/tp rows."""
    out = [(m, 1) for m in model.modules() if isinstance(m, RMSNorm)]
    wrapped = [m for m in model.modules() if isinstance(getattr(m, "inner", None), RMSNorm)]
    return out + [(m.inner, m.group.size) for m in wrapped]


def set_kernels(model: nn.Module, pick, batch: int, seq: int, dtype: torch.dtype) -> dict[str, int]:
    """Give every kernel site of `model` the implementation `pick(op, shape, dtype)` returns for
    its shape when the model runs on [batch, seq] tokens (seq: this rank's, after context
    parallelism). Sites: RMSNorm (rms_norm, add_rms_norm), FeedForward (swiglu), any module
    with a `rope_impl` attribute (the attention: rope). Returns the sites switched per op."""
    tokens, n = batch * seq, {}

    def count(op):
        n[op] = n.get(op, 0) + 1

    for m, tp in _norms(model):
        shape = (tokens // tp, m.weight.shape[0])
        m.impl, m.add_impl = pick("rms_norm", shape, dtype), pick("add_rms_norm", shape, dtype)
        count("rms_norm")
    for m in model.modules():
        if isinstance(m, FeedForward):  # w1: this rank's columns, the whole sequence
            m.impl = pick("swiglu", (tokens, m.w1.weight.shape[0]), dtype)
            count("swiglu")
        elif hasattr(m, "rope_impl"):
            d = m.head_dim
            shape = (batch, seq, m.wq.weight.shape[0] // d, m.wk.weight.shape[0] // d, d)
            m.rope_impl = pick("rope", shape, dtype)
            count("rope")
    return n


def set_fused_kernels(model: nn.Module, enabled: bool = True) -> int:
    """Switch every RMSNorm (with its residual add) and FeedForward of `model` (tensor-parallel
    or not: the kernels are per token / per element) to the Triton kernels or back, without
    timing them (set_kernels chooses). Returns the modules switched."""
    impl = "triton" if enabled else "ref"
    mods = [m for m, _ in _norms(model)] + [m for m in model.modules() if isinstance(m, FeedForward)]
    for m in mods:
        if isinstance(m, RMSNorm):
            m.impl = m.add_impl = impl
        else:
            m.impl = impl
    return len(mods)
