"""Tensor-parallel overlap (tp_overlap.py) against the plain sequence-parallel layers and the
single-device computation, forward and gradients, at tp 2, 3 and 4 and several chunk counts.

Each rank builds the full layer (or model) from the same seed, computes the reference output
and gradients, then the tensor-parallel layer with and without overlap from the same weights.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import meshspeed.parallel.tp_overlap as tpo
from meshspeed import comm
from meshspeed.comm.placement import full_grad, sharding_of
from meshspeed.models import build_model, cross_entropy_loss, get_preset, recipe_for
from meshspeed.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    model_loss,
    parallelize,
    set_tp_overlap,
)
from meshspeed.parallel.tp_overlap import default_chunks, rows
from tests import harness
from tests.parallel.test_tensor import DENSE, _tokens, close, piece, rnd, seq_piece

# Chunk counts: 1 (nothing to hide: the plain path), 2, 3 (uneven split of a block of 4 or 6
# rows), 5 (more than some blocks' rows: capped) and None (cost model).
CHUNKS = (1, 2, 3, 5, None)


def _check(bad: list, what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if not close(got, want):
        err = (got - want).abs().max().item() if got.shape == want.shape else "shape"
        bad.append(f"{what}: {list(got.shape)} vs {list(want.shape)}, max err {err}")


def _run_column(g, full, x_full, w_out, overlap: bool, chunks):
    col = ColumnParallelLinear(full, g, sequence_parallel=True)
    set_tp_overlap(col, overlap, chunks)
    x = seq_piece(x_full, g).detach().clone().requires_grad_()
    y = col(x)  # [b, seq, out/tp]
    (y * piece(w_out, -1, g)).sum().backward()
    return y.detach(), x.grad, col.weight.grad, col.bias.grad


def _run_row(g, full, x_full, w_out, overlap: bool, chunks):
    row = RowParallelLinear(full, g, sequence_parallel=True)
    set_tp_overlap(row, overlap, chunks)
    x = piece(x_full, -1, g).detach().clone().requires_grad_()
    y = row(x)  # [b, seq/tp, out]
    (y * seq_piece(w_out, g)).sum().backward()
    return y.detach(), x.grad, row.weight.grad, row.bias.grad


def job_layers(ctx) -> list[str]:
    g, bad = ctx.world, []
    n_seq = 12  # divides 2, 3 and 4: blocks of 6, 4 and 3 rows

    # Column: in 7 -> out 10 (uneven pieces at tp 3 and 4), with bias.
    full = nn.Linear(7, 10)
    with torch.no_grad():
        full.weight.copy_(rnd(1, 10, 7)), full.bias.copy_(rnd(2, 10))
    x_full = rnd(3, 2, n_seq, 7).requires_grad_()
    w_out = rnd(4, 2, n_seq, 10)
    (full(x_full) * w_out).sum().backward()
    ref = (piece(full(x_full).detach(), -1, g), seq_piece(x_full.grad, g))
    ref += (piece(full.weight.grad, 0, g), piece(full.bias.grad, 0, g))
    plain = _run_column(g, full, x_full, w_out, False, None)
    for chunks in CHUNKS:
        got = _run_column(g, full, x_full, w_out, True, chunks)
        for what, a, b, c in zip(("out", "x.grad", "weight.grad", "bias.grad"), got, plain, ref):
            _check(bad, f"column K={chunks} {what} vs plain", a, b)
            _check(bad, f"column K={chunks} {what} vs single device", a, c)

    # Row: in 10 (uneven) -> out 7, with bias.
    full = nn.Linear(10, 7)
    with torch.no_grad():
        full.weight.copy_(rnd(5, 7, 10)), full.bias.copy_(rnd(6, 7))
    x_full = rnd(7, 2, n_seq, 10).requires_grad_()
    w_out = rnd(8, 2, n_seq, 7)
    (full(x_full) * w_out).sum().backward()
    ref = (seq_piece(full(x_full).detach(), g), piece(x_full.grad, -1, g))
    ref += (piece(full.weight.grad, 1, g), full.bias.grad)
    plain = _run_row(g, full, x_full, w_out, False, None)
    for chunks in CHUNKS:
        got = _run_row(g, full, x_full, w_out, True, chunks)
        for what, a, b, c in zip(("out", "x.grad", "weight.grad", "bias.grad"), got, plain, ref):
            _check(bad, f"row K={chunks} {what} vs plain", a, b)
            _check(bad, f"row K={chunks} {what} vs single device", a, c)
    return bad


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_overlapped_layers_match_plain_and_single_device(tp):
    assert harness.run(tp, job_layers) == [[]] * tp


def job_model(ctx, chunks) -> list[str]:
    """Whole tiny Llama, tp + SP + overlap: loss and every gradient against the single-device
    model and against the same tp + SP model without overlap."""
    g, bad = ctx.world, []
    config = get_preset("tiny", **DENSE)
    tokens, targets = _tokens(config.vocab_size)
    ref = build_model(config, seed=3)
    ref_loss = cross_entropy_loss(ref(tokens), targets)
    ref_loss.backward()
    mesh = comm.ParallelDims(tp=g.size).build(ctx)
    runs = {}
    for overlap in (False, True):
        model = parallelize(
            build_model(config, seed=3),
            mesh,
            recipe_for(config),
            sequence_parallel=True,
            tp_overlap=overlap,
            tp_overlap_chunks=chunks,
        )
        n_on = sum(1 for m in model.modules() if getattr(m, "tp_overlap", False))
        if overlap and n_on < 7 * config.n_layers:  # wq wk wv wo w1 w2 w3 per layer
            bad.append(f"only {n_on} layers overlapped")
        loss = model_loss(model, tokens, targets, aux=False)
        loss.backward()
        runs[overlap] = (loss.detach(), {n: full_grad(p, {"tp": g}) for n, p in model.named_parameters()})
        shard = {n: sharding_of(p) for n, p in model.named_parameters()}
    (plain_loss, plain_grads), (loss, grads) = runs[False], runs[True]
    _check(bad, "loss vs single device", loss, ref_loss.detach())
    _check(bad, "loss vs plain tp", loss, plain_loss)
    for name, p in ref.named_parameters():
        scale = max(1.0, p.grad.abs().max().item())
        if not close(grads[name], p.grad, atol=1e-6 * scale):
            err = (grads[name] - p.grad).abs().max().item()
            bad.append(f"{name} ({shard[name]}): grad vs single device, err {err}")
        if not close(grads[name], plain_grads[name], atol=1e-6 * scale):
            bad.append(f"{name}: grad vs plain tp")
    return bad


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_overlapped_model_matches_single_device(tp):
    for chunks in (2, None):
        assert harness.run(tp, job_model, chunks) == [[]] * tp, f"chunks={chunks}"


def job_default_chunks(ctx) -> list[int]:
    g, saved = ctx.world, tpo._cores
    try:
        tpo._cores = lambda: 64  # a node with cores to spare for gloo's transfer threads
        # Tiny messages: latency dominates, one chunk; large ones with as much compute: several.
        small, large = default_chunks(g, 1024, 1e3), default_chunks(g, 64 << 20, 2e9)
        tpo._cores = lambda: g.size  # every core already runs a rank: nothing can be hidden
        busy = default_chunks(g, 64 << 20, 2e9)
    finally:
        tpo._cores = saved
    return [small, large, busy]


def test_default_chunks_follow_cost_model():
    small, large, busy = harness.run(2, job_default_chunks)[0]
    assert small == 1
    assert large > 1
    assert busy == 1


def job_auto_k1_is_plain(ctx) -> list:
    """Where the cost model's K is 1 (a busy CPU node), auto runs the plain layers: no chunked
    pipeline (its async collectives and row copies cost without hiding anything). The choice is
    made once per input shape and kept on the layer."""
    g, calls = ctx.world, []
    saved = tpo._ColumnSP.apply, tpo._RowSP.apply, tpo._cores
    tpo._ColumnSP.apply = lambda *a: calls.append("column") or saved[0](*a)  # counted, then run
    tpo._RowSP.apply = lambda *a: calls.append("row") or saved[1](*a)
    try:
        out = []
        for cores in (g.size, 64):  # every core runs a rank / cores to spare (tiny shapes: still 1)
            tpo._cores = lambda c=cores: c
            col = ColumnParallelLinear(nn.Linear(8, 6), g, sequence_parallel=True)
            row = RowParallelLinear(nn.Linear(6, 8), g, sequence_parallel=True)
            set_tp_overlap(col, True, None), set_tp_overlap(row, True, None)
            for _ in range(2):  # the second call reuses the recorded K
                row(col(rnd(1, 2, 2, 8)))  # x [b, seq/tp, in] of a 4-token sequence at tp 2
            out.append((list(col.tp_overlap_auto.values()), list(row.tp_overlap_auto.values())))
        set_tp_overlap(col, True, 2), set_tp_overlap(row, True, 2)  # an explicit K > 1 overlaps
        row(col(rnd(1, 2, 2, 8)))
        return [out, calls]
    finally:
        del tpo._ColumnSP.apply, tpo._RowSP.apply  # back to autograd.Function's own
        tpo._cores = saved[2]


def test_auto_with_k1_runs_the_plain_path():
    out, calls = harness.run(2, job_auto_k1_is_plain)[0]
    assert out == [([1], [1]), ([1], [1])]
    assert calls == ["column", "row"]  # only the explicit K=2 calls went through the pipeline


def test_rows_is_the_all_gather_order():
    # 2 ranks, blocks of 3 rows: chunk [1, 3) of each block, rank-major.
    t = torch.arange(6.0).view(1, 6, 1)
    assert rows(t, 2, 1, 3).flatten().tolist() == [1.0, 2.0, 4.0, 5.0]


def test_bad_chunks_is_one_line_error():
    with pytest.raises(comm.ConfigError, match="tp_overlap_chunks=0"):
        set_tp_overlap(nn.Linear(2, 2), True, 0)


# --- trainer ----------------------------------------------------------------------------------


def test_trainer_losses_with_overlap_equal_single_process(tmp_path):
    from tests.train.test_trainer import job_losses

    want = harness.run(1, job_losses, str(tmp_path / "ref"), [("parallel.tp", "1")], 4)[0]
    extra = [
        ("parallel.tp", "4"),
        ("parallel.sequence_parallel", "true"),
        ("parallel.tp_overlap", "true"),
        ("parallel.tp_overlap_chunks", "2"),
    ]
    got = harness.run(4, job_losses, str(tmp_path / "tp4"), extra, 4)
    assert all(r == got[0] for r in got), "ranks disagree on the loss"
    for step, (g, w) in enumerate(zip(got[0], want)):
        assert abs(g - w) <= 1e-5 * abs(w), f"step {step}: {g} vs single-process {w}"


@pytest.mark.parametrize(
    "extra,needle",
    [
        ([("parallel.tp_overlap", "true")], "parallel.tp_overlap=true overlaps the sequence-parallel"),
        ([("parallel.tp_overlap_chunks", "-1")], "parallel.tp_overlap_chunks=-1 must be ≥ 1"),
    ],
)
def test_bad_overlap_settings_are_one_line_errors(extra, needle):
    from meshspeed.plan import config

    with pytest.raises(comm.ConfigError, match=needle) as err:
        config.validate(config.load(None, extra))
    assert "\n" not in str(err.value)
