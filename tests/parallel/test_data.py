"""Data parallelism, ZeRO-1/2, mixed precision and global gradient clipping against one device.

The oracle is torch.optim.AdamW + torch.nn.utils.clip_grad_norm_ on the single-process tiny
Llama fed the whole global batch at once; the parallel runs split each step's batch over dp
ranks and two micro-batches (no_sync on the first).
"""

from __future__ import annotations

import contextlib
import functools
import math
import time

import pytest
import torch
from torch import nn

from meshspeed import comm, models
from meshspeed.comm import placement
from meshspeed.parallel.buckets import plan_buckets
from meshspeed.parallel.data import DataParallel
from meshspeed.parallel.optim import ZeroAdamW, build_data_parallel, clip_grad_norm_, grad_norm
from tests import harness

SEQ, MICRO, ACCUM, STEPS = 16, 12, 2, 3  # MICRO: global samples per micro-batch (divisible by 2, 3, 4)
HP = dict(lr=3e-3, weight_decay=0.5, betas=(0.9, 0.95), eps=1e-5)
MAX_NORM = 0.5  # below the tiny model's gradient norm (~5): clipping is active every step
BUCKET_MB = 0.5  # 5 buckets for the tiny model, so overlap and ordering are exercised


def _config():
    return models.get_preset("tiny")


def _tokens(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, _config().vocab_size, (ACCUM * MICRO, SEQ + 1), generator=g)


def _loss(model, tokens) -> torch.Tensor:
    return models.cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])


@functools.cache
def reference():
    """Single process, whole global batch per step: params, optimizer state, norms, losses."""
    model = models.build_model(_config())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], foreach=False, **HP)
    norms, losses = [], []
    for step in range(STEPS):
        loss = _loss(model, _tokens(step))
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {
        n: {
            "master": p.detach().clone(),
            "exp_avg": opt.state[p]["exp_avg"],
            "exp_avg_sq": opt.state[p]["exp_avg_sq"],
        }
        for n, p in model.named_parameters()
    }
    return params, state, norms, losses


def _count_since(ctx, t0: float) -> int:
    return sum(e["start"] >= t0 for e in ctx.recorder.entries)


def _train(ctx, mesh, dp, opt, model, steps, log: dict | None = None):
    """ACCUM micro-batches per step, this rank's rows of each; returns per-step (norm, loss)."""
    rank, size = dp.group.rank, dp.group.size
    per = MICRO // size
    out = []
    for step in steps:
        tokens = _tokens(step)
        loss_sum = 0.0
        for micro in range(ACCUM):
            rows = tokens[micro * MICRO + rank * per : micro * MICRO + (rank + 1) * per]
            sync = micro == ACCUM - 1
            t0 = time.time()
            with contextlib.nullcontext() if sync else dp.no_sync():
                if dp.events is not None:
                    dp.events.clear()
                loss = _loss(model, rows) / ACCUM
                loss.backward()
            loss_sum += loss.item()
            if log is not None:
                log.setdefault("sync" if sync else "nosync", []).append(_count_since(ctx, t0))
                if sync and dp.events is not None:
                    kinds = [k for k, _ in dp.events]
                    log.setdefault("first_launch", []).append(kinds.index("launch"))
                    log.setdefault("last_grad", []).append(len(kinds) - 1 - kinds[::-1].index("grad"))
        norm = clip_grad_norm_(dp, MAX_NORM, mesh).item()
        opt.step()
        opt.zero_grad()
        out.append((norm, loss_sum))
    return out


def _fresh(mesh, zero, dtype=torch.float32):
    model = models.build_model(_config())
    dp, opt = build_data_parallel(model, mesh, zero=zero, bucket_mb=BUCKET_MB, dtype=dtype, **HP)
    return model, dp, opt


# ------------------------------------------------------------------------------ job functions
def job_train(ctx, zeros, roundtrip):
    mesh = comm.ParallelDims(dp=ctx.world_size).build(ctx)
    res = {}
    for zero in zeros:
        model, dp, opt = _fresh(mesh, zero)
        dp.events = []
        log: dict = {}
        hist = _train(ctx, mesh, dp, opt, model, range(STEPS), log)
        views = all(
            p.grad is None
            if zero == 2
            else p.grad.untyped_storage().data_ptr()
            == dp.buckets[dp.slots[n].bucket].grad.untyped_storage().data_ptr()
            for n, p in model.named_parameters()
        )
        sd = opt.state_dict_per_param()
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        sums = torch.stack([p.double().sum() for p in params.values()])
        ok, after, dp2 = None, None, None
        if roundtrip:  # into another ZeRO stage, then one more step on both: they must agree
            model2, dp2, opt2 = _fresh(mesh, (zero + 1) % 3)
            opt2.load_state_dict_per_param(sd)
            sd2 = opt2.state_dict_per_param()
            ok = (
                all(torch.equal(sd[n][k], sd2[n][k]) for n in dp.slots for k in sd[n])
                and sd2["__step__"] == STEPS
            )
            _train(ctx, mesh, dp, opt, model, [STEPS])
            _train(ctx, mesh, dp2, opt2, model2, [STEPS])
            after = max(
                (p - dict(model2.named_parameters())[n]).abs().max().item()
                for n, p in model.named_parameters()
            )
            dp2.remove_hooks()
        res[zero] = {
            "params": params if ctx.rank == 0 else None,
            "sums": sums,
            "state": sd if ctx.rank == 0 else None,
            "norms": [n for n, _ in hist],
            "log": log,
            "buckets": len(dp.buckets),
            "stats": dict(dp.stats),
            "views": views,
            "roundtrip": ok,
            "after_load_diff": after,
        }
        dp.remove_hooks()
    return res


def _chunk(t: torch.Tensor, dim: int, p: int, i: int) -> torch.Tensor:
    """torch.chunk semantics (CONTRACTS.md §1): shard i starts at i * ceil(n / p), may be empty."""
    n = t.shape[dim]
    size = -(-n // p)
    start = min(i * size, n)
    return t.narrow(dim, start, min(start + size, n) - start)


FAKE = {"a": ((7, 5), 0), "b": ((5, 9), 1), "c": ((6,), None), "d": ((4, 4), None), "e": ((2, 3), 0)}


def _fake_full():
    g = torch.Generator().manual_seed(7)
    return {
        n: (torch.randn(shape, generator=g), torch.randn(shape, generator=g))
        for n, (shape, _) in FAKE.items()
    }


def _shard(name, t, tp_rank, tp):
    dim = FAKE[name][1]
    return t.clone() if dim is None else _chunk(t, dim, tp, tp_rank).clone()


def job_clip_tp(ctx, dp_size, tp, max_norm):
    """Fake tensor-parallel parameter set: plain params and DataParallel (zero 0/1/2) paths."""
    mesh = comm.ParallelDims(dp=dp_size, tp=tp).build(ctx)
    tp_rank = mesh.coords["tp"]
    full = _fake_full()

    def local_params():
        ps = {}
        for n, (w, _) in full.items():
            p = nn.Parameter(_shard(n, w, tp_rank, tp))
            if FAKE[n][1] is not None:
                placement.tag(p, placement.Sharding(w.shape, (("tp", placement.Shard(FAKE[n][1])),)))
            ps[n] = p
        return ps

    out = {}
    ps = local_params()
    for n, p in ps.items():
        p.grad = _shard(n, full[n][1], tp_rank, tp)
    out["plain"] = (
        clip_grad_norm_(list(ps.values()), max_norm, mesh).item(),
        {n: p.grad.clone() for n, p in ps.items()},
        grad_norm(ps.values(), mesh).item(),
    )
    for zero in (0, 1, 2):
        module = nn.ParameterDict(local_params())
        dp = DataParallel(module, mesh, zero=zero, bucket_mb=1e-4)  # several buckets of a few params
        loss = sum((p * _shard(n, full[n][1], tp_rank, tp)).sum() for n, p in module.items())
        loss.backward()
        norm = clip_grad_norm_(dp, max_norm, mesh).item()
        grads = {n: p.grad.clone() for n, p in module.items()} if zero < 2 else None
        out[zero] = (norm, grads, grad_norm(dp, mesh).item(), len(dp.buckets))
    return out


def job_bf16_bytes(ctx):
    mesh = comm.ParallelDims(dp=ctx.world_size).build(ctx)
    res = {}
    for zero in (0, 1, 2):
        model = models.build_model(_config())
        init = {n: p.detach().clone() for n, p in model.named_parameters()}
        dp, opt = build_data_parallel(model, mesh, zero=zero, bucket_mb=BUCKET_MB, dtype=torch.bfloat16, **HP)
        sd0 = opt.state_dict_per_param()
        hist = _train(ctx, mesh, dp, opt, model, range(STEPS))
        res[zero] = {
            # masters start from the fp32 init itself, not from its bf16 rounding
            "masters_start_exact": all(torch.equal(sd0[n]["master"], w) for n, w in init.items()),
            "grads_dropped": all(p.grad is None for p in model.parameters()),  # only fp32 main_grad kept
            "losses": [loss for _, loss in hist],
            "norms": [n for n, _ in hist],
            "param_dtypes": {p.dtype for p in model.parameters()},
            "master_dtypes": {st.master.dtype for st in opt.shards},
            "main_grad_dtypes": {p.main_grad.dtype for p in model.parameters()},
            # the bf16 parameters are the rounded fp32 masters, and the masters are not bf16 values
            "params_are_rounded_masters": all(
                torch.equal(dp.buckets[i].data[slice(*dp.opt_range(i))], st.master.bfloat16())
                for i, st in enumerate(opt.shards)
            ),
            "master_has_fp32_bits": any(
                not torch.equal(st.master, st.master.bfloat16().float()) for st in opt.shards
            ),
            "state_bytes": opt.state_bytes(),
            "grad_bytes": dp.grad_bytes(),
            "numel": sum(s.numel for s in dp.specs),
        }
        dp.remove_hooks()
    return res


# ------------------------------------------------------------------------------ tests
def _close(got: dict, want: dict, rtol: float, atol: float) -> list[str]:
    bad = []
    for n, w in want.items():
        g = got[n]
        if not torch.allclose(g, w, rtol=rtol, atol=atol):
            bad.append(f"{n}: max abs diff {(g - w).abs().max().item():.3g}")
    return bad


@functools.cache
def trained(ws: int):
    """One job per world size serves both the equivalence and the overlap tests."""
    return harness.run(ws, job_train, (0, 1, 2), ws == 3, timeout=120)


@pytest.mark.parametrize("ws", [2, 3, 4])
def test_zero_0_1_2_equal_single_device(ws):
    ref_params, ref_state, ref_norms, _ = reference()
    res = trained(ws)
    for zero in (0, 1, 2):
        r0 = res[0][zero]
        assert max(ref_norms) > MAX_NORM, "clipping must be active for this test to mean something"
        assert r0["norms"] == pytest.approx(ref_norms, rel=1e-5), f"zero={zero}: grad norms"
        bad = _close(r0["params"], ref_params, rtol=1e-5, atol=1e-6)
        assert not bad, f"ws={ws} zero={zero}: params differ from single device:\n" + "\n".join(bad[:5])
        for r in range(1, ws):  # every dp rank holds the same parameters, bit for bit
            assert torch.equal(res[r][zero]["sums"], r0["sums"]), f"zero={zero}: rank {r} diverged"
        # optimizer state per parameter equals torch's AdamW state (so it is the same for every zero)
        for key in ("master", "exp_avg", "exp_avg_sq"):
            bad = _close(
                {n: s[key] for n, s in r0["state"].items() if n != "__step__"},
                {n: s[key] for n, s in ref_state.items()},
                rtol=1e-5,
                atol=1e-7 if key != "master" else 1e-6,
            )
            assert not bad, f"zero={zero} {key}:\n" + "\n".join(bad[:5])
        assert r0["state"]["__step__"] == STEPS
        if ws == 3:
            assert all(res[r][zero]["roundtrip"] for r in range(ws)), (
                "state_dict_per_param round trip across zero"
            )
            assert r0["after_load_diff"] < 1e-6, (
                f"zero={zero}: a step after loading into another stage diverged"
            )
        # fp32 mode: gradients are views into the buckets (zero=2: released after the reduce-scatter)
        assert r0["views"], f"zero={zero}: p.grad is not a view into the flat buckets"


def test_reduction_overlaps_backward_and_no_sync_skips_it():
    res = trained(2)
    for zero in (0, 1, 2):
        r = res[1][zero]
        nb = r["buckets"]
        assert nb >= 4, "the test needs several buckets"
        assert r["log"]["nosync"] == [0] * STEPS, f"zero={zero}: no_sync backward issued collectives"
        # every bucket was issued from a backward hook, before backward returned
        assert r["log"]["sync"] == [nb] * STEPS, f"zero={zero}: collectives during the sync backward"
        assert r["stats"]["launched_in_backward"] == nb * STEPS and r["stats"]["launched_in_finish"] == 0
        # the first bucket went out while autograd still had gradients to produce
        assert all(f < g for f, g in zip(r["log"]["first_launch"], r["log"]["last_grad"])), r["log"]


def test_bucket_layout_covers_each_param_once():
    model = models.build_model(_config())
    named = list(model.named_parameters())
    shapes = [(n, tuple(p.shape)) for n, p in reversed(named)]
    for dp_size in (1, 3, 4):
        for cap in (1, 5000, 40000, 10**9):
            specs = plan_buckets(shapes, cap, dp_size)
            seen = [s.name for b in specs for s in b.slots]
            assert sorted(seen) == sorted(n for n, _ in named) and len(seen) == len(set(seen))
            assert seen == [n for n, _ in shapes], "buckets must follow reverse registration order"
            for b in specs:
                assert b.numel % (16 * dp_size) == 0
                ends = 0
                for s in b.slots:
                    assert s.offset >= ends and s.offset % 16 == 0 and s.numel == math.prod(s.shape)
                    ends = s.offset + s.numel
                assert ends <= b.numel
                assert len(b.slots) == 1 or sum(s.numel for s in b.slots[:-1]) <= cap


def test_dp1_no_communication_matches_reference_and_grads_are_views():
    ctx = comm.init()
    mesh = comm.ParallelDims().build(ctx)
    ref_params, _, ref_norms, _ = reference()
    for zero in (0, 1, 2):
        model, dp, opt = _fresh(mesh, zero)
        t0 = time.time()
        hist = _train(ctx, mesh, dp, opt, model, range(STEPS))
        assert _count_since(ctx, t0) == 0
        bad = _close(dict(model.named_parameters()), ref_params, rtol=1e-5, atol=1e-6)
        assert not bad, f"zero={zero}: " + "\n".join(bad[:5])
        assert [n for n, _ in hist] == pytest.approx(ref_norms, rel=1e-5)
        for n, p in model.named_parameters():
            b = dp.buckets[dp.slots[n].bucket]
            assert p.grad.untyped_storage().data_ptr() == b.grad.untyped_storage().data_ptr()
            assert p.untyped_storage().data_ptr() == b.data.untyped_storage().data_ptr()
        dp.remove_hooks()


@pytest.mark.parametrize("ws,dp_size,tp", [(2, 1, 2), (3, 1, 3), (4, 2, 2)])
def test_clip_grad_norm_with_tp_shards_matches_torch(ws, dp_size, tp):
    full = _fake_full()
    ref = {n: nn.Parameter(w.clone()) for n, (w, _) in full.items()}
    for n, p in ref.items():
        p.grad = full[n][1].clone()
    unclipped = torch.nn.utils.clip_grad_norm_(ref.values(), float("inf")).item()
    max_norm = unclipped / 3
    want = torch.nn.utils.clip_grad_norm_(ref.values(), max_norm).item()
    res = harness.run(ws, job_clip_tp, dp_size, tp, max_norm)
    for rank, out in enumerate(res):
        tp_rank = rank % tp
        norm, grads, after = out["plain"]
        assert norm == pytest.approx(want, rel=1e-6), (
            f"rank {rank}: plain-param norm (replicated counted once?)"
        )
        assert after == pytest.approx(max_norm, rel=1e-5)
        for n, g in grads.items():
            torch.testing.assert_close(g, _shard(n, ref[n].grad, tp_rank, tp), rtol=1e-6, atol=1e-7)
        for zero in (0, 1, 2):
            norm, grads, after, nb = out[zero]
            assert nb > 1
            assert norm == pytest.approx(want, rel=1e-5), f"rank {rank} zero={zero}: DataParallel norm"
            assert after == pytest.approx(max_norm, rel=1e-5), (
                f"rank {rank} zero={zero}: clipping not applied everywhere"
            )
            for n, g in (grads or {}).items():
                torch.testing.assert_close(g, _shard(n, ref[n].grad, tp_rank, tp), rtol=1e-5, atol=1e-7)


def test_bf16_keeps_fp32_masters_and_zero_shards_state():
    _, _, ref_norms, ref_losses = reference()
    res = harness.run(4, job_bf16_bytes, timeout=120)
    r = res[0]
    print("\nper-rank bytes at dp=4, bf16 params, fp32 masters/moments/grads:")
    for zero in (0, 1, 2):
        print(
            f"  zero={zero}: optimizer state {r[zero]['state_bytes']:>9,} B   "
            f"gradients {r[zero]['grad_bytes']:>9,} B"
        )
    numel = r[0]["numel"]
    for zero in (0, 1, 2):
        x = r[zero]
        assert x["param_dtypes"] == {torch.bfloat16} and x["master_dtypes"] == {torch.float32}
        assert x["main_grad_dtypes"] == {torch.float32}
        assert x["params_are_rounded_masters"] and x["master_has_fp32_bits"]
        assert x["masters_start_exact"] and x["grads_dropped"]
        assert x["losses"] == pytest.approx(ref_losses, rel=2e-2), f"zero={zero}: bf16 losses far from fp32"
        assert x["norms"] == pytest.approx(ref_norms, rel=3e-2), (
            f"zero={zero}: bf16 gradient norms far from fp32"
        )
    # counted bytes: masters + two moments, fp32; ZeRO-1/2 hold exactly 1/dp of them
    assert r[0]["state_bytes"] == 12 * numel
    assert r[1]["state_bytes"] == r[2]["state_bytes"] == 12 * numel // 4
    assert r[0]["grad_bytes"] == r[1]["grad_bytes"] == 4 * numel
    assert r[2]["grad_bytes"] == 4 * numel // 4  # full buckets released after the reduce-scatter


def test_config_errors_name_the_setting():
    ctx = comm.init()
    mesh = comm.ParallelDims().build(ctx)
    model = models.build_model(_config())
    with pytest.raises(comm.ConfigError, match="zero=3"):
        DataParallel(model, mesh, zero=3)
    with pytest.raises(comm.ConfigError, match="bucket_mb=0"):
        DataParallel(model, mesh, bucket_mb=0)
    dp = DataParallel(model, mesh)
    with pytest.raises(comm.ConfigError, match="betas"):
        ZeroAdamW(dp, betas=(0.9, 1.5))
    # a second sync-enabled backward before the step is a usage error, said plainly
    tokens = _tokens(0)[:2]
    _loss(model, tokens).backward()
    with pytest.raises(RuntimeError, match="no_sync"):
        _loss(model, tokens).backward()
    dp.remove_hooks()
