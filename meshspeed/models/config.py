"""ModelConfig: the shape of a Llama-style dense or mixture-of-experts decoder.

One dataclass covers both: `n_experts == 0` is a dense model, `n_experts > 0` turns the
feed-forward of some layers into a routed MoE. Derived sizes (head_dim, the resolved FFN
width...) are properties, not fields, so `dataclasses.replace(cfg, dim=...)` never leaves a
stale value behind.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from .dit_config import check_dit
from .vlm_config import check_vision

FAMILIES = ("llama", "qwen2", "vlm", "dit")  # models/registry.py maps each to its model file and recipe
ROUTER_SOFTMAX_CHOICES = ("after_topk", "before_topk")
MOE_IMPL_CHOICES = ("auto", "grouped_mm", "loop")
ROPE_SCALING_CHOICES = ("none", "llama3")


MAX_PARAMS = 10**13  # ten trillion: a larger model is a typo, not a plan


def _divisors(n: int, limit: int = 10) -> str:
    """The first divisors of n as '1, 2, 4, ...' for error hints."""
    divs = [d for d in range(1, n + 1) if n % d == 0]
    text = ", ".join(str(d) for d in divs[:limit])
    return text + (", ..." if len(divs) > limit else "")


def llama_ffn_hidden(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """SwiGLU width the way Meta's Llama code derives it.

    2/3 of 4*dim keeps the parameter count of a 4*dim GELU MLP (SwiGLU has three matrices);
    the multiplier and the rounding up to `multiple_of` give 14336 for Llama-3-8B and 28672
    for Llama-3-70B.
    """
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


@dataclass
class ModelConfig:
    """Architecture of a Llama-style decoder, dense or MoE. Validated on construction."""

    family: str = "llama"
    """Model family: 'llama' (Llama / Mistral / Mixtral-style, dense or MoE), 'qwen2'
    (Llama with q/k/v biases), 'vlm' (Qwen2-VL-style: ViT + merger + the qwen2 decoder, see the
    vision fields)."""
    dim: int = 128
    """Model (residual stream) width."""
    n_layers: int = 2
    """Number of transformer blocks."""
    n_heads: int = 4
    """Query heads; must divide `dim`, and dim / n_heads (the head dim) must be even for RoPE."""
    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; must divide `n_heads`. None = n_heads (MHA)."""
    vocab_size: int = 256
    """Vocabulary size (256 = raw bytes)."""
    ffn_hidden: int | None = None
    """Dense SwiGLU width. None = derived from `multiple_of` and `ffn_dim_multiplier` as Llama-3."""
    multiple_of: int = 256
    """Round the derived SwiGLU width up to a multiple of this (ignored when ffn_hidden is set)."""
    ffn_dim_multiplier: float | None = None
    """Scale on the derived SwiGLU width (Llama-3: 1.3). None = no scaling."""
    norm_eps: float = 1e-5
    """Epsilon inside RMSNorm."""
    rope_theta: float = 10000.0
    """RoPE base frequency (Llama-3: 500000, Mixtral: 1e6)."""
    max_seq_len: int = 256
    """Longest sequence the precomputed RoPE tables cover."""
    rope_scaling: str = "none"
    """RoPE frequency scaling: 'none', or 'llama3' (Llama-3.1's: wavelengths longer than
    rope_original_max_seq_len / rope_low_freq_factor are stretched by rope_scaling_factor,
    shorter than ... / rope_high_freq_factor kept, a smooth ramp between)."""
    rope_scaling_factor: float = 8.0
    """'llama3' scaling: how much the long wavelengths are stretched."""
    rope_low_freq_factor: float = 1.0
    """'llama3' scaling: low-frequency bound (see rope_scaling)."""
    rope_high_freq_factor: float = 4.0
    """'llama3' scaling: high-frequency bound (see rope_scaling); > rope_low_freq_factor."""
    rope_original_max_seq_len: int = 8192
    """'llama3' scaling: the context length the model was pre-trained with."""
    tie_embeddings: bool = False
    """Share the output projection with the token embedding."""
    init_std: float = 0.02
    """Std of the normal init of embeddings and linears; output projections (wo, w2) use
    init_std / sqrt(2 * n_layers) as in GPT-2 / Megatron."""

    # --- mixture of experts -------------------------------------------------------------
    n_experts: int = 0
    """Routed experts per MoE layer; 0 = dense model."""
    top_k: int = 2
    """Experts each token is sent to; 1 <= top_k <= n_experts (ignored when dense)."""
    n_shared_experts: int = 0
    """Always-on experts, fused into one SwiGLU of width n_shared_experts * moe_ffn_hidden."""
    moe_ffn_hidden: int | None = None
    """Width of each expert's SwiGLU. None = the dense FFN width."""
    router_softmax: str = "after_topk"
    """'after_topk': softmax over the k chosen logits (Mixtral; weights sum to 1).
    'before_topk': softmax over all experts, then keep the k largest (Switch, DeepSeek-V2)."""
    aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss n_experts * sum_e f_e * P_e in `aux_loss()`."""
    z_loss_coef: float = 0.001
    """Weight of the router z-loss mean(logsumexp(logits)^2) in `aux_loss()` (ST-MoE)."""
    router_bias_rate: float = 0.0
    """> 0: DeepSeek-V3's auxiliary-loss-free balancing. Each router keeps a per-expert bias added
    to the scores for the top-k choice only (the combine weights stay unbiased), and after every
    optimizer step moves it by this rate towards the under-loaded experts
    (`update_routing_bias`). 0: no bias (and no buffer)."""
    moe_every: int = 1
    """Among layers >= first_k_dense, every moe_every-th layer is MoE (1 = all, 2 = alternate)."""
    first_k_dense: int = 0
    """The first this-many layers stay dense (DeepSeek keeps early layers dense)."""
    moe_impl: str = "auto"
    """Expert compute: 'auto' = torch._grouped_mm when torch has it on CUDA bf16 (sm90+) or on the
    CPU (float32/bf16), sizes multiples of 8, else a loop over experts; 'grouped_mm' forces the
    grouped matmul; 'loop' forces the loop."""

    # --- vision (family 'vlm' only: Qwen2-VL's shape; ignored by the text families) -----
    image_size: int = 32
    """'vlm': side of the square input image in pixels; a multiple of patch_size * merge_size.
    'dit': side of the square image (or latent) in pixels; a multiple of patch_size."""
    patch_size: int = 4
    """'vlm': side of one ViT patch in pixels (Qwen2-VL: 14). 'dit': side of one image token
    (DiT-XL/2: 2)."""
    vision_dim: int = 64
    """'vlm': ViT width (Qwen2-VL-7B: 1280)."""
    vision_layers: int = 2
    """'vlm': ViT blocks (Qwen2-VL-7B: 32)."""
    vision_heads: int = 4
    """'vlm': ViT attention heads; vision_dim / vision_heads must be a multiple of 4 (2D RoPE)."""
    vision_ffn_hidden: int | None = None
    """'vlm': ViT MLP width. None = 4 * vision_dim (Qwen2-VL's mlp_ratio 4)."""
    merge_size: int = 2
    """'vlm': the projector merges merge_size x merge_size neighbouring patches into one token."""
    image_token_id: int = 255
    """'vlm': placeholder token replaced by the image features (255: no ASCII byte uses it)."""
    mrope_section: tuple[int, ...] | None = None
    """'vlm': M-RoPE frequencies per axis (time, height, width), summing to head_dim / 2.
    None = Qwen2-VL's proportions (16, 24, 24 at head_dim 128)."""

    # --- image generation (family 'dit' only, with image_size and patch_size above) -------
    in_channels: int = 4
    """'dit': channels of the input image or latent (4: Stable Diffusion's VAE latents)."""
    n_classes: int = 0
    """'dit': class labels (ImageNet: 1000); the table holds one more row, the null class
    (id n_classes) that classifier-free guidance drops labels to. 0 = no class embedding."""
    learn_sigma: bool = False
    """'dit': also predict in_channels variance channels, as DiT and diffusers' checkpoints do
    (rectified flow ignores them; they exist so those checkpoints load)."""
    text_dim: int = 0
    """'dit': width of the text tokens [batch, text_len, text_dim] every block cross-attends to
    (a frozen encoder's output); 0 = no text conditioning."""

    def __post_init__(self) -> None:
        # TOML and CLI overrides arrive as loose types; a bool is an int in Python, so reject it.
        for name in (
            "dim",
            "n_layers",
            "n_heads",
            "vocab_size",
            "multiple_of",
            "max_seq_len",
            "top_k",
            "moe_every",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelConfig.{name}={value!r} is invalid; use an integer >= 1")
        for name in ("n_experts", "n_shared_experts", "first_k_dense"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"ModelConfig.{name}={value!r} is invalid; use an integer >= 0")
        for name in ("n_kv_heads", "ffn_hidden", "moe_ffn_hidden"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"ModelConfig.{name}={value!r} is invalid; use an integer >= 1 or None")
        for name in ("norm_eps", "rope_theta", "init_std"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"ModelConfig.{name}={value!r} is invalid; use a number > 0")
        for name in ("aux_loss_coef", "z_loss_coef", "router_bias_rate"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
                raise ValueError(f"ModelConfig.{name}={value!r} is invalid; use a number >= 0")
        if self.ffn_dim_multiplier is not None and not (
            isinstance(self.ffn_dim_multiplier, (int, float)) and self.ffn_dim_multiplier > 0
        ):
            raise ValueError(
                f"ModelConfig.ffn_dim_multiplier={self.ffn_dim_multiplier!r} is "
                "invalid; use a number > 0 (Llama-3 uses 1.3) or None"
            )
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(
                f"ModelConfig.tie_embeddings={self.tie_embeddings!r} is invalid; use true or false"
            )

        if self.family not in FAMILIES:
            raise ValueError(
                f"ModelConfig.family={self.family!r} is invalid; choose one of {', '.join(FAMILIES)}"
            )
        if self.dim % self.n_heads:
            raise ValueError(
                f"ModelConfig.n_heads={self.n_heads} does not divide dim={self.dim}; "
                f"choose n_heads among {_divisors(self.dim)}"
            )
        if self.head_dim % 2:
            even = [h for h in range(1, self.dim + 1) if self.dim % h == 0 and (self.dim // h) % 2 == 0][:10]
            raise ValueError(
                f"ModelConfig.n_heads={self.n_heads} gives head_dim={self.head_dim} for "
                f"dim={self.dim}, which is odd; RoPE rotates pairs of channels, so choose n_heads "
                f"among {', '.join(map(str, even)) or '(none: make dim even)'}"
            )
        if self.n_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.n_kv_heads={self.n_kv_heads} does not divide n_heads={self.n_heads}; "
                f"choose n_kv_heads among {_divisors(self.n_heads)}"
            )
        if self.router_softmax not in ROUTER_SOFTMAX_CHOICES:
            raise ValueError(
                f"ModelConfig.router_softmax={self.router_softmax!r} is invalid; "
                f"choose one of {', '.join(ROUTER_SOFTMAX_CHOICES)}"
            )
        if self.rope_scaling not in ROPE_SCALING_CHOICES:
            raise ValueError(
                f"ModelConfig.rope_scaling={self.rope_scaling!r} is invalid; "
                f"choose one of {', '.join(ROPE_SCALING_CHOICES)}"
            )
        for name in (
            "rope_scaling_factor",
            "rope_low_freq_factor",
            "rope_high_freq_factor",
            "rope_original_max_seq_len",
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"ModelConfig.{name}={value!r} is invalid; use a number > 0")
        if self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise ValueError(
                f"ModelConfig.rope_high_freq_factor={self.rope_high_freq_factor} must exceed "
                f"rope_low_freq_factor={self.rope_low_freq_factor} (Llama-3.1: 4 and 1)"
            )
        if self.moe_impl not in MOE_IMPL_CHOICES:
            raise ValueError(
                f"ModelConfig.moe_impl={self.moe_impl!r} is invalid; "
                f"choose one of {', '.join(MOE_IMPL_CHOICES)}"
            )
        if self.n_experts > 0:
            if self.top_k > self.n_experts:
                raise ValueError(
                    f"ModelConfig.top_k={self.top_k} exceeds n_experts="
                    f"{self.n_experts}; choose top_k between 1 and {self.n_experts}"
                )
            if self.first_k_dense > self.n_layers:
                raise ValueError(
                    f"ModelConfig.first_k_dense={self.first_k_dense} exceeds n_layers="
                    f"{self.n_layers}; choose 0..{self.n_layers}"
                )
        elif self.n_shared_experts:
            raise ValueError(
                f"ModelConfig.n_shared_experts={self.n_shared_experts} needs routed "
                "experts; set n_experts >= 1 or n_shared_experts=0"
            )
        if self.family == "vlm":
            check_vision(self)
        if self.family == "dit":
            check_dit(self)
        # Plausibility before anything is built or planned (a --dry-run too): past this the
        # sizes are a typo, and the estimate of one would print a plan for 10^18 parameters.
        ffn = self.ffn_dim * max(1, self.n_experts + self.n_shared_experts)
        params = self.vocab_size * self.dim * 2 + self.n_layers * (4 * self.dim**2 + 3 * self.dim * ffn)
        if params > MAX_PARAMS or self.max_seq_len > 1 << 24:
            raise ValueError(
                f"ModelConfig: dim={self.dim}, n_layers={self.n_layers}, vocab_size={self.vocab_size}, "
                f"max_seq_len={self.max_seq_len} describe about {params:.1e} parameters and "
                f"{self.max_seq_len:,}-token sequences, past the {MAX_PARAMS:.0e} and 2^24 meshspeed "
                f"treats as plausible; check the sizes"
            )

    # --- derived sizes ----------------------------------------------------------------
    @property
    def qkv_bias(self) -> bool:
        """Whether the q/k/v projections carry biases (Qwen2)."""
        return self.family in ("qwen2", "vlm")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def num_kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def ffn_dim(self) -> int:
        """Resolved dense SwiGLU width."""
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        return llama_ffn_hidden(self.dim, self.multiple_of, self.ffn_dim_multiplier)

    @property
    def moe_ffn_dim(self) -> int:
        """Resolved per-expert SwiGLU width."""
        return self.ffn_dim if self.moe_ffn_hidden is None else self.moe_ffn_hidden

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0 and any(self.is_moe_layer(i) for i in range(self.n_layers))

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether block `layer_id` (0-based) has a routed MoE feed-forward."""
        if self.n_experts == 0 or layer_id < self.first_k_dense:
            return False
        return (layer_id - self.first_k_dense) % self.moe_every == 0

    @property
    def depth_init_std(self) -> float:
        """Std for projections that write into the residual stream (wo, w2): the residual sum of
        2 * n_layers such outputs then keeps a depth-independent variance (GPT-2)."""
        return self.init_std / math.sqrt(2 * self.n_layers)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
