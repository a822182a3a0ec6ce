"""Context parallelism (Ulysses, ring with zigzag, hybrid) against single-device attention.

Every rank builds the full inputs from one seed and computes the single-device reference
(the model's own attention core, SDPA); the cp version sees only this rank's tokens (its
layout's positions) and its outputs and input gradients must equal the reference's rows at
those positions. The whole tiny model is checked the same way: loss over all tokens and the
parameter gradients summed over cp ranks.
"""

from __future__ import annotations

import copy

import pytest
import torch

from meshspeed import comm
from meshspeed.comm.errors import ConfigError
from meshspeed.models import build_model, cross_entropy_loss, get_preset
from meshspeed.models.llama import attention_core, document_positions
from meshspeed.parallel.context import (
    apply_context_parallel,
    check_cp,
    context_parallel,
    cp_positions,
    kv_replication,
    shard_sequence,
)
from meshspeed.parallel.ring_blocks import block_fwd, merge
from tests import harness
from tests.train.test_trainer import assert_rows_close

BATCH, SEQ, HEAD_DIM = 2, 24, 8
# (world size, impl, cp_ulysses): hybrid needs a 2-D split, so it runs at 4 (2 × 2) and, as
# its degenerate forms, Ulysses-only groups at 2 and ring-only at 3.
CASES = [(ws, impl, 1) for ws in (2, 3, 4) for impl in ("ulysses", "ring")]
CASES += [(4, "hybrid", 2), (2, "hybrid", 2), (3, "hybrid", 1)]


def rnd(seed: int, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def packed_docs(batch: int, seq: int, seed: int = 5) -> torch.Tensor:
    """[batch, seq] non-decreasing document ids with random boundaries (some short documents)."""
    starts = torch.rand(batch, seq, generator=torch.Generator().manual_seed(seed)) < 0.2
    starts[:, 0] = False
    return starts.long().cumsum(1)


def heads_for(ws: int) -> tuple[int, int]:
    """6 heads at cp 2 and 3, 8 at cp 4; 2 kv heads (GQA, fewer kv heads than cp at 3 and 4)."""
    return (8 if ws == 4 else 6), 2


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6 * max(1.0, b.abs().max().item()))


def job_attention(ctx, impl: str, u: int, packed: bool) -> list[str]:
    h, g = heads_for(ctx.world_size)
    q, k, v = (
        rnd(1, BATCH, SEQ, h, HEAD_DIM),
        rnd(2, BATCH, SEQ, g, HEAD_DIM),
        rnd(3, BATCH, SEQ, g, HEAD_DIM),
    )
    w = rnd(4, BATCH, SEQ, h, HEAD_DIM)  # a random linear loss makes every gradient entry count
    docs = packed_docs(BATCH, SEQ) if packed else None
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = attention_core(*ref_in, docs)
    (ref * w).sum().backward()

    mesh = comm.ParallelDims(cp=ctx.world_size).build(ctx)
    core = context_parallel(mesh, impl, cp_ulysses=u)
    pos = core.positions(SEQ)
    mine = [shard_sequence(t, pos).requires_grad_() for t in (q, k, v)]
    out = core(*mine, None if docs is None else shard_sequence(docs, pos))
    (out * shard_sequence(w, pos)).sum().backward()
    bad = [] if close(out, shard_sequence(ref.detach(), pos)) else ["output"]
    for name, t, r in zip("qkv", mine, ref_in):
        if not close(t.grad, shard_sequence(r.grad, pos)):
            bad.append(f"d{name} max err {(t.grad - shard_sequence(r.grad, pos)).abs().max().item():.3g}")
    return bad


@pytest.mark.parametrize("packed", [False, True], ids=["causal", "packed"])
@pytest.mark.parametrize("ws,impl,u", CASES)
def test_attention_matches_single_device(ws, impl, u, packed):
    assert harness.run(ws, job_attention, impl, u, packed) == [[]] * ws


def job_model(ctx, impl: str, u: int, packed: bool) -> list[str]:
    h, g = heads_for(ctx.world_size)
    config = get_preset("tiny", n_heads=h, n_kv_heads=g, dim=h * HEAD_DIM, max_seq_len=SEQ, n_layers=2)
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=gen)
    targets = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=gen)
    targets[0, :3] = -100
    docs = packed_docs(BATCH, SEQ) if packed else None
    ref = build_model(config, seed=3)
    model = copy.deepcopy(ref)
    ref_loss = cross_entropy_loss(ref(tokens, doc_ids=docs), targets)
    ref_loss.backward()

    mesh = comm.ParallelDims(cp=ctx.world_size).build(ctx)
    core = context_parallel(mesh, impl, cp_ulysses=u)
    assert apply_context_parallel(model, core) == config.n_layers
    pos = core.positions(SEQ)
    # RoPE positions: the global ones of this rank's tokens, restarting per document when packed.
    rope = pos if docs is None else shard_sequence(document_positions(docs), pos)
    logits = model(
        shard_sequence(tokens, pos),
        positions=rope,
        doc_ids=None if docs is None else shard_sequence(docs, pos),
    )
    # The mean over every token of the global batch: local sum / global count of counted targets.
    mine = shard_sequence(targets, pos)
    total = comm.all_reduce((mine != -100).sum().float(), mesh["cp"])
    loss_sum = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), mine.flatten(), ignore_index=-100, reduction="sum"
    )
    (loss_sum / total).backward()
    loss = comm.all_reduce(loss_sum.detach() / total, mesh["cp"])
    bad = [] if close(loss, ref_loss.detach()) else [f"loss {loss.item()} != {ref_loss.item()}"]
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        grad = comm.all_reduce(p.grad.clone(), mesh["cp"])  # non-attention grads: summed over cp
        if not close(grad, r.grad):
            bad.append(f"{name} grad max err {(grad - r.grad).abs().max().item():.3g}")
    return bad


@pytest.mark.parametrize("packed", [False, True], ids=["causal", "packed"])
@pytest.mark.parametrize("ws,impl,u", CASES)
def test_model_matches_single_device(ws, impl, u, packed):
    assert harness.run(ws, job_model, impl, u, packed, timeout=180) == [[]] * ws


# --- single process: layout, block math, errors -------------------------------------------------


def test_zigzag_positions_balance_causal_work():
    cp, seq = 4, 32
    pos = [cp_positions(seq, cp, r, "zigzag") for r in range(cp)]
    assert torch.equal(torch.cat(pos).sort().values, torch.arange(seq))
    n = seq // (2 * cp)
    assert pos[1].tolist() == list(range(n, 2 * n)) + list(range(6 * n, 7 * n))
    work = {int((p[:, None] + 1).sum()) for p in pos}  # keys each rank's queries attend to
    assert len(work) == 1


def test_block_merge_equals_full_attention_and_masked_block_is_finite():
    """Two key blocks merged by log-sum-exp equal one softmax; a fully masked block adds nothing."""
    q, k, v = rnd(1, 1, 2, 3, 5, 4), rnd(2, 1, 2, 10, 4), rnd(3, 1, 2, 10, 4)  # [b, g, r, s, hd]
    scale = 0.5
    full = torch.softmax(torch.einsum("bgrqd,bgkd->bgrqk", q, k) * scale, -1)
    want = torch.einsum("bgrqk,bgkd->bgrqd", full, v)
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"))
    none = torch.zeros(1, 1, 1, 5, 4, dtype=torch.bool)
    o_m, lse_m = block_fwd(q, k[:, :, :4], v[:, :, :4], scale, none)
    assert torch.isfinite(o_m).all() and (o_m == 0).all() and torch.isneginf(lse_m).all()
    merge(out, lse, 0, 5, o_m, lse_m)
    assert torch.isfinite(out).all()
    for a, b in ((0, 6), (6, 10)):
        o, blk = block_fwd(q, k[:, :, a:b], v[:, :, a:b], scale, None)
        merge(out, lse, 0, 5, o, blk)
    assert torch.allclose(out, want, rtol=1e-5, atol=1e-6)


def test_packed_positions_restart_per_document():
    docs = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2]])
    assert document_positions(docs).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]


def test_packed_model_equals_each_document_alone():
    """The single-device reference itself: a packed row's logits are each document's own."""
    model = build_model(get_preset("tiny", max_seq_len=SEQ, n_layers=2), seed=3)
    tokens = torch.randint(0, 256, (1, SEQ), generator=torch.Generator().manual_seed(1))
    docs = torch.tensor([[0] * 5 + [1] * 12 + [2] * 7])
    packed = model(tokens, doc_ids=docs)
    for d in range(3):
        cols = (docs[0] == d).nonzero().flatten()
        alone = model(tokens[:, cols])
        assert torch.allclose(packed[:, cols], alone, rtol=1e-5, atol=1e-5)


def test_kv_replication_fewest_copies():
    assert kv_replication(8, 2, 4) == 2 and kv_replication(6, 2, 3) == 3 and kv_replication(8, 4, 2) == 1


@pytest.mark.parametrize(
    "args,words",
    [
        (("ulysses", 4, 6, 32), ["6 attention heads", "cp_impl=ring"]),
        (("ring", 3, 6, 20), ["sequence length 20", "multiple of 6"]),
        (("hybrid", 4, 8, 32, 3), ["parallel.cp_ulysses=3", "[1, 2, 4]"]),
        (("context", 2, 8, 32), ["parallel.cp_impl='context'", "ulysses, ring, hybrid"]),
    ],
)
def test_layout_errors_are_one_line(args, words):
    with pytest.raises(ConfigError) as err:
        check_cp(*args)
    msg = str(err.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


# --- the trainer: first ten float32 losses equal one process's ------------------------------------

TRAIN_BASE = [
    ("model.n_heads", "4"),
    ("model.n_kv_heads", "2"),
    ("train.seq_len", "32"),
    ("train.global_batch_size", "4"),
    ("train.micro_batch_size", "2"),
    ("train.dtype", "float32"),
    ("train.eval_interval", "0"),
    ("train.warmup_steps", "3"),
    ("data.max_mb", "1"),
]
TRAIN_LAYOUTS = [
    ("cp2-ulysses", 2, [("parallel.tp", "1"), ("parallel.cp", "2"), ("parallel.cp_impl", "ulysses")]),
    ("cp2-ring", 2, [("parallel.tp", "1"), ("parallel.cp", "2"), ("parallel.cp_impl", "ring")]),
    (
        "cp4-hybrid",
        4,
        [
            ("parallel.tp", "1"),
            ("parallel.cp", "4"),
            ("parallel.cp_impl", "hybrid"),
            ("parallel.cp_ulysses", "2"),
        ],
    ),
    ("cp2-tp2", 4, [("parallel.tp", "2"), ("parallel.cp", "2"), ("parallel.cp_impl", "ring")]),
    (
        "cp2-dp2-zero1",
        4,
        [("parallel.tp", "1"), ("parallel.cp", "2"), ("parallel.zero", "1"), ("parallel.cp_impl", "ring")],
    ),
    (
        "cp2-pp2-ring",
        4,
        [("parallel.tp", "1"), ("parallel.pp", "2"), ("parallel.cp", "2"), ("parallel.cp_impl", "ring")],
    ),
    (
        "cp2-tp2-sp-ulysses",
        4,
        [
            ("parallel.tp", "2"),
            ("parallel.sequence_parallel", "true"),
            ("parallel.cp", "2"),
            ("parallel.cp_impl", "ulysses"),
        ],
    ),
]


def job_train_losses(ctx, run_dir: str, extra: list, steps: int) -> tuple[list, list]:
    """(losses, gradient norms): the norm shows a gradient summed over cp instead of averaged,
    which AdamW's losses would hide."""
    from meshspeed.plan import config
    from meshspeed.train.trainer import Trainer

    cfg = config.load(None, TRAIN_BASE + [("run.dir", run_dir), ("train.steps", str(steps))] + extra)
    trainer = Trainer(cfg, ctx)
    rows = [trainer.train_step(s) for s in range(steps)]
    return [r["loss"] for r in rows], [r["grad_norm"] for r in rows]


_TRAIN_REF: list = []


@pytest.mark.parametrize("name,ws,extra", TRAIN_LAYOUTS, ids=[x[0] for x in TRAIN_LAYOUTS])
def test_trainer_first_ten_losses_equal_single_process(tmp_path_factory, name, ws, extra):
    if not _TRAIN_REF:
        ref_dir = str(tmp_path_factory.mktemp("cp-ref"))
        _TRAIN_REF.append(
            harness.run(1, job_train_losses, ref_dir, [("parallel.tp", "1")], 10, timeout=180)[0]
        )
    want = _TRAIN_REF[0]
    got = harness.run(ws, job_train_losses, str(tmp_path_factory.mktemp(name)), extra, 10, timeout=240)
    assert_rows_close(got, want, name)
    assert want[0][-1] < want[0][0] - 0.3  # learning: the equality is not about constants


def test_plan_refuses_bad_cp_layouts_in_one_line(tmp_path):
    from meshspeed.plan import config
    from meshspeed.plan.run_plan import make_plan

    for extra, world, words in [
        (
            [("parallel.cp", "3"), ("parallel.cp_impl", "ulysses"), ("model.n_heads", "8")],
            3,
            "8 attention heads",
        ),
        ([("parallel.cp", "2"), ("train.seq_len", "30")], 2, "sequence length 30"),
        ([("parallel.cp", "3")], 4, "parallel.cp=3"),
    ]:
        cfg = config.load(
            None, [("run.dir", str(tmp_path)), ("parallel.tp", "1"), ("model.n_kv_heads", "2")] + extra
        )
        with pytest.raises(ConfigError) as err:
            make_plan(cfg, world, ranks=False)
        assert "\n" not in str(err.value) and words in str(err.value), str(err.value)


def job_run(ctx, run_dir: str, extra: list) -> str:
    from meshspeed.plan import config
    from meshspeed.train.trainer import Trainer

    return Trainer(config.load(None, TRAIN_BASE + [("run.dir", run_dir)] + extra), ctx).run()["checkpoint"]


def test_cp_checkpoint_resumes_without_cp(tmp_path):
    """Parameters and optimizer state are replicated over cp like over dp: a cp 2 checkpoint
    resumes on one process and continues the uninterrupted cp 2 run's losses."""
    import json
    import os

    cp2 = [("parallel.tp", "1"), ("parallel.cp", "2"), ("train.steps", "14")]
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    harness.run(2, job_run, straight, cp2, timeout=240)
    harness.run(2, job_run, split, cp2 + [("train.exit_interval", "7")], timeout=240)
    one = [("parallel.tp", "1"), ("train.steps", "14"), ("checkpoint.resume", "latest")]
    harness.run(1, job_run, split, one, timeout=240)

    def losses(d):
        with open(os.path.join(d, "metrics.jsonl")) as f:
            return [json.loads(line)["loss"] for line in f]

    want, got = losses(straight), losses(split)
    assert len(want) == len(got) == 14
    for step, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= 1e-5 * abs(w), f"step {step}: resumed without cp {g} vs cp 2 {w}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
def test_block_kernels_on_cuda_match_cpu():
    """On CUDA the ring blocks take the explicit float32 path (no CPU flash kernel): same math."""
    q, k, v = rnd(1, 2, 2, 3, 6, 8), rnd(2, 2, 2, 6, 8), rnd(3, 2, 2, 6, 8)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()[None, None, None]
    want_o, want_lse = block_fwd(q, k, v, 0.3, causal)
    got_o, got_lse = block_fwd(q.cuda(), k.cuda(), v.cuda(), 0.3, causal.cuda())
    assert torch.allclose(got_o.cpu(), want_o, rtol=1e-5, atol=1e-6)
    assert torch.allclose(got_lse.cpu(), want_lse, rtol=1e-5, atol=1e-6)


# --- data.packing through the trainer ---------------------------------------------------------------


def _short_documents(root) -> str:
    """A corpus of 2000 short files (5-40 bytes): every 32-token window spans several documents."""
    gen = torch.Generator().manual_seed(0)
    for i in range(2000):
        n = int(torch.randint(5, 40, (1,), generator=gen))
        words = " ".join(f"w{int(t)}" for t in torch.randint(0, 50, (n // 3 + 1,), generator=gen))
        (root / f"doc{i:04d}.txt").write_text(words[:n])
    return str(root)


@pytest.mark.parametrize(
    "name,ws,extra",
    [
        ("packed-cp2-ring", 2, [("parallel.cp", "2"), ("parallel.cp_impl", "ring")]),
        ("packed-cp2-ulysses", 2, [("parallel.cp", "2"), ("parallel.cp_impl", "ulysses")]),
        (
            "packed-cp4-hybrid",
            4,
            [("parallel.cp", "4"), ("parallel.cp_impl", "hybrid"), ("parallel.cp_ulysses", "2")],
        ),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_packed_training_under_cp_equals_single_process(tmp_path_factory, name, ws, extra):
    corpus = tmp_path_factory.getbasetemp() / "short-docs"
    if not corpus.exists():
        corpus.mkdir()
        _short_documents(corpus)
    data = [
        ("parallel.tp", "1"),
        ("data.path", str(corpus)),
        ("data.format", "text"),
        ("train.eval_batches", "1"),
    ]
    packed = data + [("data.packing", "true")]
    ref_dir, plain_dir = (str(tmp_path_factory.mktemp(n)) for n in ("packed-ref", "plain-ref"))
    want = harness.run(1, job_train_losses, ref_dir, packed, 10, timeout=180)[0]
    plain = harness.run(1, job_train_losses, plain_dir, data, 1, timeout=180)[0]
    assert abs(plain[0][0] - want[0][0]) > 1e-4, (
        "packing changed nothing: the corpus has no document inside a window"
    )
    got = harness.run(
        ws, job_train_losses, str(tmp_path_factory.mktemp(name)), packed + extra, 10, timeout=240
    )
    assert_rows_close(got, want, f"{name} (single process packed)")
