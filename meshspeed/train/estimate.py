"""Estimated memory per rank for the run plan (`meshspeed train --dry-run`), in bytes.

What is exact and what is a model:
- parameters: the rank's own parameter count (read off the same meta build the workers do) ×
  the bytes of `train.dtype`;
- gradients: the data-parallel buckets hold one gradient per parameter in the compute dtype;
  ZeRO-2 keeps only the rank's 1/dp of them after the reduce-scatter;
- optimizer: AdamW's two moments in float32, plus a float32 master copy when training in
  bfloat16; ZeRO-1/2 shard all of it over dp;
- activations: a model. Per transformer layer and micro-batch, Korthikanti et al. (2022, "Reducing
  Activation Recomputation in Large Transformer Models") count s·b·h·34 bytes in 16-bit with
  tensor + sequence parallelism dividing all of it by tp (without sequence parallelism
  s·b·h·(10 + 24/tp)); attention is assumed to run through a fused kernel that keeps no
  s × s score matrix (SDPA's flash / efficient backends). The last stage adds the logits in
  float32 for the cross-entropy. The layers in flight are the pipeline schedule's peak number of
  micro-batches whose forward has run and backward has not (from its simulation);
- buffers: the sequence-parallel all-gather of one layer's input (tp > 1 with SP).
The memory issue's counted estimator replaces the activation model with counted bytes.
"""

from __future__ import annotations

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
    per_layer_16 = s * mb * h * (34 / tp if p.sequence_parallel else 10 + 24 / tp)
    per_layer = per_layer_16 * b / 2
    pp_rank = coords["pp"]
    mine = [st for st in plan.stages if st["rank"] == pp_rank] if dims.pp > 1 else []
    if mine:
        layers = sum(len(st["layers"]) for st in mine)
        chunks = len(mine)
        in_flight = plan.peak_microbatches[pp_rank] if plan.peak_microbatches else chunks
        # peak counts chunk-micro-batches: each holds one chunk's layers
        acts = in_flight * (layers / chunks) * per_layer
        head = any(st["head"] for st in mine)
    else:
        acts = model.n_layers * per_layer
        head = True
    if head:  # logits, upcast to float32 for the cross-entropy, vocab split over tp
        acts += s * mb * model.vocab_size / tp * (b + 4)
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
