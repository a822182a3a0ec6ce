"""The run plan's loss-backward term, against bytes the CPU allocator counts.

The loss's backward holds two float32 [tokens, vocab] gradients at once (the log-probabilities'
and log-softmax's input's) on top of every saved activation: with a large vocabulary that is the
step's peak. An H200 run found the plan 4.02 GiB under the measured peak without it (4,096
tokens, vocabulary 128,256). Here the bytes backward allocates over what was live before it,
read from torch.profiler's memory events (memory.cpu_peak_bytes), are compared with
memory.estimate.loss_backward_bytes."""

from __future__ import annotations

import pytest
import torch

from meshspeed.kernels.loss import cross_entropy_loss
from meshspeed.memory import cpu_peak_bytes
from meshspeed.memory.estimate import loss_backward_bytes


@pytest.mark.parametrize("tokens,vocab", [(256, 1024), (512, 4096)])
def test_the_loss_backward_holds_two_float32_logit_gradients(tokens, vocab):
    dim = 8  # small beside the vocabulary: the hidden's and the weight's gradients are noise
    g = torch.Generator().manual_seed(0)
    h = torch.randn(1, tokens, dim, generator=g, requires_grad=True)
    w = torch.randn(vocab, dim, generator=g, requires_grad=True)
    y = torch.randint(0, vocab, (1, tokens), generator=g)
    loss = cross_entropy_loss(h @ w.t(), y)  # the forward's log-softmax output is saved
    measured = cpu_peak_bytes(loss.backward)
    predicted = loss_backward_bytes(tokens=tokens, vocab=vocab)
    small = (tokens + vocab) * dim * 4 * 2  # the hidden's and the weight's gradients, and a matmul temp
    assert predicted <= measured <= predicted + small, (measured, predicted)


def test_chunked_loss_has_no_whole_logit_gradient():
    assert loss_backward_bytes(tokens=4096, vocab=128256, chunked=True) == 0
    assert loss_backward_bytes(tokens=4096, vocab=128256, tp=2) == 4096 * 64128 * 4 * 2
