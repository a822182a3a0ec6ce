"""Tensor + sequence parallelism against the single-device computation, forward and gradients.

Every rank builds the full single-device model (or layer) from the same seed, computes the
reference loss and gradients, then the tensor-parallel version from the same weights; local
outputs and gradients are compared with the matching piece of the reference (parameters
gathered to full shape with full_grad). The model is also built born sharded (meta device,
split, each piece materialised) and must hold exactly the sliced values.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshspeed import comm
from meshspeed.comm.algorithms import bounds
from meshspeed.comm.placement import chunk_bounds, full_grad, sharding_of
from meshspeed.models import build_model, cross_entropy_loss, get_preset, recipe_for
from meshspeed.parallel.materialize import build_parallel_model
from meshspeed.parallel.tensor import (
    STYLES,
    ColumnParallelLinear,
    RowParallelLinear,
    TensorPlan,
    VocabParallelEmbedding,
    check_tp,
    model_loss,
    parallelize,
    tp_plan,
    vocab_parallel_cross_entropy,
)
from tests import harness

# Heads divide 2, 3 and 4 (GQA with 2 query heads per kv head); the FFN and expert widths
# split unevenly at tp 3 or 4; vocab 256 splits unevenly at tp 3.
DENSE = dict(dim=96, n_layers=2, n_heads=24, n_kv_heads=12, vocab_size=256, ffn_hidden=102, max_seq_len=32)
MOE = dict(
    DENSE, n_experts=4, top_k=2, n_shared_experts=1, moe_ffn_hidden=38, first_k_dense=1, tie_embeddings=True
)
BATCH, SEQ = 2, 24


def rnd(seed: int, *shape, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def piece(x: torch.Tensor, dim: int, g, rank=None) -> torch.Tensor:
    """torch.chunk piece (parameters, vocab)."""
    offs = chunk_bounds(x.shape[dim], g.size)
    r = g.rank if rank is None else rank
    return x.narrow(dim, offs[r], offs[r + 1] - offs[r])


def seq_piece(x: torch.Tensor, g, dim: int = 1) -> torch.Tensor:
    """tensor_split piece (sequence-parallel activations, as meshspeed.comm splits them)."""
    offs = bounds(x.shape[dim], g.size)
    return x.narrow(dim, offs[g.rank], offs[g.rank + 1] - offs[g.rank])


def close(a: torch.Tensor, b: torch.Tensor, rtol=1e-5, atol=1e-6) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=rtol, atol=atol)


# --- whole model ----------------------------------------------------------------------------


def _tokens(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
    targets = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
    targets[0, :3] = -100  # ignored positions count in neither the sum nor the mean
    return tokens, targets


def job_model(ctx, overrides: dict, sp: bool) -> list[str]:
    """Mismatches (empty when the parallel model equals the single-device one)."""
    g = ctx.world
    config = get_preset("tiny", **overrides)
    tokens, targets = _tokens(config.vocab_size)
    ref = build_model(config, seed=3)
    ref_loss = cross_entropy_loss(ref(tokens), targets) + ref.aux_loss()
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    mesh = comm.ParallelDims(tp=g.size).build(ctx)
    model = parallelize(build_model(config, seed=3), mesh, recipe_for(config), sequence_parallel=sp)
    # Born sharded (meta, split, materialise pieces): exactly the values sliced from the full model.
    born = build_parallel_model(recipe_for(config), mesh, seed=3, sequence_parallel=sp)
    bad = [
        f"born-sharded {n} differs"
        for (n, p), (m, q) in zip(model.named_parameters(), born.named_parameters())
        if n != m or not torch.equal(p, q) or sharding_of(p) != sharding_of(q)
    ]
    # each piece owns exactly its bytes: no view keeping the full initial value alive
    bad += [
        f"born-sharded {n} holds {q.untyped_storage().nbytes()} B of storage "
        f"for {q.numel() * q.element_size()} B"
        for n, q in born.named_parameters()
        if q.untyped_storage().nbytes() != q.numel() * q.element_size()
    ]
    loss = model_loss(model, tokens, targets)
    loss.backward()
    if not close(loss.detach(), ref_loss.detach()):
        bad.append(f"loss {loss.item()} != {ref_loss.item()}")
    params = dict(model.named_parameters())
    if set(params) != set(ref_grads):
        bad.append(f"parameter names differ: {sorted(set(params) ^ set(ref_grads))}")
    n_sharded = 0
    for name, p in params.items():
        if (sh := sharding_of(p)) is not None:
            n_sharded += 1
            want_local = piece(ref_grads[name], sh.shard_dims()["tp"], g).shape
            if sh.full_shape != ref_grads[name].shape or p.shape != want_local:
                bad.append(f"{name}: local {list(p.shape)} / full {list(sh.full_shape)} wrong")
                continue
        got, want = full_grad(p, {"tp": g}), ref_grads[name]
        if got is None or not close(got, want, atol=1e-6 * max(1.0, want.abs().max().item())):
            err = None if got is None else (got - want).abs().max().item()
            bad.append(f"{name}: grad max err {err}")
    if n_sharded < 8 * config.n_layers:
        bad.append(f"only {n_sharded} sharded parameters")
    return bad


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_parallel_model_matches_single_device(tp):
    for name, overrides in (("dense", DENSE), ("moe+tied", MOE), ("qwen2", dict(DENSE, family="qwen2"))):
        for sp in (False, True):
            assert harness.run(tp, job_model, overrides, sp) == [[]] * tp, f"{name} sp={sp}"


# --- layers ---------------------------------------------------------------------------------


def _check(bad: list, what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if not close(got, want):
        err = (got - want).abs().max().item() if got.shape == want.shape else "shape"
        bad.append(f"{what}: {list(got.shape)} vs {list(want.shape)}, max err {err}")


def job_layers(ctx, sp: bool) -> list[str]:
    g, bad = ctx.world, []
    n_seq = 12  # divides 2, 3 and 4

    # Column: in 7 -> out 10 (uneven at tp 3 and 4), with bias.
    full = nn.Linear(7, 10)
    with torch.no_grad():
        full.weight.copy_(rnd(1, 10, 7)), full.bias.copy_(rnd(2, 10))
    x_full = rnd(3, 2, n_seq, 7).requires_grad_()
    w_out = rnd(4, 2, n_seq, 10)
    y_full = full(x_full)
    (y_full * w_out).sum().backward()
    for gather in (False, True):
        col = ColumnParallelLinear(full, g, sp, gather_output=gather)
        x = (seq_piece(x_full, g) if sp else x_full).detach().clone().requires_grad_()
        y = col(x)
        want_y = y_full if gather else piece(y_full, -1, g)
        _check(bad, f"column(gather={gather}) out", y, want_y)
        # Each rank owns a distinct piece of the output; the global loss is their sum. With
        # a gathered (replicated) output it is counted once.
        (y * (w_out if gather else piece(w_out, -1, g))).sum().backward()
        _check(bad, "column x.grad", x.grad, seq_piece(x_full.grad, g) if sp else x_full.grad)
        _check(bad, "column weight.grad", col.weight.grad, piece(full.weight.grad, 0, g))
        _check(bad, "column bias.grad", col.bias.grad, piece(full.bias.grad, 0, g))

    # Row: in 10 (uneven) -> out 7, with bias.
    full = nn.Linear(10, 7)
    with torch.no_grad():
        full.weight.copy_(rnd(5, 7, 10)), full.bias.copy_(rnd(6, 7))
    x_full = rnd(7, 2, n_seq, 10).requires_grad_()
    w_out = rnd(8, 2, n_seq, 7)
    y_full = full(x_full)
    (y_full * w_out).sum().backward()
    row = RowParallelLinear(full, g, sp)
    x = piece(x_full, -1, g).detach().clone().requires_grad_()
    y = row(x)
    _check(bad, "row out", y, seq_piece(y_full, g) if sp else y_full)
    (y * (seq_piece(w_out, g) if sp else w_out)).sum().backward()
    _check(bad, "row x.grad", x.grad, piece(x_full.grad, -1, g))
    _check(bad, "row weight.grad", row.weight.grad, piece(full.weight.grad, 1, g))
    _check(bad, "row bias.grad", row.bias.grad, full.bias.grad)

    # Vocab-parallel embedding: 11 rows (uneven), tokens from every piece.
    full = nn.Embedding(11, 5)
    with torch.no_grad():
        full.weight.copy_(rnd(9, 11, 5))
    tokens = torch.arange(2 * n_seq).view(2, n_seq) % 11
    w_out = rnd(10, 2, n_seq, 5)
    h_full = full(tokens)
    (h_full * w_out).sum().backward()
    emb = VocabParallelEmbedding(full, g, sp)
    h = emb(tokens)
    _check(bad, "embedding out", h, seq_piece(h_full, g) if sp else h_full)
    (h * (seq_piece(w_out, g) if sp else w_out)).sum().backward()
    _check(bad, "embedding weight.grad", emb.weight.grad, piece(full.weight.grad, 0, g))
    return bad


def job_cross_entropy(ctx) -> list[str]:
    g, bad = ctx.world, []
    for vocab, dtype in ((256, torch.float32), (13, torch.float64)):
        logits_full = (3 * rnd(11, 2, 9, vocab, dtype=dtype)).requires_grad_()
        targets = torch.arange(18).view(2, 9) * (vocab // 18 + 1) % vocab  # spans every piece
        targets[1, ::4] = -100
        ref = F.cross_entropy(logits_full.flatten(0, 1), targets.flatten(), ignore_index=-100)
        (2.5 * ref).backward()
        logits = piece(logits_full, -1, g).detach().clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(logits, targets, g)
        (2.5 * loss).backward()
        _check(bad, f"CE V={vocab} loss", loss.detach(), ref.detach())
        _check(bad, f"CE V={vocab} grad", logits.grad, piece(logits_full.grad, -1, g))
        if loss.dtype != dtype or logits.grad.dtype != dtype:
            bad.append(f"CE dtype {loss.dtype} / {logits.grad.dtype}, wanted {dtype}")
    return bad


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_layers_match_torch(tp):
    for sp in (False, True):
        assert harness.run(tp, job_layers, sp) == [[]] * tp, f"sp={sp}"
    assert harness.run(tp, job_cross_entropy) == [[]] * tp


# --- plan, validation (no processes) ------------------------------------------------------------


def test_chunk_bounds_follow_torch_chunk():
    for n in (1, 5, 10, 11, 256):
        for p in (1, 2, 3, 4):
            offs = chunk_bounds(n, p)
            pieces = torch.arange(n).chunk(p)
            want = [c.numel() for c in pieces] + [0] * (p - len(pieces))
            assert [offs[i + 1] - offs[i] for i in range(p)] == want and offs[-1] == n


def test_default_plan_prints_and_assigns():
    config = get_preset("tiny", **MOE)
    plan = tp_plan(recipe_for(config))
    text = str(plan)
    for pattern, style in (
        ("layers.*.attention.wq", "colwise"),
        ("output", "colwise_vocab"),
        ("tok_embeddings", "vocab_embedding"),
        ("layers.*.feed_forward", "moe"),
    ):
        assert any(pattern in line and style in line for line in text.splitlines()), pattern
    assigned = dict(plan.assign(build_model(config)))
    assert assigned["layers.0.feed_forward.w1"] == "colwise"  # dense first layer
    assert assigned["layers.1.feed_forward"] == "moe"
    assert not any(f.startswith("layers.1.feed_forward.") for f in assigned)  # subtree claimed
    assert assigned["layers.1.attention.wo"] == "rowwise" and assigned["norm"] == "sequence_norm"
    assert TensorPlan(plan.to_dict(), plan.styles) == plan
    assert "moe" not in tp_plan(recipe_for(get_preset("tiny"))).to_dict().values()


def test_plan_errors():
    with pytest.raises(comm.ConfigError, match="style 'colwize' is unknown; valid: colwise"):
        TensorPlan({"layers.*.attention.wq": "colwize"}, STYLES)
    with pytest.raises(comm.ConfigError, match="'colwise' needs a Linear but matched layers.0.attention "):
        TensorPlan({"layers.*.attention": "colwise"}, STYLES).assign(build_model(get_preset("tiny")))


def test_bad_tp_gives_one_line_error_and_tp1_is_noop():
    with pytest.raises(comm.ConfigError) as err:
        check_tp(3, recipe_for(get_preset("tiny", n_heads=6, n_kv_heads=2, dim=96)))
    assert str(err.value) == "parallel.tp=3 does not divide n_kv_heads=2; valid tp: 1, 2"
    model, recipe = build_model(get_preset("tiny")), recipe_for(get_preset("tiny"))
    with pytest.raises(comm.ConfigError, match=r"^parallel.tp=3 does not divide n_heads=4; valid tp: 1, 2$"):
        parallelize(model, {"tp": SimpleNamespace(size=3, rank=0)}, recipe)
    before = {n: p for n, p in model.named_parameters()}
    assert parallelize(model, {"tp": SimpleNamespace(size=1, rank=0)}, recipe) is model
    assert {n: p for n, p in model.named_parameters()} == before
