"""KV-cached generation against recomputing the whole sequence each step, single device."""

from __future__ import annotations

import pytest
import torch

from meshspeed.infer import KVCache, SamplingConfig, generate, left_pad
from meshspeed.infer.cache import installed
from meshspeed.infer.generate import choose
from meshspeed.models import build_model, get_preset

SMALL = dict(dim=48, n_layers=2, n_heads=6, n_kv_heads=2, vocab_size=64, ffn_hidden=64, max_seq_len=32)
PROMPTS = [[5, 9, 2], [7, 1, 4, 4, 8, 3, 11], [30], [12, 13, 14, 15, 16]]  # different lengths


def model(family_overrides=None):
    torch.manual_seed(0)
    return build_model(get_preset("tiny", **{**SMALL, **(family_overrides or {})}), seed=3).eval()


def recompute_greedy(m, prompt: list[int], n: int) -> list[int]:
    """The oracle: no cache, no padding; the whole sequence through the model every step."""
    seq = list(prompt)
    for _ in range(n):
        with torch.no_grad():
            logits = m(torch.tensor([seq]))[0, -1]
        seq.append(int(logits.argmax()))
    return seq[len(prompt) :]


def test_cached_logits_equal_recompute():
    m = model()
    tokens, valid = left_pad(PROMPTS)
    cache = KVCache(valid[:, :0])
    steps = [[3, 6, 9, 12], [1, 2, 3, 4], [60, 61, 62, 63]]  # forced next tokens, one per step
    with torch.no_grad(), installed(m, cache):
        cache.append(valid)
        got = [m(tokens, cache.positions(tokens.shape[1]))[:, -1]]
        for s in steps:
            cache.append(torch.ones(len(PROMPTS), 1, dtype=torch.bool))
            got.append(m(torch.tensor(s)[:, None], cache.positions(1))[:, -1])
    for i, p in enumerate(PROMPTS):
        seq = p + [s[i] for s in steps]
        with torch.no_grad():
            ref = m(torch.tensor([seq]))[0]  # [seq, vocab]
        for j, g in enumerate(got):
            torch.testing.assert_close(g[i], ref[len(p) - 1 + j], rtol=1e-5, atol=1e-5)
    # The cores come back after the context: a plain forward is the training forward again.
    assert all(
        a.core.__name__ == "attention_core" for a in (m.layers["0"].attention, m.layers["1"].attention)
    )


@pytest.mark.parametrize("family", [None, {"family": "qwen2"}])
def test_greedy_batch_equals_recompute(family):
    m = model(family)
    out = generate(m, PROMPTS, max_new_tokens=6)
    assert out == [recompute_greedy(m, p, 6) for p in PROMPTS]


def test_eos_stops_each_sequence():
    m = model()
    full = generate(m, PROMPTS, max_new_tokens=6)
    eos = full[1][2]  # the third token of prompt 1: it ends there, the others where eos first shows
    out = generate(m, PROMPTS, max_new_tokens=6, eos_id=eos)
    for f, o in zip(full, out, strict=True):
        cut = f.index(eos) + 1 if eos in f else len(f)
        assert o == f[:cut]
    assert len(out[1]) <= 3


def test_sampled_seed_reproducible_and_split_independent():
    m = model()
    s = SamplingConfig(temperature=0.9, top_k=20, top_p=0.9, seed=7)
    both = generate(m, PROMPTS, max_new_tokens=5, sampling=s)
    assert both == generate(m, PROMPTS, max_new_tokens=5, sampling=s)
    # The prompts split as two replicas would hold them draw the same numbers.
    first = generate(m, PROMPTS[:2], max_new_tokens=5, sampling=s, rows=[0, 1], n_total=4)
    second = generate(m, PROMPTS[2:], max_new_tokens=5, sampling=s, rows=[2, 3], n_total=4)
    assert first + second == both
    other = generate(m, PROMPTS, max_new_tokens=5, sampling=SamplingConfig(temperature=0.9, seed=8))
    assert other != both


def test_choose_respects_top_k_and_top_p():
    logits = torch.randn(200, 50, generator=torch.Generator().manual_seed(1))
    u = torch.rand(200, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    topk = choose(logits, u, SamplingConfig(temperature=1.0, top_k=3))
    allowed = logits.topk(3, dim=-1).indices
    assert (allowed == topk[:, None]).any(-1).all()
    # top_p tiny: only the most likely token survives, i.e. greedy.
    assert torch.equal(choose(logits, u, SamplingConfig(temperature=1.0, top_p=1e-6)), logits.argmax(-1))
    # Inverse CDF: a draw of u lands on the token whose CDF interval holds u.
    p = logits.double().softmax(-1)
    tok = choose(logits, u, SamplingConfig(temperature=1.0))
    cdf = p.cumsum(-1)
    lo = torch.where(tok > 0, cdf.gather(1, (tok - 1).clamp(min=0)[:, None])[:, 0], torch.zeros_like(u))
    hi = cdf.gather(1, tok[:, None])[:, 0]
    assert ((lo <= u * cdf[:, -1]) & (u * cdf[:, -1] <= hi)).all()


def test_bad_settings_are_one_line():
    with pytest.raises(ValueError, match="top_p=1.5"):
        SamplingConfig(top_p=1.5)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        generate(model(), PROMPTS, max_new_tokens=0)
