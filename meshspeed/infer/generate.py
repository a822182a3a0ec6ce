"""Generation with a key/value cache: prefill the left-padded prompts, then one token per step.

Sampling draws its random numbers layout-independently: the uniform number for (prompt i,
step t) is element i of torch.rand(n_prompts) from a CPU generator seeded by (seed, t), so a
replica holding prompts 4..7 under data parallelism, every tensor-parallel rank and every
pipeline stage draw exactly what a single process draws for those prompts.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from meshspeed.infer.cache import KVCache, installed, left_pad

# (tokens [batch, new], positions [batch, new]) -> logits of the last slot [batch, vocab]
Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class SamplingConfig:
    """temperature 0 is greedy (argmax); otherwise softmax(logits / temperature) restricted to
    the top_k tokens (0: all) and the smallest set whose probability reaches top_p (1: all)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not 0 <= self.temperature < math.inf:  # NaN fails this too
            raise ValueError(f"temperature={self.temperature} must be a finite number >= 0 (0 means greedy)")
        if not 0 <= self.seed < 2**63:  # what torch.Generator.manual_seed takes
            raise ValueError(f"seed={self.seed} must be in [0, 2**63)")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 keeps every token)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1] (1 keeps every token)")


@dataclass
class Stats:
    """Tokens and seconds of the prefill (real prompt tokens) and the decode steps."""

    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    extra: dict = field(default_factory=dict)

    def add(self, other: Stats) -> None:
        self.prefill_tokens += other.prefill_tokens
        self.decode_tokens += other.decode_tokens
        self.prefill_s = max(self.prefill_s, other.prefill_s)
        self.decode_s = max(self.decode_s, other.decode_s)

    def line(self) -> str:
        pre = self.prefill_tokens / self.prefill_s if self.prefill_s else 0.0
        dec = self.decode_tokens / self.decode_s if self.decode_s else 0.0
        return (
            f"prefill {self.prefill_tokens} tokens {pre:.1f} tokens/s, "
            f"decode {self.decode_tokens} tokens {dec:.1f} tokens/s"
        )


def uniforms(seed: int, step: int, rows: torch.Tensor, n_total: int) -> torch.Tensor:
    """Uniform [len(rows)] numbers of global prompts `rows` at decode step `step` (see module doc)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.rand(n_total, generator=g, dtype=torch.float64)[rows]


def choose(logits: torch.Tensor, u: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """logits [batch, vocab], u [batch] uniform -> token ids [batch]."""
    if sampling.temperature == 0:
        return logits.argmax(-1)
    logits = logits.double() / sampling.temperature
    if sampling.top_k and sampling.top_k < logits.shape[-1]:
        kth = logits.topk(sampling.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if sampling.top_p < 1:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Keep a token while the mass before it is below top_p: the most likely one always stays.
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    # Inverse CDF in vocabulary order: a pure function of (probs, u), hence of the layout-free u.
    cdf = probs.cumsum(-1)
    target = (u.to(device=cdf.device, dtype=cdf.dtype) * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, target).squeeze(-1).clamp(max=logits.shape[-1] - 1)


def model_step(model: nn.Module) -> Step:
    """A Step over a whole (possibly tensor-parallel) model: full logits on every rank.

    A vocab-parallel output projection (tp) is switched to gather its output, so every tp rank
    picks the same token from the same full logits."""
    out = getattr(model, "output", None)
    if out is not None and hasattr(out, "gather_output"):
        out.gather_output = True

    def step(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return model(tokens, positions)[:, -1].float()

    return step


@torch.no_grad()
def generate(
    model: nn.Module,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    eos_id: int | None = None,
    pad_id: int = 0,
    step: Step | None = None,
    rows: list[int] | None = None,
    n_total: int | None = None,
    stats: Stats | None = None,
) -> list[list[int]]:
    """Generated ids (prompt excluded, up to and including EOS) of each prompt, in order.

    rows / n_total: the global indices of `prompts` among all prompts (data parallelism) so the
    sampled numbers match a single process; default: these are all the prompts.
    step: how logits are made (default model_step(model)); the cache is installed into `model`.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if not prompts:
        return []
    step = step or model_step(model)
    rows_t = torch.tensor(rows if rows is not None else range(len(prompts)), dtype=torch.long)
    n_total = n_total if n_total is not None else len(prompts)
    device = next(model.parameters()).device  # prompts, cache and masks live beside the weights
    tokens, valid = (t.to(device) for t in left_pad(prompts, pad_id))
    stats = stats if stats is not None else Stats()
    cache = KVCache(valid[:, :0], capacity=tokens.shape[1] + max_new_tokens)
    out: list[list[int]] = [[] for _ in prompts]
    done = torch.zeros(len(prompts), dtype=torch.bool)
    with installed(model, cache):
        t0 = time.perf_counter()
        cache.append(valid)
        logits = step(tokens, cache.positions(tokens.shape[1]))
        stats.prefill_tokens += int(valid.sum())
        stats.prefill_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        for t in range(max_new_tokens):
            nxt = choose(logits, uniforms(sampling.seed, t, rows_t, n_total), sampling).cpu()
            for i in (~done).nonzero().flatten().tolist():
                out[i].append(int(nxt[i]))
            if eos_id is not None:
                done |= nxt == eos_id
            if bool(done.all()) or t == max_new_tokens - 1:
                break
            # Finished sequences keep stepping (a batch moves together); their tokens are dropped.
            cache.append(torch.ones(len(prompts), 1, dtype=torch.bool))
            logits = step(nxt[:, None].to(device), cache.positions(1))
        stats.decode_s += time.perf_counter() - t0
    # The first token of each sequence comes from the prefill's logits; the rest from decode steps.
    stats.decode_tokens += sum(len(o) for o in out) - len(out)
    return out
