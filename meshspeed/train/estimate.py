"""Estimated memory per rank for the run plan (`meshspeed train --dry-run`), in bytes.

What is exact and what is a model:
- parameters: the rank's own parameter count (read off the same meta build the workers do) ×
  the bytes of `train.dtype`;
- gradients: the data-parallel buckets hold one gradient per parameter in the compute dtype;
  ZeRO-2 keeps only the rank's 1/dp of them after the reduce-scatter;
- optimizer: AdamW's two moments in float32, plus a float32 master copy when training in
  bfloat16; ZeRO-1/2 shard all of it over dp;
- activations: the bytes autograd keeps per transformer layer and micro-batch, derived from the
  model's shapes and the recompute mode (`meshspeed.memory.estimate`, checked against bytes
  counted with saved-tensor hooks in tests/memory/test_estimate.py), attention through a fused
  kernel keeping no s × s score matrix. The last stage adds the final norm and the float32
  log-softmax of its (vocab-sharded) logits. The layers in flight are the pipeline schedule's
  peak number of micro-batches whose forward has run and backward has not (from its
  simulation); recompute applies to the first `memory.recompute_layers` layers of each stage;
- buffers: the sequence-parallel all-gather of one layer's input (tp > 1 with SP).
MoE blocks count their router, routed slots (T·k per rank: balanced routing, also under ep)
and shared experts (`meshspeed.memory.estimate.moe_ffn_bytes`).
"""

from __future__ import annotations

from meshspeed.memory.estimate import head_activation_bytes, is_moe_layer, layer_activation_bytes, moe_shape

BYTES = {"float32": 4, "bfloat16": 2}


def estimate_memory(cfg, model, dims, plan, coords: dict, params: int) -> dict:
    """{params, grads, optimizer, activations, buffers, total} in bytes for one rank."""
    t, p = cfg.train, cfg.parallel
    b = BYTES[t.dtype]
    dp = dims.dp
    grads = params * b
    if p.zero >= 2:
        grads = -(-grads // dp)
    opt = params * (8 + (4 if b != 4 else 0))
    if p.zero >= 1:
        opt = -(-opt // dp)
    s, mb, h, tp = t.seq_len, t.micro_batch_size, model.dim, dims.tp
    mode = cfg.memory.recompute
    recompute_layers = cfg.memory.recompute_layers or None  # 0: every layer
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

    def layers_bytes(ids) -> float:
        """Layers `ids` (model layer indices, in order), the first recompute_layers recomputed."""
        chosen = len(ids) if recompute_layers is None else min(recompute_layers, len(ids))
        return sum(
            layer_activation_bytes(
                mode=mode if j < chosen else "none", moe=moe if is_moe_layer(model, i) else None, **shape
            )
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
    else:
        acts = layers_bytes(range(model.n_layers))
        head = True
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
    buffers = s * mb * h * b if (tp > 1 and p.sequence_parallel) else 0
    out = {
        "params": int(params * b),
        "grads": int(grads),
        "optimizer": int(opt),
        "activations": int(acts),
        "buffers": int(buffers),
    }
    out["total"] = sum(out.values())
    return out
