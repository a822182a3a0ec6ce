"""Estimated memory per rank for the run plan (`meshspeed train --dry-run`), in bytes.

What is exact and what is a model:
- parameters: the rank's own parameter count (read off the same meta build the workers do) ×
  the bytes of `train.dtype`;
- gradients: the data-parallel buckets hold one float32 gradient per parameter (whatever the
  compute dtype); ZeRO-2/3 keep only the rank's 1/dp of them after the reduce-scatter;
- optimizer: AdamW's two moments in float32, plus a float32 master copy when training in
  bfloat16 or at ZeRO-1/2 (a float32 run's unsharded parameters, or its ZeRO-3 shard, are the
  master); ZeRO-1/2/3 shard all of it over dp;
- activations: the bytes autograd keeps per transformer layer and micro-batch, derived from the
  model's shapes and the recompute mode (`meshspeed.memory.estimate`, checked against bytes
  counted with saved-tensor hooks in tests/memory/test_estimate.py), attention through a fused
  kernel keeping no s × s score matrix. The last stage adds the final norm and the float32
  log-softmax of its (vocab-sharded) logits. The layers in flight are the pipeline schedule's
  peak number of micro-batches whose forward has run and backward has not (from its
  simulation); recompute applies to the first `memory.recompute_layers` layers of each stage;
- buffers: the sequence-parallel all-gather of one layer's input (tp > 1 with SP), and on the
  last stage the loss's backward (`loss_backward_bytes`: two float32 [tokens, vocab/tp]
  gradients, unless memory.chunked_loss).
Memory features (`_features`): `reuse_fp32_param` takes 2 bytes off each fp32 master weight the
rank holds (all its parameters at zero 0, 1/dp of them at ZeRO-1/2); `offload_optimizer` moves
the optimizer bytes to `host` and counts about two buckets' state in buffers (on the device
during the step); `swap_activations` moves each swapped layer's attention-core tensors
(`meshspeed.memory.swap.attention_swap_bytes`) from activations to `host` and counts two layers'
worth in buffers (the one in backward and the prefetched one; one if only one is swapped).
`host` is pinned host memory, never part of `total` (the device's); `saved` is each feature's
net device saving.
ZeRO-3 keeps 1/dp of the parameters too, and holds gathered at a time the root unit (embedding,
final norm, output) and two blocks (the one running and the prefetched one), counted in buffers;
a block is the rank's parameters less the root's, over n_layers. Under pipeline parallelism the
stage's parameters are gathered for the whole step (Zero3.held): all of them, in buffers.
MoE blocks count their router, routed slots (T·k per rank: balanced routing, also under ep)
and shared experts (`meshspeed.memory.estimate.moe_ffn_bytes`). With `moe.replicate_hot K` each
MoE layer in flight also keeps the expert weights copied onto the rank for its backward (at
most one copy of each of the K hot experts it does not own), and backward holds one layer's
copies' gradients (buffers).
"""

from __future__ import annotations

from meshspeed.memory.estimate import (
    head_activation_bytes,
    is_moe_layer,
    layer_activation_bytes,
    loss_backward_bytes,
    moe_shape,
)
from meshspeed.memory.fp32_reuse import fp32_reuse_saved_bytes
from meshspeed.memory.swap import attention_swap_bytes

BYTES = {"float32": 4, "bfloat16": 2}


def estimate_memory(cfg, model, dims, plan, coords: dict, params: int) -> dict:
    """{params, grads, optimizer, activations, buffers, total} in bytes for one rank (total: the
    device's), plus host (bytes in host memory) and saved ({memory feature: device bytes})."""
    t, p = cfg.train, cfg.parallel
    b = BYTES[t.dtype]
    dp = dims.dp * dims.cp  # ZeRO shards over dp × cp: the trainer's dp_cp group (cp ranks hold other tokens)
    grads = params * 4  # the data-parallel gradient buckets are float32 whatever train.dtype is
    if p.zero >= 2:
        grads = -(-grads // dp)
    # An fp32 master copy, except where the float32 parameters themselves are the master (the
    # bucket at zero 0, its slice at ZeRO-1/2, the rank's shard at ZeRO-3).
    master = 4 if b != 4 else 0
    opt = params * (8 + master)
    if p.zero >= 1:
        opt = -(-opt // dp)
    param_bytes, gathered = params * b, 0
    if p.zero >= 3 and dp > 1:
        root = model.vocab_size * model.dim * (1 if model.tie_embeddings else 2) // dims.tp + model.dim
        block = max(params - root, 0) // max(model.n_layers, 1)
        param_bytes, gathered = -(-param_bytes // dp), (root + 2 * block) * b
        if dims.pp > 1:  # zero3.held(): the stage's parameters stay gathered through the step
            gathered = params * b
    # context parallelism splits each sequence: a rank keeps the activations of its s/cp tokens
    s, mb, h, tp = t.seq_len // dims.cp, t.micro_batch_size, model.dim, dims.tp
    mode = cfg.memory.recompute
    recompute_layers = cfg.memory.recompute_layers or None  # 0: every layer
    swap = (cfg.memory.swap_layers or model.n_layers) if cfg.memory.swap_activations else 0  # per chunk
    shape = dict(
        tokens=s * mb,
        dim=h,
        n_heads=model.n_heads,
        n_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        ffn_hidden=model.ffn_dim,
        tp=tp,
        sequence_parallel=p.sequence_parallel,
        elem=b,
    )

    moe = moe_shape(model)
    copies = hot_copy_bytes(cfg.moe.replicate_hot, model, dims.ep, b)

    def layers_bytes(ids) -> float:
        """Layers `ids` (model layer indices, in order), the first recompute_layers recomputed."""
        chosen = len(ids) if recompute_layers is None else min(recompute_layers, len(ids))
        return sum(
            layer_activation_bytes(
                mode=mode if j < chosen else "none", moe=moe if is_moe_layer(model, i) else None, **shape
            )
            + (copies if is_moe_layer(model, i) else 0)
            for j, i in enumerate(ids)
        )

    pp_rank = coords["pp"]
    mine = [st for st in plan.stages if st["rank"] == pp_rank] if dims.pp > 1 else []
    if mine:
        chunks = len(mine)
        in_flight = plan.peak_microbatches[pp_rank] if plan.peak_microbatches else chunks
        # peak counts chunk-micro-batches: each holds one chunk's layers (their mean)
        acts = in_flight * sum(layers_bytes(st["layers"]) for st in mine) / chunks
        head = any(st["head"] for st in mine)
        swapped = in_flight * sum(min(swap, len(st["layers"])) for st in mine) / chunks
    else:
        acts = layers_bytes(range(model.n_layers))
        head = True
        swapped = min(swap, model.n_layers)
    if head:
        acts += head_activation_bytes(
            tokens=s * mb,
            dim=h,
            vocab=model.vocab_size,
            tp=tp,
            sequence_parallel=p.sequence_parallel,
            elem=b,
            chunked=cfg.memory.chunked_loss,
        )
    held = [i for st in mine for i in st["layers"]] if mine else range(model.n_layers)
    copies *= any(is_moe_layer(model, i) for i in held)  # backward: one layer's copies' gradients
    buffers = (s * mb * h * b if (tp > 1 and p.sequence_parallel) else 0) + gathered + copies
    if head:  # the loss's backward, while every activation is still held
        buffers += loss_backward_bytes(
            tokens=s * mb, vocab=model.vocab_size, tp=tp, chunked=cfg.memory.chunked_loss
        )
    opt, acts, buffers, host, saved = _features(cfg, model, dims, params, opt, acts, buffers, swapped)
    out = {
        "params": int(param_bytes),
        "grads": int(grads),
        "optimizer": int(opt),
        "activations": int(acts),
        "buffers": int(buffers),
    }
    out["total"] = sum(out.values())
    out["host"], out["saved"] = int(host), {k: int(v) for k, v in saved.items()}
    return out


def hot_copy_bytes(k: int, model, ep: int, elem: int) -> int:
    """Expert weights one MoE layer's forward may copy onto a rank under moe.replicate_hot=k
    (parallel/expert_replicate.py): one copy per hot expert the rank does not own, at most."""
    n = getattr(model, "n_experts", 0)
    if not k or not n or ep < 2:
        return 0
    return min(k, n - n // ep) * 3 * model.dim * model.moe_ffn_dim * elem


def _features(cfg, model, dims, params: int, opt, acts, buffers, swapped: float):
    """(optimizer, activations, buffers, host, saved) with the [memory] features applied."""
    m, p, t = cfg.memory, cfg.parallel, cfg.train
    host, saved = 0, {}
    shards = dims.dp * dims.cp  # ZeRO's group: dp × cp
    masters = (params if p.zero == 0 else -(-params // shards)) or 1  # elements of state held
    if m.reuse_fp32_param:  # the masters' high halves are the bf16 parameters themselves
        saved["reuse_fp32_param"] = fp32_reuse_saved_bytes(masters)
        opt -= saved["reuse_fp32_param"]
    if m.offload_optimizer and opt:
        # fp32 gradient buckets of bucket_mb (this rank's 1/dp under ZeRO): two on the device in the step
        per = opt / masters  # state bytes per element
        bucket = int(p.bucket_mb * 2**20) // 4 // (shards if p.zero >= 1 else 1)
        transient = min(opt, 2 * bucket * per)
        host, buffers = host + opt, buffers + transient
        saved["offload_optimizer"] = opt - transient
        opt = 0
    if m.swap_activations and swapped:
        per = attention_swap_bytes(
            tokens=t.seq_len // dims.cp * t.micro_batch_size,
            n_heads=model.n_heads,
            head_dim=model.head_dim,
            tp=dims.tp,
            elem=BYTES[t.dtype],
            n_kv_heads=model.num_kv_heads,
        )
        back = min(2, swapped) * per  # in backward: the core being run and the prefetched one
        host, acts, buffers = host + per * swapped, acts - per * swapped, buffers + back
        saved["swap_activations"] = per * swapped - back
    return opt, acts, buffers, host, saved
