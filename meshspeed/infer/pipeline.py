"""Pipeline-parallel generation: each pp rank holds its stage's layers (the training stage split,
so any checkpoint layout loads into it) and the KV cache of those layers only.

The prompts are cut into micro-batches (as many as stages, fewer when there are fewer prompts).
Each micro-batch has its own cache and moves through the stages on its own, so in steady state
stage s works on micro-batch i while stage s+1 works on micro-batch i-1:

    for each step (the prefill, then one token per step), for each micro-batch i:
        first stage: embed its tokens        other stages: receive its hidden states from s-1
        run this stage's layers (tensor parallel inside, as in training)
        not last: send the hidden states to s+1 (asynchronously; the next micro-batch starts)
        last: logits of the last slot -> the next token, chosen with the layout-independent
              uniforms (generate.uniforms), sent to every other stage

Every stage learns every chosen token, so every rank takes the same decisions (end of sequence,
end of the micro-batch) without a collective over the whole pipeline.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from meshspeed import comm
from meshspeed.comm.algorithms import bounds
from meshspeed.infer.cache import KVCache, installed, left_pad
from meshspeed.infer.generate import SamplingConfig, Stats, choose, uniforms

TAG_HIDDEN, TAG_TOKENS = 71, 72  # p2p tags: activations forward, chosen tokens from the last stage


@dataclass
class _Micro:
    rows: torch.Tensor  # [b] global prompt indices (sampling)
    tokens: torch.Tensor  # [b, n] next input: padded prompts, then the last chosen tokens
    cache: KVCache
    out: list[list[int]]
    done: torch.Tensor  # [b] bool
    finished: bool = False


@torch.no_grad()
def generate_pipeline(
    stages,
    mesh,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    eos_id: int | None = None,
    pad_id: int = 0,
    rows: list[int] | None = None,
    n_total: int | None = None,
    stats: Stats | None = None,
) -> list[list[int]]:
    """Generated ids of each prompt (as generate.generate), on every rank of the pipeline.
    `stages`: this rank's PipelineStages (one chunk: vpp 1)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if not prompts:
        return []
    if len(stages.chunks) != 1:
        raise comm.ConfigError(f"generation runs one model chunk per pipeline rank, not vpp={stages.vpp}")
    chunk, model, pp = stages.chunks[0], stages.model, mesh["pp"]
    first, last, me = chunk.is_first, chunk.is_last, pp.rank
    out_proj = getattr(model, "output", None)
    if out_proj is not None and hasattr(out_proj, "gather_output"):
        out_proj.gather_output = True  # full logits on every tp rank of the last stage
    rows = list(range(len(prompts))) if rows is None else rows
    n_total = len(prompts) if n_total is None else n_total
    stats = stats if stats is not None else Stats()
    dim = model.config.dim  # hidden states between stages: [batch, new, dim]
    dtype = next(model.parameters()).dtype
    offs = bounds(len(prompts), min(pp.size, len(prompts)))
    device = next(model.parameters()).device
    micro = []
    for lo, hi in zip(offs[:-1], offs[1:]):
        tokens, valid = (t.to(device) for t in left_pad(prompts[lo:hi], pad_id))
        cache = KVCache(valid[:, :0], capacity=tokens.shape[1] + max_new_tokens)
        m = _Micro(torch.tensor(rows[lo:hi]), tokens, cache, [[] for _ in range(hi - lo)],
                   torch.zeros(hi - lo, dtype=torch.bool))  # fmt: skip
        m.cache.append(valid)
        micro.append(m)
    stats.prefill_tokens += sum(len(p) for p in prompts)
    sends: list = []
    awaiting: set[int] = set()  # micro-batches whose last chosen tokens are still on their way here

    def apply(m: _Micro, nxt: torch.Tensor, t: int) -> None:
        nxt = nxt.cpu()
        for i in (~m.done).nonzero().flatten().tolist():
            m.out[i].append(int(nxt[i]))
        if eos_id is not None:
            m.done |= nxt == eos_id
        m.finished = bool(m.done.all()) or t == max_new_tokens - 1
        # Finished sequences keep stepping with their micro-batch; their tokens are dropped.
        m.tokens = nxt[:, None].to(device)
        m.cache.append(torch.ones(len(m.out), 1, dtype=torch.bool))

    t0 = time.perf_counter()
    for t in range(max_new_tokens + 1):  # the extra round collects the last tokens
        for k, m in enumerate(micro):
            if k in awaiting:  # received only now: meanwhile this stage ran the other micro-batches
                nxt = torch.empty(len(m.out), dtype=torch.long, device=device)
                apply(m, comm.recv(nxt, pp, pp.size - 1, TAG_TOKENS), t - 1)
                awaiting.discard(k)
            if m.finished or t == max_new_tokens:
                continue
            n = m.tokens.shape[1]
            positions = m.cache.positions(n)
            with installed(model, m.cache):
                if first:
                    h = chunk.embed(m.tokens)
                else:
                    h = torch.empty(len(m.out), n, dim, dtype=dtype, device=device)
                    h = comm.recv(h, pp, me - 1, TAG_HIDDEN)
                h = chunk.body(h, positions)
            if last:
                nxt = choose(h[:, -1].float(), uniforms(sampling.seed, t, m.rows, n_total), sampling)
                sends += [comm.isend(nxt.contiguous(), pp, r, TAG_TOKENS) for r in range(pp.size - 1)]
                apply(m, nxt, t)
            else:
                sends.append(comm.isend(h.contiguous(), pp, me + 1, TAG_HIDDEN))
                awaiting.add(k)
        if t == 0:
            stats.prefill_s += time.perf_counter() - t0  # this stage's share of the prefill
            t0 = time.perf_counter()
        if all(m.finished for m in micro) and not awaiting:
            break
    for h in sends:
        h.wait()
    stats.decode_s += time.perf_counter() - t0
    out = [o for m in micro for o in m.out]
    stats.decode_tokens += sum(len(o) for o in out) - len(out)
    return out
