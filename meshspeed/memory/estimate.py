"""Activation bytes autograd keeps per transformer layer, from the model's shapes.

Derived from what `count_saved` counts for meshspeed's blocks (see tests/memory), per
micro-batch and rank; T = tokens of the micro-batch (batch × seq), e = bytes of the compute
dtype. Float32 statistics (RMSNorm's rsqrt, the attention log-sum-exp) are 4 bytes whatever e.
- RMSNorm: its float32 input (the block input itself when e = 4), the normalised value before
  and after the weight, the rsqrt: T·dim·(4 + 2e) + 4T;
- attention (local heads H, head_dim hd): q after RoPE, k and v repeated to H heads, the
  output: 4·T·H·hd·e + 4·T·H (log-sum-exp); one kv head on the rank (tp ≥ kv heads) is
  repeated as a broadcast view, so k and v keep T·hd·e each: (2H + 2)·T·hd·e + 4·T·H;
  `selective` keeps q, k, v before repeat_kv (kv heads Hk) and the output: T·hd·(2H + 2Hk)·e;
- SwiGLU (local hidden f): w1 x, silu(w1 x), w3 x and the product: 4·T·f·e; `activation`
  keeps only w1 x and w3 x: 2·T·f·e;
- `full`: the block input, T·dim·e.
MoE blocks (`moe_ffn_bytes`) replace the SwiGLU term; tensor parallelism divides heads and
hidden by tp. Under sequence parallelism the norms run on T/tp rows and the column-parallel
projections keep the all-gathered T-row input, one per norm output (wq, wk, wv share one, w1
and w3 the other): 2·T·dim·e per block.
"""

from __future__ import annotations


def layer_activation_bytes(
    *,
    tokens: int,
    dim: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    ffn_hidden: int,
    mode: str = "none",
    tp: int = 1,
    sequence_parallel: bool = False,
    elem: int = 4,
    moe: dict | None = None,
) -> int:
    """Saved bytes of one block for one micro-batch of `tokens` tokens on one tp rank: dense,
    or with `moe` (moe_ffn_bytes's model arguments) an MoE feed-forward."""
    t = tokens
    if mode == "full":
        return (-(-t // tp) if sequence_parallel else t) * dim * elem  # the (sequence-sharded) input
    heads, kv = n_heads // tp, max(1, n_kv_heads // tp)
    f = -(-ffn_hidden // tp)  # torch.chunk piece: the largest
    if sequence_parallel and tp > 1:
        # the norms run on T/tp rows; wq, wk and wv share one all-gathered T-row input, w1 and
        # w3 another (parallel/tensor.py gathers each norm output once)
        rows = -(-t // tp)
        norms = 2 * (rows * dim * (4 + elem) + 4 * rows) + 2 * t * dim * elem
    else:
        norms = 2 * (t * dim * (4 + 2 * elem) + 4 * t)
    if mode == "selective":
        attn = t * head_dim * (2 * heads + 2 * kv) * elem
    else:
        # q, k and v repeated to every head, the output; with one kv head on the rank the
        # repeat is a broadcast view and k, v keep only their own storage
        kv_rep = 1 if kv == 1 else heads
        attn = (2 * heads + 2 * kv_rep) * t * head_dim * elem + 4 * t * heads
    if moe:
        ffn = moe_ffn_bytes(tokens=t, dim=dim, mode=mode, tp=tp, elem=elem, **moe)
    else:
        ffn = (2 if mode in ("activation", "selective") else 4) * t * f * elem
    return norms + attn + ffn


def moe_shape(model) -> dict | None:
    """moe_ffn_bytes's model arguments from a ModelConfig (read by name), None if dense."""
    if not getattr(model, "n_experts", 0):
        return None
    return dict(
        n_experts=model.n_experts,
        top_k=model.top_k,
        hidden=model.moe_ffn_dim,
        shared_hidden=model.n_shared_experts * model.moe_ffn_dim,
        softmax_first=model.router_softmax != "after_topk",
    )


def is_moe_layer(model, i: int) -> bool:
    return bool(getattr(model, "n_experts", 0)) and model.is_moe_layer(i)


def moe_ffn_bytes(
    *,
    tokens: int,
    dim: int,
    n_experts: int,
    top_k: int,
    hidden: int,
    shared_hidden: int = 0,
    softmax_first: bool = False,
    mode: str = "none",
    tp: int = 1,
    elem: int = 4,
) -> int:
    """Saved bytes of one MoE feed-forward (router, routed experts, shared experts) for T tokens
    on one rank, replacing the SwiGLU term of `layer_activation_bytes`. S = T·k routed slots
    (under expert parallelism the slots a rank receives: T·k in expectation, balanced routing).
    - router, float32: the logits and their softmax (aux/z losses), the log-sum-exp, the top-k
      ids (int64) and weights; a softmax before the top-k keeps one more [T, E];
    - routed: the slot order and its inverse (int64), the expert input rows and the weighted
      output rows (S·dim each), and per expert SwiGLU's four [rows, hidden/tp];
    - shared experts: a SwiGLU of width shared_hidden/tp (`activation` recompute halves it;
      the routed experts are not recomputed).
    Under tensor parallelism every rank routes all T tokens and keeps its hidden slice."""
    t, s = tokens, tokens * top_k
    f, fs = -(-hidden // tp), -(-shared_hidden // tp)
    router = t * n_experts * 4 * (3 if softmax_first else 2) + 4 * t + t * top_k * (8 + 4)
    routed = 2 * s * 8 + 2 * s * dim * elem + 4 * s * f * elem
    shared = (2 if mode in ("activation", "selective") else 4) * t * fs * elem
    return router + routed + shared


def head_activation_bytes(
    *,
    tokens: int,
    dim: int,
    vocab: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    elem: int = 4,
    chunked: bool = False,
) -> int:
    """The final RMSNorm, the float32 log-softmax of the (vocab-sharded) logits, the token ids.

    Under sequence parallelism the norm runs on T/tp rows and the output projection keeps its
    gathered T-row input instead of the norm's own output."""
    t = tokens
    if sequence_parallel and tp > 1:
        rows = -(-t // tp)
        norm = rows * dim * (4 + elem) + 4 * rows + t * dim * elem
    else:
        norm = t * dim * (4 + 2 * elem) + 4 * t
    # memory.chunked_loss keeps no logits: the fused head (kernels/linear_ce.py) scores them a
    # chunk at a time in the forward pass and keeps the gradients instead: d hidden, the size of
    # the projection's input it no longer saves (already in `norm`), and d weight, float32 like
    # the parameters it is added to
    vocab_rank = -(-vocab // tp)
    logits = vocab_rank * dim * 4 if chunked else t * vocab_rank * 4
    return norm + logits + 8 * t


def loss_backward_bytes(*, tokens: int, vocab: int, tp: int = 1, chunked: bool = False) -> int:
    """What the loss's backward allocates above the saved activations: the gradient of the
    float32 log-probabilities and log-softmax's input gradient, [tokens, vocab/tp] float32 each,
    alive together (the saved log-softmax output is already in head_activation_bytes). The
    step's peak for a large vocabulary: every layer's activations are still held then. An H200
    run measured the allocator's peak 4.02 GiB over the estimate that left this out, at 4,096
    tokens and a 128,256 vocabulary: 2 x 4,096 x 128,256 x 4 bytes = 3.91 GiB.
    memory.chunked_loss scores a chunk at a time: nothing of the sort is ever whole. At tp > 1
    the vocabulary-parallel loss is taken to hold the same two gradients of its shard (counted
    on the CPU at tp 1 only: tests/memory/test_estimate_counted.py)."""
    if chunked:
        return 0
    return 2 * tokens * -(-vocab // tp) * 4


def model_activation_bytes(
    model,
    *,
    tokens: int,
    mode: str = "none",
    layers: int | None = None,
    n_layers: int | None = None,
    head: bool = True,
    tp: int = 1,
    sequence_parallel: bool = False,
    elem: int = 4,
    chunked: bool = False,
) -> int:
    """Saved bytes of the first `n_layers` blocks (default: all the model's; MoE ones as such)
    plus the head (`chunked`: under memory.chunked_loss), with recompute `mode` in the first
    `layers` of them; `model` is a ModelConfig (read by name)."""
    n = model.n_layers if n_layers is None else n_layers
    chosen = n if layers is None else min(layers, n)
    shape = dict(
        tokens=tokens,
        dim=model.dim,
        n_heads=model.n_heads,
        n_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        ffn_hidden=model.ffn_dim,
        tp=tp,
        sequence_parallel=sequence_parallel,
        elem=elem,
    )
    moe = moe_shape(model)
    total = sum(
        layer_activation_bytes(
            mode=mode if i < chosen else "none", moe=moe if is_moe_layer(model, i) else None, **shape
        )
        for i in range(n)
    )
    if head:
        total += head_activation_bytes(
            tokens=tokens,
            dim=model.dim,
            vocab=model.vocab_size,
            tp=tp,
            sequence_parallel=sequence_parallel,
            elem=elem,
            chunked=chunked,
        )
    return total
