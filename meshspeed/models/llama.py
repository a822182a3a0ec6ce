"""Llama-style decoder for ONE device: GQA attention with RoPE, SwiGLU or MoE feed-forward.

Parallelism is applied from outside by module FQN (torchtitan names: `layers.<i>.attention.wq`,
`layers.<i>.feed_forward.w1`, `tok_embeddings`, `norm`, `output`, ...). Two conventions make that
possible and must survive edits:
- layers live in an nn.ModuleDict keyed by str(index), so a pipeline stage can delete layers and
  the remaining FQNs (and hence checkpoints and the seeded init) stay the same;
- `tok_embeddings`, `norm` and `output` may be set to None: a middle pipeline stage then takes
  and returns hidden states [batch, seq, dim].
Head counts are read from tensor shapes, never from the config, so a tensor-parallel shard of
wq/wk/wv (fewer local heads) runs through the same forward.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from meshspeed.comm.recipe import PipelineUnits, Recipe
from meshspeed.kernels.loss import cross_entropy_loss
from meshspeed.kernels.rope import ROPE_QK

from .config import ModelConfig
from .init import init_tensor
from .layers import FeedForward, RMSNorm, precompute_rope
from .moe import MOE_TP_STYLE, MoE


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[batch, seq, kv_heads, head_dim] -> [batch, seq, kv_heads * n_rep, head_dim].

    Query head h uses kv head h // n_rep. An explicit expand (not SDPA's enable_gqa) works
    with every SDPA backend, the flash kernel included.
    """
    if n_rep == 1:
        return x
    b, s, kv, d = x.shape
    return x[:, :, :, None, :].expand(b, s, kv, n_rep, d).reshape(b, s, kv * n_rep, d)


def rope_tables(
    config: ModelConfig, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_seq_len, head_dim // 2] float32 for `config`, its rope_scaling included.

    Unscaled configs take precompute_rope's tables unchanged. 'llama3' rescales the inverse
    frequencies exactly as Meta's Llama-3.1 code (and transformers' `llama3` rope type) does, in
    the same float32 operations, so imported Llama-3.1 checkpoints reproduce their logits.
    """
    if config.rope_scaling == "none":
        return precompute_rope(config.head_dim, config.max_seq_len, config.rope_theta, device=device)
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, device=device)[: d // 2].float() / d))
    factor, low, high = config.rope_scaling_factor, config.rope_low_freq_factor, config.rope_high_freq_factor
    old_len = config.rope_original_max_seq_len
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)  # long waves stretched
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    inv_freq = torch.where(medium, smoothed, scaled)
    angles = torch.outer(torch.arange(config.max_seq_len, device=device).float(), inv_freq)
    return angles.cos(), angles.sin()


def document_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """[batch, seq] document ids -> [batch, 1, seq, seq] bool: causal and inside one document.

    The diagonal is always allowed, so no row is fully masked (SDPA would return NaN)."""
    seq = doc_ids.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=doc_ids.device).tril()
    return (causal & (doc_ids[:, :, None] == doc_ids[:, None, :]))[:, None]


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """[batch, seq] document ids (non-decreasing along seq) -> RoPE positions restarting at 0
    at every document start."""
    idx = torch.arange(doc_ids.shape[1], device=doc_ids.device).expand_as(doc_ids)
    start = torch.ones_like(doc_ids, dtype=torch.bool)
    start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = torch.where(start, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - first


def attention_core(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Single-device causal attention: q [batch, seq, heads, hd], k/v [batch, seq, kv_heads, hd]
    -> [batch, seq, heads, hd]; with doc_ids, attention also stays inside each document."""
    n_rep = q.shape[2] // k.shape[2]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    mask = None if doc_ids is None else document_mask(doc_ids)
    out = F.scaled_dot_product_attention(  # [batch, heads, seq, head_dim]
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=mask is None
    )
    return out.transpose(1, 2)


class Attention(nn.Module):
    """Causal grouped-query self-attention through scaled_dot_product_attention."""

    def __init__(self, config: ModelConfig, qkv_bias: bool = False):
        super().__init__()
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=qkv_bias)
        self.wk = nn.Linear(config.dim, config.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.wv = nn.Linear(config.dim, config.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)
        # The attention core is swappable data, not code: context parallelism replaces it
        # (meshspeed.parallel.context) without this file importing parallel.
        self.core = attention_core
        self.rope_impl = "ref"  # models.layers.set_kernels

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, doc_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """doc_ids: optional [batch, seq] document index of each token (packed sequences)."""
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        # Shapes from the projections, not from x: under sequence parallelism x holds seq/tp rows
        # and the (tensor-parallel) projections gather the full sequence.
        b, s = q.shape[:2]
        q = q.view(b, s, -1, self.head_dim)  # [batch, seq, heads, head_dim]
        k = k.view(b, s, -1, self.head_dim)  # [batch, seq, kv_heads, head_dim]
        v = v.view(b, s, -1, self.head_dim)
        q, k = ROPE_QK[self.rope_impl](q, k, cos, sin)
        out = self.core(q, k, v, doc_ids)  # [batch, seq, heads, head_dim]
        return self.wo(out.reshape(b, s, -1))


class TransformerBlock(nn.Module):
    """Pre-norm block: h = x + attn(norm(x)); out = h + ffn(norm(h)) (the add and the second
    norm in one call: RMSNorm.forward(a, residual) may fuse them)."""

    attention_cls = Attention  # a family varies the attention by subclassing (qwen2.py)

    def __init__(self, layer_id: int, config: ModelConfig):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = self.attention_cls(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.moe_enabled = config.is_moe_layer(layer_id)
        # Same attribute name for dense and MoE so norm/residual FQN patterns do not fork.
        self.feed_forward = MoE(config) if self.moe_enabled else FeedForward(config.dim, config.ffn_dim)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, doc_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        h, y = self.ffn_norm(self.attention(self.attention_norm(x), cos, sin, doc_ids), x)
        return h + self.feed_forward(y)


class Transformer(nn.Module):
    """tokens [batch, seq] -> logits [batch, seq, vocab]; hidden states if `output` is None."""

    block_cls = TransformerBlock

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleDict({str(i): self.block_cls(i, config) for i in range(config.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(config.dim, config.norm_eps)
        self.output: nn.Linear | None = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.tie_weights()
        # Non-persistent: derived from the config, so checkpoints neither carry nor reshard them.
        # init_rope() recomputes them after meta-device construction + to_empty(). On meta they
        # are left empty: arithmetic there runs torch's Python meta kernels, whose first use
        # imports dynamo (2.5 s per process on 2 CPU cores) to compute nothing.
        if torch.empty(0).is_meta:
            cos, sin = (torch.empty(config.max_seq_len, config.head_dim // 2) for _ in range(2))
        else:
            cos, sin = rope_tables(config)
        self.register_buffer("rope_cos", cos, persistent=False)  # [max_seq_len, head_dim // 2]
        self.register_buffer("rope_sin", sin, persistent=False)

    def tie_weights(self) -> None:
        """Make `output` share the embedding Parameter when config.tie_embeddings.

        Called again after to_empty(): materialising a meta model creates new Parameters and
        silently unties them. A pipeline split that puts embedding and output on different
        stages must keep them equal across ranks itself.
        """
        tie = self.config.tie_embeddings
        if tie and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def init_rope(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the float32 RoPE tables, e.g. after to_empty() or a cast to bf16."""
        device = self.rope_cos.device if device is None else device
        cos, sin = rope_tables(self.config, device=device)
        self.rope_cos, self.rope_sin = cos, sin

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """tokens: [batch, seq] ids, or [batch, seq, dim] hidden states when tok_embeddings is None.

        positions: optional RoPE positions, [seq] or [batch, seq] (context parallelism feeds
        non-contiguous ones); default 0..seq-1, or restarting at each document with doc_ids.
        doc_ids: optional [batch, seq] document ids of packed sequences (attention per document).
        """
        if positions is None and doc_ids is not None:
            positions = document_positions(doc_ids)
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if positions is None:
            # The input's length, not h's: sequence parallelism leaves h with seq/tp rows after
            # the embedding. (A middle pipeline stage fed sequence-sharded hidden states must
            # pass `positions`.)
            seq = tokens.shape[1]
            if seq > self.config.max_seq_len:
                raise ValueError(
                    f"sequence length {seq} exceeds ModelConfig.max_seq_len="
                    f"{self.config.max_seq_len}; raise max_seq_len or feed shorter "
                    "sequences"
                )
            cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        else:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        for layer in self.layers.values():
            h = layer(h, cos, sin) if doc_ids is None else layer(h, cos, sin, doc_ids)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h

    def moe_layers(self) -> dict[str, MoE]:
        """FQN -> MoE module for the MoE layers present on this model (or pipeline stage).
        Duck-typed (a router): the expert-parallel layer that replaces an MoE under ep is not a
        subclass (parallel/ never imports models/) but keeps the same losses and statistics."""
        return {
            f"layers.{i}.feed_forward": layer.feed_forward
            for i, layer in self.layers.items()
            if isinstance(layer.feed_forward, MoE) or hasattr(layer.feed_forward, "router")
        }

    def aux_loss(self) -> torch.Tensor:
        """Coefficient-weighted MoE auxiliary losses of the last forward, with gradients.

        A zero scalar for dense models (or before the first forward), so the trainer can always
        write `loss = ce + model.aux_loss()`.
        """
        losses = [aux for m in self.moe_layers().values() if (aux := m.aux_loss()) is not None]
        if not losses:
            return self.rope_cos.new_zeros(())
        return torch.stack(losses).sum()

    def router_stats(self) -> dict[str, torch.Tensor]:
        """FQN -> tokens routed to each expert [n_experts] in the last forward (detached)."""
        return {
            name: m.tokens_per_expert
            for name, m in self.moe_layers().items()
            if m.tokens_per_expert is not None
        }


# --- recipe: how this family may be split (read by meshspeed.parallel, which never imports us) ---


def tp_plan(config: ModelConfig) -> tuple[tuple[str, str], ...]:
    """Megatron's layout: attention heads and FFN hidden split, embedding and output split
    over the vocabulary, norms on the sequence shard under SP, MoE experts' hidden split."""
    plan = [
        ("tok_embeddings", "vocab_embedding"),
        ("layers.*.attention_norm", "sequence_norm"),
        ("layers.*.attention.wq", "colwise"),
        ("layers.*.attention.wk", "colwise"),
        ("layers.*.attention.wv", "colwise"),
        ("layers.*.attention.wo", "rowwise"),
        ("layers.*.ffn_norm", "sequence_norm"),
    ]
    if config.is_moe:  # only then: on a dense model the entry would match FeedForward modules
        plan.append(("layers.*.feed_forward", "moe"))
    plan += [
        ("layers.*.feed_forward.w1", "colwise"),
        ("layers.*.feed_forward.w3", "colwise"),
        ("layers.*.feed_forward.w2", "rowwise"),
        ("norm", "sequence_norm"),
        ("output", "colwise_vocab"),
    ]
    return tuple(plan)


def rope_args(model: Transformer, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What each block takes besides the hidden states: the RoPE tables at `positions`."""
    return model.rope_cos[positions], model.rope_sin[positions]


def moe_aux_loss(modules) -> torch.Tensor | None:
    """Sum of the MoE layers' auxiliary losses (last forward) inside `modules`; None if none."""
    losses = [
        aux
        for mod in modules
        for m in mod.modules()
        if (isinstance(m, MoE) or hasattr(m, "router")) and (aux := m.aux_loss()) is not None
    ]
    return torch.stack(losses).sum() if losses else None


def recipe(config: ModelConfig, model_cls: type = Transformer, name: str = "llama") -> Recipe:
    """The Llama family's recipe (dense and MoE); other Llama-shaped families reuse it with
    their own model class."""
    experts = (
        (
            ("layers.*.feed_forward.experts.w1", 0),
            ("layers.*.feed_forward.experts.w2", 0),
            ("layers.*.feed_forward.experts.w3", 0),
        )
        if config.is_moe
        else ()
    )
    return Recipe(
        name=name,
        build=lambda: model_cls(config),
        init=lambda fqn, shape, seed: init_tensor(fqn, shape, config, seed),
        loss=cross_entropy_loss,
        pipeline=PipelineUnits(
            embedding="tok_embeddings", layers="layers", head=("norm", "output"), layer_args=rope_args
        ),
        tp_plan=tp_plan(config),
        tp_styles={"moe": MOE_TP_STYLE},
        tp_divides={"n_heads": config.n_heads, "n_kv_heads": config.num_kv_heads},
        experts=experts,
        tied=(("output.weight", "tok_embeddings.weight"),) if config.tie_embeddings else (),
        n_layers=config.n_layers,
        hidden_size=config.dim,
        finish=lambda model: model.init_rope(),
        aux_loss=moe_aux_loss,
    )
