"""`meshspeed.parallelize(..., recompute="full", chunked_loss=True)` on the user's own loop: the
losses and gradient norms of the plain loop of test_parallelize.py equal the same loop on one
process without meshspeed within 1e-5, with tensor + sequence parallelism and with ZeRO-3; every
block really runs again in backward (its attention is called twice a step), and the loss really
comes without logits (`.logits` is None). What these options cannot take is one line."""

from __future__ import annotations

import pytest

from meshspeed import comm
from tests import harness
from tests.interop.test_parallelize import (
    EPS,
    TOL,
    VOCAB,
    batches,
    job_loop,
    needs_hf,
    one_process,
    tiny_llama,
    tiny_net,
)

STEPS = 4


def job_memory(ctx, kind: str, dims: dict, kw: dict):
    """The loop with the options on: (losses, norms, calls of block 0's attention (a custom
    module: its first Linear) per step, the forward's logits given labels)."""
    import torch

    hf = kind != "net"
    model = tiny_llama(kind) if hf else tiny_net()
    calls = []
    probe = model.model.layers[0].self_attn if hf else model.blocks[0].fc1
    probe.register_forward_hook(lambda *_: calls.append(1))
    losses, norms, _ = job_loop(ctx, kind, dims, kw, None, STEPS, model=model)
    per_step, logits = len(calls) / STEPS, None
    if hf:
        x = batches(VOCAB, 1)[0][: 12 // model.meshspeed.dp_size]
        with torch.no_grad():
            logits = model(input_ids=x, labels=x).logits
    return losses, norms, per_step, logits


@needs_hf
@pytest.mark.parametrize(
    "ws, kind, dims, kw",
    [
        pytest.param(2, "llama", dict(tp=2), dict(sequence_parallel=True), id="llama-tp2-sp"),
        pytest.param(2, "qwen2", dict(dp=2), dict(zero=3), id="qwen2-tied-dp2-zero3"),
        pytest.param(3, "net", dict(dp=3), dict(zero=3), id="custom-dp3-zero3"),
    ],
)
def test_recompute_and_chunked_loss_equal_one_process(ws, kind, dims, kw):
    hf = kind != "net"
    kw = {**kw, "recompute": "full", "chunked_loss": hf, "eps": EPS if hf else 1e-8}
    want_losses, want_norms, _, _ = one_process(kind, STEPS, kw["eps"])
    for losses, norms, calls, logits in harness.run(ws, job_memory, kind, dims, kw, timeout=180):
        assert max(abs(a - b) for a, b in zip(losses, want_losses)) < TOL, (losses, want_losses)
        assert max(abs(a - b) for a, b in zip(norms, want_norms)) < TOL, (norms, want_norms)
        assert calls == 2, calls  # forward, and again in backward
        assert logits is None


REFUSED = [  # (model, parallelize keywords, words the one line must hold)
    ("net", dict(recompute="selective"), ("recompute='selective'", "'none', 'full'")),
    ("net", dict(chunked_loss=True), ("chunked_loss=True", "TinyNet", "linear_cross_entropy")),
]


def job_refused(ctx):
    import meshspeed
    from meshspeed.comm.errors import ConfigError

    out = []
    for kind, kw, _ in REFUSED:
        model = tiny_net() if kind == "net" else tiny_llama(kind)
        try:
            meshspeed.parallelize(model, comm.ParallelDims(dp=2).build(ctx), **kw)
            out.append((None, False))
        except ConfigError as e:
            out.append((str(e), not hasattr(model, "meshspeed")))
    return out


def test_options_a_model_cannot_take_are_one_line():
    for rank_result in harness.run(2, job_refused, timeout=120):
        for (msg, untouched), (kind, kw, words) in zip(rank_result, REFUSED):
            assert msg is not None and "\n" not in msg and all(w in msg for w in words), (kw, msg)
            assert untouched, kw


@needs_hf
def test_chunked_loss_holds_less_than_the_logits_it_never_makes():
    """Counted bytes (torch.profiler's memory events), one process: a forward and backward of a
    one-layer Llama whose logits are 2 MiB holds at least 1.5 logits' worth less at its peak
    with chunked_loss (Hugging Face's path keeps the logits, their log-softmax and then their
    gradient)."""
    import torch
    import transformers

    import meshspeed
    from meshspeed.memory.count import cpu_peak_bytes

    ctx = comm.init()
    config = transformers.LlamaConfig(
        vocab_size=2048, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False,
    )  # fmt: skip
    x = torch.randint(0, 2048, (4, 64), generator=torch.Generator().manual_seed(0))
    peak = {}
    for chunked in (False, True):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).float()
        model, opt = meshspeed.parallelize(model, comm.ParallelDims().build(ctx), chunked_loss=chunked)
        model(input_ids=x, labels=x).loss.backward()  # first use: lazily built state is not counted
        opt.zero_grad()
        peak[chunked] = cpu_peak_bytes(lambda: model(input_ids=x, labels=x).loss.backward())
        opt.zero_grad()
    logits = x.numel() * 2048 * 4
    assert peak[False] - peak[True] > 1.5 * logits, (peak, logits)
