"""Diffusion transformer (DiT, Peebles & Xie 2023) for ONE device, predicting a rectified-flow
velocity: model(x [B, C, H, W], t [B] in [0, 1], y [B] class ids) -> v [B, C_out, H, W].

The block is diffusers' `DiTTransformer2DModel` block (interop/diffusers_dit.py converts both
ways and one forward equals diffusers' within 1e-5):
- patches of p x p pixels through one Linear (diffusers' stride-p Conv2d, flattened), plus fixed
  2D sincos positions (not RoPE: that is what DiT and its checkpoints use);
- conditioning c = MLP(sincos(1000·t)) + class embedding; the class table has a null row
  (id n_classes) for classifier-free guidance;
- N adaLN-Zero blocks: full (non-causal) self-attention and a GELU-tanh MLP on
  LayerNorm(h)·(1 + scale) + shift, each output times a gate; shift/scale/gate come from one
  Linear of silu(c) per block, zero-initialised, so every block starts as the identity;
- optional cross-attention over text tokens [B, T, text_dim] after the self-attention;
- a final adaLN + Linear (zero-initialised: the model outputs 0 at init) and unpatchify.

Timesteps: t = 0 is data and t = 1 noise (x_t = (1 - t)·x0 + t·ε). The embedding sees 1000·t, so
diffusers' DiT given timestep 1000·t computes the same function (its DDPM timesteps run the same
way, 0 clean to 999 noisy); t = 1 maps to 1000, just past DDPM's last step, which the sinusoidal
embedding takes like any other number.

FQNs are the tensor-parallel plan's and the pipeline's: blocks in an nn.ModuleDict keyed by
str(index); x_embedder, t_embedder, y_embedder, blocks, final_layer may be None on a pipeline
stage. Head counts are read from tensor shapes, so a tensor-parallel shard of wq/wk/wv runs
through the same forward.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .dit_config import FREQ_DIM, ffn_dim, grid, out_channels

TIMESTEP_SCALE = 1000.0  # t in [0, 1] -> diffusers' timestep 1000·t (module docstring)


def timestep_embedding(t: torch.Tensor, dim: int = FREQ_DIM, max_period: float = 10000.0) -> torch.Tensor:
    """[B] float -> [B, dim] float32: [cos, sin] of t at frequencies max_period^(-i / (dim/2 - 1)).

    diffusers' `Timesteps(flip_sin_to_cos=True, downscale_freq_shift=1)` in its float32 operations
    (the original DiT divides by dim/2; the diffusers checkpoints are the oracle here)."""
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device)
    freqs = torch.exp(exponent / (half - 1))
    args = t[:, None].float() * freqs[None, :]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def sincos_2d(dim: int, side: int, device=None) -> torch.Tensor:
    """Fixed positions [side*side, dim] float32 for a side x side grid in row-major token order:
    the first dim/2 channels encode the column, the rest the row, each as [sin, cos] at
    frequencies 10000^(-i / (dim/4)) (MAE's / diffusers' get_2d_sincos_pos_embed, in float64)."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float64, device=device) / (dim / 4))
    pos = torch.arange(side, dtype=torch.float64, device=device)
    col, row = pos.repeat(side), pos.repeat_interleave(side)  # token n = row * side + col

    def one(p):
        out = torch.outer(p, omega)
        return torch.cat([out.sin(), out.cos()], dim=1)

    return torch.cat([one(col), one(row)], dim=1).float()


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


def full_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Non-causal attention: q [B, S, heads, hd], k/v [B, T, heads, hd] -> [B, S, heads, hd].
    Every image token sees every other; swappable like the Llama core (context parallelism)."""
    if doc_ids is not None:
        raise ValueError("the dit family attends over whole images; document ids do not apply")
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


class Attention(nn.Module):
    """Multi-head attention with biases (diffusers' attn1/attn2). kv_dim: the width keys and
    values are read from (cross-attention over text tokens); None = self-attention."""

    def __init__(self, dim: int, n_heads: int, kv_dim: int | None = None):
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, dim)
        self.wk = nn.Linear(kv_dim or dim, dim)
        self.wv = nn.Linear(kv_dim or dim, dim)
        self.wo = nn.Linear(dim, dim)
        self.core = full_attention  # data, not code: context parallelism swaps it

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        kv = x if context is None else context
        q, k, v = self.wq(x), self.wk(kv), self.wv(kv)
        # Shapes from the projections: under sequence parallelism x holds seq/tp rows and the
        # column-parallel projections gather the whole sequence.
        b, s = q.shape[:2]
        q = q.view(b, s, -1, self.head_dim)  # [B, S, heads(/tp), hd]
        k = k.view(b, k.shape[1], -1, self.head_dim)
        v = v.view(b, v.shape[1], -1, self.head_dim)
        return self.wo(self.core(q, k, v).reshape(b, s, -1))


class Mlp(nn.Module):
    """fc2(gelu_tanh(fc1 x)): DiT's and diffusers' 'gelu-approximate' feed-forward."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class DiTBlock(nn.Module):
    """adaLN-Zero block. norm1's eps is 1e-6 and norm2's config.norm_eps, as in diffusers (its
    AdaLayerNormZero fixes 1e-6, its norm3 takes norm_eps)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        dim = config.dim
        self.norm1 = nn.LayerNorm(dim, eps=1e-6, elementwise_affine=False)
        self.attention = Attention(dim, config.n_heads)
        self.cross_norm = nn.LayerNorm(dim, eps=1e-6, elementwise_affine=False) if config.text_dim else None
        # not named *attention: context parallelism's pattern must not reach the text attention
        self.cross = Attention(dim, config.n_heads, config.text_dim) if config.text_dim else None
        self.norm2 = nn.LayerNorm(dim, eps=config.norm_eps, elementwise_affine=False)
        self.mlp = Mlp(dim, ffn_dim(config))
        self.modulation = nn.Linear(dim, 6 * dim)  # silu(c) -> shift, scale, gate (x2)

    def forward(self, h: torch.Tensor, c: torch.Tensor, text: torch.Tensor | None = None) -> torch.Tensor:
        """h [B, N(/tp), dim], c [B, dim] (whole on every rank), text [B, T, text_dim] or None."""
        mods = self.modulation(F.silu(c))[:, None]  # [B, 1, 6·dim]: broadcast over tokens
        shift1, scale1, gate1, shift2, scale2, gate2 = mods.chunk(6, dim=-1)
        h = h + gate1 * self.attention(modulate(self.norm1(h), shift1, scale1))
        if self.cross is not None:
            if text is None:
                raise ValueError("this dit has text_dim > 0: pass text tokens [batch, text_len, text_dim]")
            h = h + self.cross(self.cross_norm(h), text)
        return h + gate2 * self.mlp(modulate(self.norm2(h), shift2, scale2))


class PatchEmbed(nn.Module):
    """[B, C, H, W] -> patches through one Linear, plus the fixed positions: [B, N, dim]."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.patch, self.side = config.patch_size, grid(config)
        self.proj = nn.Linear(config.in_channels * self.patch**2, config.dim)
        # Non-persistent: derived from the config (checkpoints neither carry nor reshard it);
        # init_pos() fills it once parameters are real (empty on meta: nothing to compute there).
        pos = (
            torch.empty(self.side**2, config.dim)
            if torch.empty(0).is_meta
            else sincos_2d(config.dim, self.side)
        )
        self.register_buffer("pos", pos, persistent=False)

    def init_pos(self) -> None:
        """(Re)compute the float32 positions on the weights' device (after to_empty or a cast)."""
        self.pos = sincos_2d(self.proj.out_features, self.side, device=self.proj.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, ch, height, width = x.shape
        p, s = self.patch, self.side
        if height != s * p or width != s * p:
            raise ValueError(
                f"image of {height}x{width} pixels; this dit takes {s * p}x{s * p} (ModelConfig.image_size)"
            )
        x = x.reshape(b, ch, s, p, s, p).permute(0, 2, 4, 1, 3, 5)  # [B, rows, cols, C, p, p]
        # to(): under sequence parallelism this module sits outside the tree, so .to() skips pos
        return self.proj(x.reshape(b, s * s, ch * p * p)) + self.pos.to(device=x.device, dtype=x.dtype)


class TimestepEmbedder(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(FREQ_DIM, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        freq = timestep_embedding(t.float() * TIMESTEP_SCALE).to(self.linear_1.weight.dtype)
        return self.linear_2(F.silu(self.linear_1(freq)))


class LabelEmbedder(nn.Module):
    """Class ids [B] -> [B, dim]; id n_classes is the null class (labels dropped for CFG)."""

    def __init__(self, n_classes: int, dim: int):
        super().__init__()
        self.n_classes = n_classes
        self.embedding_table = nn.Embedding(n_classes + 1, dim)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return self.embedding_table(y)


class FinalLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.norm = nn.LayerNorm(config.dim, eps=1e-6, elementwise_affine=False)
        self.modulation = nn.Linear(config.dim, 2 * config.dim)  # silu(c) -> shift, scale
        self.linear = nn.Linear(config.dim, config.patch_size**2 * out_channels(config))

    def forward(self, h: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """[B, N(/tp), dim] -> [B, N, p·p·C_out] (the whole sequence: the plan gathers it)."""
        shift, scale = self.modulation(F.silu(c))[:, None].chunk(2, dim=-1)
        return self.linear(modulate(self.norm(h), shift, scale))


class DiT(nn.Module):
    """x [B, C, H, W], t [B] in [0, 1], y [B] long -> v [B, C_out, H, W] (C_out = C, or 2C with
    learn_sigma: the velocity is the first C channels)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.x_embedder: PatchEmbed | None = PatchEmbed(config)
        self.t_embedder = TimestepEmbedder(config.dim)
        self.y_embedder = LabelEmbedder(config.n_classes, config.dim) if config.n_classes else None
        self.blocks = nn.ModuleDict({str(i): DiTBlock(config) for i in range(config.n_layers)})
        self.final_layer: FinalLayer | None = FinalLayer(config)

    def condition(self, t: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        """c [B, dim]: the timestep embedding plus the class embedding (y may be None only for a
        model without classes)."""
        c = self.t_embedder(t)
        if self.y_embedder is not None:
            if y is None:
                raise ValueError(
                    f"this dit is class-conditional (n_classes={self.config.n_classes}): pass y, "
                    f"with {self.config.n_classes} for the null class"
                )
            c = c + self.y_embedder(y)
        return c

    def aux_loss(self) -> torch.Tensor:
        """Zero: the family has no auxiliary loss (the trainer adds it unconditionally)."""
        return torch.zeros((), device=self.t_embedder.linear_1.weight.device)

    def init_pos(self) -> None:
        if self.x_embedder is not None:
            self.x_embedder.init_pos()

    def unpatchify(self, out: torch.Tensor) -> torch.Tensor:
        """[B, N, p·p·C] (channels last within a patch, diffusers' order) -> [B, C, H, W]."""
        b, p, s = out.shape[0], self.config.patch_size, grid(self.config)
        out = out.reshape(b, s, s, p, p, -1).permute(0, 5, 1, 3, 2, 4)  # [B, C, rows, p, cols, p]
        return out.reshape(b, -1, s * p, s * p)

    def forward(
        self,
        x: torch.Tensor,
        t: torch.Tensor,
        y: torch.Tensor | None = None,
        text: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h, c = self.embed(x, t, y)
        for block in self.blocks.values():
            h = block(h, c, text)
        return h if self.final_layer is None else self.head(h, c)

    # The three pieces a pipeline runs (stage 0, every stage, the last stage): c is made once on
    # stage 0 and travels beside h, as an activation with a gradient (dit_recipe.pack).
    def embed(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None = None):
        """Patch tokens h [B, N(/tp), dim] and the conditioning c [B, dim] (the first stage's work)."""
        h = self.x_embedder(x) if self.x_embedder is not None else x
        return h, self.condition(t, y)

    def head(self, h: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """Final adaLN + Linear + unpatchify: [B, N(/tp), dim] -> [B, C_out, H, W]."""
        return self.unpatchify(self.final_layer(h, c))
