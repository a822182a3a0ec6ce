"""RoPE, RMSNorm and GQA attention against independent references."""

import math

import torch

from meshspeed.models import Attention, ModelConfig, RMSNorm, apply_rope, precompute_rope


def complex_rope_reference(x, theta):
    """Meta's Llama reference: pairs of channels as complex numbers times e^{i m w}, in float64."""
    b, s, h, d = x.shape
    freqs = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.outer(torch.arange(s, dtype=torch.float64), freqs)
    freqs_cis = torch.polar(torch.ones_like(angles), angles)  # [seq, d/2] complex128
    xc = torch.view_as_complex(x.double().reshape(b, s, h, d // 2, 2))
    return torch.view_as_real(xc * freqs_cis[None, :, None, :]).flatten(3)


def test_rope_matches_complex_reference():
    torch.manual_seed(0)
    x = torch.randn(2, 40, 3, 16, dtype=torch.float64)
    cos, sin = precompute_rope(16, 64, 10000.0)
    out = apply_rope(x, cos[:40], sin[:40])
    torch.testing.assert_close(out, complex_rope_reference(x, 10000.0), atol=2e-5, rtol=1e-5)
    assert cos.dtype == torch.float32 and cos.shape == (64, 8)


def test_rope_positions_and_relative_invariance():
    torch.manual_seed(1)
    cos, sin = precompute_rope(8, 32, 500.0)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def score(m, n):
        pm, pn = torch.tensor([m]), torch.tensor([n])
        return (apply_rope(q, cos[pm], sin[pm]) * apply_rope(k, cos[pn], sin[pn])).sum()

    # <R_m q, R_n k> depends on m - n only: the point of RoPE.
    torch.testing.assert_close(score(5, 2), score(20, 17))
    assert not torch.allclose(score(5, 2), score(5, 3))
    # Per-sample positions [batch, seq] equal per-sequence ones.
    x = torch.randn(2, 4, 2, 8)
    pos = torch.tensor([[3, 4, 5, 6], [0, 1, 2, 3]])
    out = apply_rope(x, cos[pos], sin[pos])
    torch.testing.assert_close(out[0], apply_rope(x[:1], cos[3:7], sin[3:7])[0])
    torch.testing.assert_close(out[1], apply_rope(x[1:], cos[:4], sin[:4])[0])


def test_rmsnorm_matches_formula():
    torch.manual_seed(2)
    norm = RMSNorm(6, eps=1e-6).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 6, dtype=torch.float64)
    expected = x / torch.sqrt((x**2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    torch.testing.assert_close(norm(x), expected)


def naive_gqa(attn, x, cos, sin):
    """Explicit masked softmax; query head h reads kv head h // (n_heads / n_kv_heads)."""
    b, s, _ = x.shape
    d = attn.head_dim
    q = apply_rope(attn.wq(x).view(b, s, -1, d), cos, sin)
    k = apply_rope(attn.wk(x).view(b, s, -1, d), cos, sin)
    v = attn.wv(x).view(b, s, -1, d)
    n_rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(n_rep, dim=2), v.repeat_interleave(n_rep, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, -1)
    return attn.wo(out)


def test_gqa_attention_matches_naive_reference():
    torch.manual_seed(3)
    config = ModelConfig(dim=48, n_heads=6, n_kv_heads=2, max_seq_len=16)
    attn = Attention(config).double()
    cos, sin = precompute_rope(config.head_dim, 16, config.rope_theta)
    x = torch.randn(2, 10, 48, dtype=torch.float64, requires_grad=True)
    out = attn(x, cos[:10].double(), sin[:10].double())
    ref = naive_gqa(attn, x, cos[:10].double(), sin[:10].double())
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x, attn.wk.weight], g)
    ref_grads = torch.autograd.grad(ref, [x, attn.wk.weight], g)
    for a, r in zip(grads, ref_grads):
        torch.testing.assert_close(a, r)
    # Causality: changing the last token leaves earlier outputs untouched.
    x2 = x.detach().clone()
    x2[:, -1] += 1.0
    out2 = attn(x2, cos[:10].double(), sin[:10].double())
    torch.testing.assert_close(out2[:, :-1], out[:, :-1].detach())
