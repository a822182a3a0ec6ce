"""Vision-language model for ONE device, shaped as Qwen2-VL so its checkpoints map one to one.

    model(tokens [batch, seq], images [batch, 3, H, W] or patches [batch, n_patch, 3*p*p])
        -> logits [batch, seq, vocab]

- ViT encoder (`embed.vision`): a linear patch embedding, pre-norm blocks (LayerNorm, full
  attention with 2D rotary positions over the patch grid, QuickGELU MLP), as Qwen2-VL's.
- Projector (`embed.projector`): LayerNorm, then each merge x merge window of neighbouring patches
  concatenated and sent through a 2-layer GELU MLP into the decoder width (Qwen2-VL's merger).
- Decoder: the Llama family's blocks with Qwen2's q/k/v biases (models/llama.py, qwen2.py),
  reused, under M-RoPE: every rotary frequency follows one of three position axes (time, height,
  width). Text tokens have the same position on all three (so a text-only batch is plain RoPE);
  image tokens take their grid row and column.

The image features replace the token embeddings where tokens == image_token_id, in order: the
k-th placeholder of the batch (row-major over [batch, seq]) receives the k-th merged patch of
the images taken in batch order (Qwen2-VL's masked_scatter, torchtitan's VLM pattern).

The patches run through the ViT in merge-window order (window row-major, then row-major inside
each window) so the merge is a reshape of consecutive patches: Qwen2-VL's processor emits them
in that order, and `patchify` here does the same.

FQNs follow llama.py's conventions (blocks in a ModuleDict keyed by str(index); `embed`, `norm`
and `output` may be None on a pipeline stage). The encoder and projector live inside `embed`,
the pipeline's embedding unit, so the first stage holds them (torchtitan's placement).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshspeed.comm.recipe import EncoderUnit, PipelineUnits, Recipe
from meshspeed.kernels.loss import cross_entropy_loss

from . import llama, qwen2
from .config import ModelConfig
from .init import init_tensor
from .layers import RMSNorm
from .vlm_config import image_tokens, mrope_section, vision_ffn_dim

VISION_ROPE_THETA = 10000.0  # Qwen2-VL's vision rotary base
VISION_NORM_EPS = 1e-6  # Qwen2-VL's LayerNorm eps in the ViT and the merger


def patchify(images: torch.Tensor, patch: int, merge: int) -> torch.Tensor:
    """[batch, C, H, W] -> [batch, n_patch, C*patch*patch] in merge-window order; each patch
    flattened as (channel, row, column), the layout of a Conv2d kernel."""
    b, c, h, w = images.shape
    gh, gw = h // patch, w // patch
    x = images.reshape(b, c, gh // merge, merge, patch, gw // merge, merge, patch)
    # -> [batch, win_row, win_col, row_in_win, col_in_win, C, patch_row, patch_col]
    x = x.permute(0, 2, 5, 3, 6, 1, 4, 7)
    return x.reshape(b, gh * gw, c * patch * patch)


def grid_positions(grid: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column [n_patch] of each patch of a grid x grid image, in merge-window order."""
    rows = torch.arange(grid)[:, None].expand(grid, grid)

    def order(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(grid // merge, merge, grid // merge, merge).permute(0, 2, 1, 3).reshape(-1)

    return order(rows), order(rows.t())


def vision_rope_tables(config: ModelConfig, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n_patch, vision_head_dim] float32 in rotate-half layout: the first quarter of
    the frequencies turns with the patch row, the second with the column, then both repeat (the
    rotate-half pairing of channel i with i + head_dim/2)."""
    hd = config.vision_dim // config.vision_heads
    inv_freq = 1.0 / (VISION_ROPE_THETA ** (torch.arange(0, hd // 2, 2, device=device).float() / (hd // 2)))
    rows, cols = grid_positions(config.image_size // config.patch_size, config.merge_size)
    angles = torch.cat([rows.to(device)[:, None] * inv_freq, cols.to(device)[:, None] * inv_freq], dim=-1)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotate_half_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [batch, n, heads, hd] rotated in float32 (Qwen2-VL's vision rope); cos/sin [n, hd]."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class VisionAttention(nn.Module):
    """Full (non-causal) attention over one image's patches; heads read from the shapes, so a
    tensor-parallel shard of wq/wk/wv runs the same code."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        # q, k, v apart (Qwen2-VL fuses them in one qkv Linear): each then splits over tp by
        # heads with the plain colwise style; the converter cuts the fused tensor in three.
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=True) for _ in range(3))
        self.wo = nn.Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        b, n = q.shape[:2]
        q, k, v = (t.view(b, n, -1, self.head_dim) for t in (q, k, v))  # [batch, n, heads, hd]
        q, k = rotate_half_rope(q, cos, sin), rotate_half_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(b, n, -1))


class VisionMLP(nn.Module):
    """fc1 -> QuickGELU -> fc2 (Qwen2-VL's hidden_act 'quick_gelu')."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.w1(x)
        return self.w2(h * torch.sigmoid(1.702 * h))


class VisionBlock(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        d = config.vision_dim
        self.attention_norm = nn.LayerNorm(d, eps=VISION_NORM_EPS)
        self.attention = VisionAttention(d, config.vision_heads)
        self.ffn_norm = nn.LayerNorm(d, eps=VISION_NORM_EPS)
        self.feed_forward = VisionMLP(d, vision_ffn_dim(config))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class VisionEncoder(nn.Module):
    """patches [batch, n_patch, 3*p*p] (merge-window order) -> [batch, n_patch, vision_dim]."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        # Qwen2-VL's Conv3d over (time, p, p) on a still image is this Linear (its time taps summed).
        self.patch_embed = nn.Linear(3 * config.patch_size**2, config.vision_dim, bias=False)
        self.layers = nn.ModuleDict({str(i): VisionBlock(config) for i in range(config.vision_layers)})
        n, hd = (config.image_size // config.patch_size) ** 2, config.vision_dim // config.vision_heads
        # Non-persistent and left empty on meta, as llama.Transformer's RoPE tables.
        cos, sin = (
            (torch.empty(n, hd) for _ in range(2)) if torch.empty(0).is_meta else vision_rope_tables(config)
        )
        self.register_buffer("rope_cos", cos, persistent=False)  # [n_patch, vision_head_dim]
        self.register_buffer("rope_sin", sin, persistent=False)

    def init_rope(self, device=None) -> None:
        device = self.rope_cos.device if device is None else device
        self.rope_cos, self.rope_sin = vision_rope_tables(self.config, device=device)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        h = self.patch_embed(patches.to(self.patch_embed.weight.dtype))
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)
        return h


class Projector(nn.Module):
    """[batch, n_patch, vision_dim] -> [batch, n_patch / merge^2, dim]: LayerNorm, each window's
    merge^2 consecutive patches concatenated, then Linear-GELU-Linear (Qwen2-VL's PatchMerger)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        wide = config.vision_dim * config.merge_size**2
        self.norm = nn.LayerNorm(config.vision_dim, eps=VISION_NORM_EPS)
        self.w1 = nn.Linear(wide, wide)
        self.w2 = nn.Linear(wide, config.dim)
        self.wide = wide

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x).reshape(x.shape[0], -1, self.wide)
        return self.w2(F.gelu(self.w1(x)))


def scatter_image_features(h: torch.Tensor, is_image: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """h [batch, seq, dim] with row-major placeholder k (is_image [batch, seq]) replaced by
    features.reshape(-1, dim)[k]. A count mismatch is an error, not a silent partial fill."""
    feats = features.reshape(-1, h.shape[-1]).to(h.dtype)
    n = int(is_image.sum())
    if n != feats.shape[0]:
        raise ValueError(
            f"the tokens hold {n} image placeholders but the images give {feats.shape[0]} features; "
            "each image needs exactly image_tokens(config) placeholder tokens"
        )
    return h.masked_scatter(is_image[..., None], feats)


class VisionLanguageEmbedding(nn.Module):
    """The pipeline's embedding unit: token embedding, ViT and projector together, so the first
    stage turns (tokens, images) into the decoder's input [batch, seq, dim]."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.vision = VisionEncoder(config)
        self.projector = Projector(config)

    def image_features(self, images: torch.Tensor) -> torch.Tensor:
        """images [batch, 3, H, W] or patches [batch, n_patch, 3*p*p] -> [batch, n_img_tok, dim]."""
        c = self.config
        if images.dim() == 4:
            if tuple(images.shape[1:]) != (3, c.image_size, c.image_size):
                raise ValueError(
                    f"images have shape {list(images.shape)}; the model takes [batch, 3, "
                    f"{c.image_size}, {c.image_size}] (ModelConfig.image_size)"
                )
            images = patchify(images, c.patch_size, c.merge_size)
        return self.projector(self.vision(images))

    def forward(
        self, tokens: torch.Tensor, images: torch.Tensor | None = None, features: torch.Tensor | None = None
    ) -> torch.Tensor:
        """features: image_features(images) computed before (a decoding loop runs the ViT once)."""
        h = self.tok_embeddings(tokens)
        if features is None and images is not None:
            features = self.image_features(images)
        if features is None:
            return h
        return scatter_image_features(h, tokens == self.config.image_token_id, features)


def mrope_positions(tokens: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """[3, batch, seq] (time, height, width) positions, as Qwen2-VL's get_rope_index: text
    counts up by one on all axes; an image's tokens start at the running position p and take
    (p, p + row, p + col) on its merged grid; the text after it resumes at p + grid side.
    Images are recognised as runs of image_tokens(config) placeholders (any number per row)."""
    n_img = image_tokens(config)
    side = config.image_size // (config.patch_size * config.merge_size)
    is_img = (tokens == config.image_token_id).long()
    before = is_img.cumsum(1) - is_img  # placeholders strictly before each position
    idx = torch.arange(tokens.shape[1], device=tokens.device)
    base = idx - before + (before // n_img) * side  # each whole image advanced `side` positions
    k = before % n_img  # index inside the current image
    rows, cols = (k // side) * is_img, (k % side) * is_img
    return torch.stack([base, base + rows, base + cols])


def mrope_tables(model: VLM, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [batch, seq, head_dim/2]: frequency j at the position of its axis (M-RoPE).
    positions: [3, batch, seq]; or [seq] / [batch, seq] (text only: one axis)."""
    if positions.dim() < 3:
        return model.rope_cos[positions], model.rope_sin[positions]
    axis = model.rope_axis  # [head_dim/2] which of (time, height, width) each frequency follows
    per_freq = positions[axis].permute(1, 2, 0)  # [batch, seq, head_dim/2]
    j = torch.arange(axis.shape[0], device=positions.device)
    return model.rope_cos[per_freq, j], model.rope_sin[per_freq, j]


def _rope_axis(config: ModelConfig, device=None) -> torch.Tensor:
    """Which position axis (0 time, 1 height, 2 width) each rotary frequency follows."""
    axes = [a for a, n in enumerate(mrope_section(config)) for _ in range(n)]
    return torch.tensor(axes, dtype=torch.long, device=device)


class VLM(nn.Module):
    """tokens [batch, seq] (+ images) -> logits [batch, seq, vocab]; hidden states if `output`
    is None; `embed` None: tokens are hidden states [batch, seq, dim] and `positions` is needed."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed: VisionLanguageEmbedding | None = VisionLanguageEmbedding(config)
        self.layers = nn.ModuleDict({str(i): qwen2.Qwen2Block(i, config) for i in range(config.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(config.dim, config.norm_eps)
        self.output: nn.Linear | None = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.tie_weights()
        self.register_buffer("rope_axis", _rope_axis(config), persistent=False)  # [head_dim // 2]
        if torch.empty(0).is_meta:
            cos, sin = (torch.empty(config.max_seq_len, config.head_dim // 2) for _ in range(2))
        else:
            cos, sin = llama.rope_tables(config)
        self.register_buffer("rope_cos", cos, persistent=False)  # [max_seq_len, head_dim // 2]
        self.register_buffer("rope_sin", sin, persistent=False)

    def tie_weights(self) -> None:
        if self.config.tie_embeddings and self.embed is not None and self.output is not None:
            self.output.weight = self.embed.tok_embeddings.weight

    def init_rope(self, device=None) -> None:
        device = self.rope_cos.device if device is None else device
        self.rope_cos, self.rope_sin = llama.rope_tables(self.config, device=device)
        self.rope_axis = _rope_axis(self.config, device)
        if self.embed is not None and self.embed.vision is not None:  # [modules]: may be elsewhere
            self.embed.vision.init_rope(device)

    def forward(
        self,
        tokens: torch.Tensor,
        images: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        features: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """images: [batch, 3, H, W] or [batch, n_patch, 3*p*p]; positions: [3, batch, seq]
        M-RoPE positions (default: from the placeholders in `tokens`); features: the images'
        embed.image_features, when computed before (instead of images)."""
        if positions is None:
            if self.embed is None:
                raise ValueError("a stage without the embedding takes hidden states: pass positions")
            if tokens.shape[1] > self.config.max_seq_len:
                raise ValueError(
                    f"sequence length {tokens.shape[1]} exceeds ModelConfig.max_seq_len="
                    f"{self.config.max_seq_len}; raise max_seq_len or feed shorter sequences"
                )
            positions = mrope_positions(tokens, self.config)
        h = self.embed(tokens, images, features) if self.embed is not None else tokens
        cos, sin = mrope_tables(self, positions)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h

    def aux_loss(self) -> torch.Tensor:
        """Zero: the family has no auxiliary loss (the trainer adds it unconditionally)."""
        return self.rope_cos.new_zeros(())


# --- recipe (read by meshspeed.parallel, which never imports us) -------------------------------


def tp_plan(config: ModelConfig) -> tuple[tuple[str, str], ...]:
    """Llama's plan for the decoder (its embedding under `embed.`) plus Megatron's split of the
    ViT (heads and MLP hidden) and of the projector's hidden layer. ViT LayerNorms stay whole:
    the encoder's activations are replicated over tp; under sequence parallelism everything
    inside `embed` runs as without it (the recipe's sp_split) and the decoder gets its slice."""
    text = [("embed.tok_embeddings" if p == "tok_embeddings" else p, s) for p, s in llama.tp_plan(config)]
    v = "embed.vision.layers.*"
    vision = [
        (f"{v}.attention.wq", "colwise"),
        (f"{v}.attention.wk", "colwise"),
        (f"{v}.attention.wv", "colwise"),
        (f"{v}.attention.wo", "rowwise"),
        (f"{v}.feed_forward.w1", "colwise"),
        (f"{v}.feed_forward.w2", "rowwise"),
        ("embed.projector.w1", "colwise"),
        ("embed.projector.w2", "rowwise"),
    ]
    return tuple(vision + text)


def mrope_args(model: VLM, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What each decoder block takes besides the hidden states: the M-RoPE tables."""
    return mrope_tables(model, positions)


def recipe(config: ModelConfig) -> Recipe:
    def init(fqn: str, shape, seed: int) -> torch.Tensor:
        # A tied output is the embedding's Parameter: same name, same values on any stage.
        if config.tie_embeddings and fqn == "output.weight":
            fqn = "embed.tok_embeddings.weight"
        return init_tensor(fqn, shape, config, seed)

    return Recipe(
        name="vlm",
        build=lambda: VLM(config),
        init=init,
        loss=cross_entropy_loss,
        # stage 0 runs the embedding unit on (tokens, images); the micro-batch also carries the
        # M-RoPE positions [3, micro, seq], which every stage's blocks read (the runtime's
        # micro_positions), since the later stages never see the tokens' placeholders
        pipeline=PipelineUnits(
            embedding="embed",
            layers="layers",
            head=("norm", "output"),
            layer_args=mrope_args,
            inputs=("tokens", "images"),
            embed=lambda model, tokens, images: model.embed(tokens, images),
        ),
        tp_plan=tp_plan(config),
        # the features are scattered into placeholders anywhere in the sequence: under sequence
        # parallelism the embedding unit runs whole and its output is cut to seq/tp (the M-RoPE
        # tables stay whole: the blocks' projections gather the full sequence before attention)
        sp_split="embed",
        tp_divides={
            "n_heads": config.n_heads,
            "n_kv_heads": config.num_kv_heads,
            "vision_heads": config.vision_heads,
        },
        tied=(("output.weight", "embed.tok_embeddings.weight"),) if config.tie_embeddings else (),
        n_layers=config.n_layers,
        hidden_size=config.dim,
        finish=lambda model: model.init_rope(),
        # [modules]: the ViT and projector in a layout of their own, their image features handed
        # to the decoder (parallel/seam.py); the decoder's forward takes them instead of images
        encoder=EncoderUnit(
            prefixes=("embed.vision", "embed.projector"),
            blocks="embed.vision.layers",
            input="images",
            encode=lambda model, images: model.embed.image_features(images),
            decode=lambda model, item, rows: model(item["tokens"], None, item["positions"], rows),
            embed=lambda model, tokens, rows: model.embed(tokens, None, rows),
            row_shape=(image_tokens(config), config.dim),
        ),
    )
