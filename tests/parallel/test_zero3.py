"""ZeRO-3 (meshspeed/parallel/zero3.py) against one process: forward, gradients and AdamW steps
at dp 2, 3 and 4 and dp 2 × tp 2; the parameter bytes a rank holds outside forward (1/dp) and at
its peak (the root unit + two blocks); the trainer's losses (also under pp 2 × dp 2 and ep);
checkpoints crossing ZeRO stages.

The oracle is torch.optim.AdamW + clip_grad_norm_ on the single-device model fed each step's
whole global batch; the parallel runs split it over dp ranks and two micro-batches (no_sync on
the first), as tests/parallel/test_data.py does for ZeRO-1/2.
"""

from __future__ import annotations

import contextlib
import functools
import os

import pytest
import torch

from meshspeed import comm
from meshspeed.checkpoint.dcp import read_safetensors
from meshspeed.comm import placement
from meshspeed.models import build_model, cross_entropy_loss, get_preset, recipe_for
from meshspeed.parallel.data import DataParallel
from meshspeed.parallel.materialize import build_parallel_model
from meshspeed.parallel.optim import build_data_parallel, clip_grad_norm_
from meshspeed.parallel.tensor import model_loss
from meshspeed.plan import config
from meshspeed.plan.run_plan import make_plan
from meshspeed.train.trainer import Trainer
from tests import harness
from tests.train.test_trainer import _cfg, _losses, assert_rows_close, job_rows, job_run

SEQ, MICRO, ACCUM, STEPS = 16, 12, 2, 3  # MICRO: global samples per micro-batch (divisible by 2, 3, 4)
HP = dict(lr=3e-3, weight_decay=0.5, betas=(0.9, 0.95), eps=1e-5)
MAX_NORM = 0.5  # below the model's gradient norm: clipping is active every step
DENSE = dict(n_layers=3)  # three blocks: one in the middle, prefetched and prefetching
TIED = dict(n_layers=3, tie_embeddings=True)  # one Parameter used at both ends of the root unit


def _tokens(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 256, (ACCUM * MICRO, SEQ + 1), generator=g)


@functools.cache
def reference(overrides: tuple) -> tuple:
    """Single process: first step's gradients, then per-step (norm, loss) and final parameters."""
    model = build_model(get_preset("tiny", **dict(overrides)))
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], foreach=False, **HP)
    grads, hist = None, []
    for step in range(STEPS):
        t = _tokens(step)
        loss = cross_entropy_loss(model(t[:, :-1]), t[:, 1:])
        loss.backward()
        if grads is None:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        hist.append((torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item(), loss.item()))
        opt.step()
        opt.zero_grad()
    return grads, hist, {n: p.detach().clone() for n, p in model.named_parameters()}


def _full_grads(dp: DataParallel, mesh) -> dict[str, torch.Tensor]:
    """The reduced gradient of every parameter, whole (gathered over dp from the shards, then tp)."""
    out = {}
    for i, spec in enumerate(dp.specs):
        lo, hi = dp.dp_shard(i)
        flat = comm.all_gather(dp.reduced_grad(i, lo, hi).contiguous(), dp.group_of(i))
        for s in spec.slots:
            local = flat[s.offset : s.offset + s.numel].view(s.shape)
            out[s.name] = placement.full_tensor(local, mesh, placement.sharding_of(dp.params[s.name]))
    return out


def job_parity(ctx, dp_size: int, tp: int, overrides: tuple) -> dict:
    mesh = comm.ParallelDims(dp=dp_size, tp=tp).build(ctx)
    cfg = get_preset("tiny", **dict(overrides))
    model = build_parallel_model(recipe_for(cfg), mesh, seed=0)
    dp, opt = build_data_parallel(model, mesh, zero=3, dtype=torch.float32, units="layers", **HP)
    z = dp.zero3
    rank, per = mesh.coords["dp"], MICRO // dp_size
    out: dict = {"hist": [], "empty_outside": [], "live": []}
    for step in range(STEPS):
        tokens, total = _tokens(step), 0.0
        for micro in range(ACCUM):
            rows = tokens[micro * MICRO + rank * per : micro * MICRO + (rank + 1) * per]
            with contextlib.nullcontext() if micro == ACCUM - 1 else dp.no_sync():
                loss = model_loss(model, rows[:, :-1], rows[:, 1:]) / ACCUM
                loss.backward()
            total += loss.item()
            if micro == ACCUM - 1:  # full gradient buckets still held when backward ends
                out["full_grads_after_backward"] = [not b.freed for b in dp.buckets]
            # after backward no parameter holds bytes: only the shards are left
            out["empty_outside"].append(all(p.untyped_storage().nbytes() == 0 for p in model.parameters()))
        if step == 0:
            dp.finish_grad_sync()
            grads = _full_grads(dp, mesh)  # collective: every rank takes part
            out["grads"] = grads if ctx.rank == 0 else None
        norm = clip_grad_norm_(dp, MAX_NORM, mesh).item()
        opt.step()
        opt.zero_grad()
        out["hist"].append((norm, total))  # this rank's rows' mean: averaged over dp below
        out["live"].append(z.live_param_bytes())
    peak = z.peak_bytes  # before gathered(), which holds every unit at once
    with z.gathered():
        full = {
            n: placement.full_tensor(p.detach(), mesh, placement.sharding_of(p)).clone()
            for n, p in model.named_parameters()
        }
    out["params"] = full if ctx.rank == 0 else None
    numel = {u.key: sum(dp.specs[i].numel for i in u.buckets) for u in z.units}
    out["bytes"] = {
        "all": 4 * sum(numel.values()),
        "root_and_two_blocks": 4 * (numel[""] + 2 * max(n for k, n in numel.items() if k)),
        "peak": peak,
        "shards": sum(s.nbytes for s in z.shards),
    }
    out["stats"], out["blocks"] = dict(z.stats), len(z.units) - 1
    out["state_bytes"], out["numel"] = opt.state_bytes(), sum(numel.values())
    dp.remove_hooks()
    return out


def _check_parity(results: list, overrides: tuple, dp_size: int) -> None:
    ref_grads, ref_hist, ref_params = reference(overrides)
    r0 = results[0]
    for n, want in ref_grads.items():
        assert torch.allclose(r0["grads"][n], want, rtol=1e-5, atol=1e-6), n
    losses = [sum(r["hist"][s][1] for r in results) / len(results) for s in range(STEPS)]
    assert losses == pytest.approx([loss for _, loss in ref_hist], rel=1e-5)
    for r in results:
        assert [norm for norm, _ in r["hist"]] == pytest.approx([norm for norm, _ in ref_hist], rel=1e-5)
    for n, want in ref_params.items():
        assert torch.allclose(r0["params"][n], want, rtol=1e-5, atol=1e-6), n
    for r in results:
        b = r["bytes"]
        assert all(r["empty_outside"])
        # outside forward and backward a rank holds exactly 1/dp of the (padded) parameter buckets
        assert r["live"] == [b["shards"]] * STEPS and b["shards"] * dp_size == b["all"]
        # at its peak: its shards, the root unit and two blocks (the running and the prefetched one)
        assert b["peak"] == b["shards"] + b["root_and_two_blocks"] < b["shards"] + b["all"]
        # every block but the first waited for a gather issued one block earlier, both ways
        passes = STEPS * ACCUM
        assert r["stats"]["prefetched_forward"] == passes * r["blocks"] == r["stats"]["prefetched_backward"]
        # gradients: a block's full bucket goes once the one two blocks later is launched; only the
        # last two launched (block 0 and the root) are left when backward ends
        kept = r["full_grads_after_backward"]
        assert kept == [False] * (r["blocks"] - 1) + [True, True], kept
        # fp32: the shard is the master; AdamW keeps only the two moments of 1/dp of the model
        assert r["state_bytes"] == 2 * 4 * r["numel"] // dp_size


@pytest.mark.parametrize("ws", [2, 3, 4])
def test_zero3_matches_one_process(ws):
    _check_parity(harness.run(ws, job_parity, ws, 1, tuple(DENSE.items())), tuple(DENSE.items()), ws)


def test_zero3_dp2_tp2_tied_embeddings_matches_one_process():
    overrides = tuple(TIED.items())
    results = harness.run(4, job_parity, 2, 2, overrides)
    _check_parity(results[::2], overrides, 2)  # tp ranks agree; each dp rank counted once


def job_bf16(ctx) -> dict:
    """bf16 parameters, fp32 masters and gradients: ZeRO-3 against ZeRO-2 (the same arithmetic)."""
    mesh = comm.ParallelDims(dp=ctx.world_size).build(ctx)
    out = {}
    rank, per = mesh.coords["dp"], MICRO // ctx.world_size
    for zero in (2, 3):
        model = build_model(get_preset("tiny", **DENSE))
        dp, opt = build_data_parallel(model, mesh, zero=zero, dtype=torch.bfloat16, units="layers", **HP)
        losses = []
        for step in range(STEPS):
            rows = _tokens(step)[rank * per : (rank + 1) * per]
            loss = model_loss(model, rows[:, :-1], rows[:, 1:])
            loss.backward()
            clip_grad_norm_(dp, MAX_NORM, mesh)
            opt.step()
            opt.zero_grad()
            losses.append(comm.all_reduce(loss.detach().float().reshape(1), mesh["dp"], "avg").item())
        out[zero] = losses
        if zero == 3:  # the shard a rank keeps is its fp32 master rounded to bf16
            out["shards_are_rounded_masters"] = all(
                torch.equal(dp.zero3.shards[i], st.master.bfloat16()) for i, st in enumerate(opt.shards)
            )
            out["dtypes"] = {str(s.dtype) for s in dp.zero3.shards} | {
                str(p.dtype) for p in model.parameters()
            }
        dp.remove_hooks()
    return out


def test_zero3_bf16_follows_zero2():
    for r in harness.run(2, job_bf16):
        # the same bf16 weights in every forward, the same fp32 reductions: equal losses, bit for bit
        assert r[3] == r[2] and r["shards_are_rounded_masters"], r
        assert r["dtypes"] == {"torch.bfloat16"}


# ------------------------------------------------------------------------------ errors and plan
def job_refusals(ctx) -> list[str]:
    mesh = comm.ParallelDims(dp=ctx.world_size).build(ctx)
    out = []
    for units in (None, "blocks"):
        try:
            DataParallel(build_model(get_preset("tiny")), mesh, zero=3, units=units)
        except comm.ConfigError as e:
            out.append(str(e))
    model = build_model(get_preset("tiny"))
    model.layers["1"].attention.wq.weight = model.layers["0"].attention.wq.weight
    try:
        DataParallel(model, mesh, zero=3, units="layers")
    except comm.ConfigError as e:
        out.append(str(e))
    return out


def test_zero3_refuses_without_blocks_or_with_a_parameter_shared_across_blocks():
    errs = harness.run(2, job_refusals)[0]
    assert len(errs) == 3 and all("\n" not in e for e in errs), errs
    assert "container of blocks" in errs[0] and "container of blocks" in errs[1]
    assert "shared by units 'layers.0' and 'layers.1'" in errs[2]


def test_plan_counts_one_dp_share_of_the_parameters(tmp_path):
    def mem(zero: int) -> dict:
        over = [("parallel.tp", "1"), ("parallel.zero", str(zero)), ("model.n_layers", "4")]
        over.append(("run.dir", str(tmp_path)))
        return make_plan(config.load(None, over), 4).ranks[0]["memory"]

    two, three = mem(2), mem(3)
    assert three["params"] == -(-two["params"] // 4)
    # float32: the parameters are the masters at every stage (parallel/optim.py), so ZeRO-2 and
    # ZeRO-3 both keep AdamW's two moments of a 1/dp slice (8 B per element), no master clone
    assert three["grads"] == two["grads"] and three["optimizer"] == two["optimizer"]
    assert two["params"] > three["buffers"] - two["buffers"] > 0  # the gathered blocks, less than all


# ------------------------------------------------------------------------------ trainer
MOE = [("model.preset", "tiny-moe"), ("model.n_kv_heads", "2")]


@pytest.mark.parametrize(
    "ws,extra,ref",
    [
        (2, [("parallel.tp", "1")], []),
        (4, [("parallel.tp", "2")], []),
        (4, [("parallel.tp", "2"), ("parallel.sequence_parallel", "true")], []),
        (2, [("parallel.tp", "1"), ("parallel.cp", "2")], []),
        (2, [("parallel.tp", "1"), ("memory.recompute", "full"), ("memory.chunked_loss", "true")], []),
        (2, [("parallel.tp", "1"), *MOE], MOE),
        (2, [("parallel.tp", "1"), ("parallel.ep", "2"), *MOE], MOE),  # edp 1: expert buckets whole
        (4, [("parallel.tp", "1"), ("parallel.ep", "2"), *MOE], MOE),  # edp 2: expert buckets sharded
    ],
    ids=[
        "dp2",
        "dp2-tp2",
        "dp2-tp2-sp",
        "cp2",
        "dp2-recompute-chunked-loss",
        "moe-dp2",
        "moe-ep2",
        "moe-dp4-ep2",
    ],
)
def test_trainer_losses_equal_single_process(tmp_path, ws, extra, ref):
    """Losses and gradient norms: a gradient scaled wrongly by the reduce-scatter (1/dp twice,
    or not at all) leaves AdamW's losses nearly unchanged but not the norm."""
    want = harness.run(1, job_rows, str(tmp_path / "ref"), [("parallel.tp", "1"), *ref], 4)[0]
    got = harness.run(ws, job_rows, str(tmp_path / "z3"), extra + [("parallel.zero", "3")], 4)
    assert_rows_close(got, want, "zero3")


def test_checkpoints_cross_zero3_and_zero0_or_1(tmp_path):
    """Saved under ZeRO-3, resumed under ZeRO-1; saved under ZeRO-0, resumed under ZeRO-3: both
    continue the straight run's losses, and ZeRO-3's exported weights are the straight run's."""
    base = [("parallel.tp", "1"), ("train.steps", "6"), ("checkpoint.export_safetensors", "true")]
    straight = str(tmp_path / "straight")
    harness.run(2, job_run, straight, base + [("parallel.zero", "0")])
    for first, then in (("3", "1"), ("0", "3")):
        split = str(tmp_path / f"z{first}-z{then}")
        ckpt = harness.run(2, job_run, split, base + [("parallel.zero", first), ("train.exit_interval", "3")])
        assert ckpt[0].endswith("step-000003") and len(_losses(split)) == 3
        harness.run(2, job_run, split, base + [("parallel.zero", then), ("checkpoint.resume", "latest")])
        a, b = _losses(straight), _losses(split)
        assert len(a) == len(b) == 6
        for step, (x, y) in enumerate(zip(a, b)):
            assert abs(x - y) <= 1e-5 * abs(x), f"zero {first} -> {then}, step {step}: {y} vs {x}"
    want = read_safetensors(os.path.join(straight, "model.safetensors"))[0]
    got = read_safetensors(os.path.join(str(tmp_path / "z0-z3"), "model.safetensors"))[0]
    assert set(got) == set(want)
    for n, w in want.items():
        assert torch.allclose(got[n], w, rtol=1e-5, atol=1e-6), n


# ------------------------------------------------------------------------------ pipeline
PP_MODEL = [("parallel.tp", "1"), ("model.n_layers", "4")]  # 2 blocks per pp rank, 1 per chunk at vpp 2
PP_STEPS = 3


def job_pipeline(ctx, run_dir: str, extra: list) -> dict:
    """Losses, the validation loss and the parameter bytes counted between steps (one process:
    the reference, no ZeRO-3)."""
    trainer = Trainer(_cfg(run_dir, PP_MODEL + extra + [("train.steps", str(PP_STEPS))]), ctx)
    z = trainer.dp.zero3
    out: dict = {"losses": [], "norms": [], "live": []}
    for step in range(PP_STEPS):
        row = trainer.train_step(step)
        out["losses"].append(row["loss"])
        out["norms"].append(row["grad_norm"])
        out["live"].append(z.live_param_bytes() if z else 0)
    out["val"] = trainer.validate()
    if z is not None:
        out["live"].append(z.live_param_bytes())
        out["peak"], out["gathers"], out["units"] = z.peak_bytes, z.stats["gathers"], len(z.units)
        out["shards"] = sum(s.nbytes for s in z.shards)
        out["all"] = sum(b.data.element_size() * b.spec.numel for b in trainer.dp.buckets)
        out["passes"] = PP_STEPS + trainer.val_loader.num_batches  # train steps + validation batches
    return out


def test_zero3_under_pipeline_trains_like_one_process(tmp_path):
    """pp 2 × dp 2 with 1F1B, interleaved vpp 2 and zero-bubble: losses and validation loss equal
    one process's; the stage is gathered once per step (not per micro-batch), 1/dp between steps."""
    want = harness.run(1, job_pipeline, str(tmp_path / "ref"), [])[0]
    for name, extra in (
        ("1f1b", []),
        ("interleaved-vpp2", [("parallel.vpp", "2"), ("parallel.pp_schedule", "interleaved")]),
        ("zero-bubble", [("parallel.pp_schedule", "zero-bubble")]),  # weight gradients in W, after B
    ):
        layout = [("parallel.pp", "2"), ("parallel.zero", "3"), *extra]
        got = harness.run(4, job_pipeline, str(tmp_path / name), layout)
        for r in got:
            assert r["losses"] == got[0]["losses"] and r["val"] == got[0]["val"], f"{name}: ranks disagree"
            assert_rows_close([(r["losses"], r["norms"])], (want["losses"], want["norms"]), name)
            assert abs(r["val"] - want["val"]) <= 1e-5 * abs(want["val"]), name
            # between steps (and after validation) a rank holds exactly 1/dp of its stage's buckets;
            assert r["live"] == [r["shards"]] * (PP_STEPS + 1) and 2 * r["shards"] == r["all"], name
            # within a step its whole stage, each unit gathered once per step or validation batch
            assert r["peak"] == r["shards"] + r["all"], name
            assert r["gathers"] == r["units"] * r["passes"], (name, r)


def test_plan_accepts_pp_and_counts_the_stage_gathered_through_the_step(tmp_path):
    def ranks(zero: int) -> list:
        over = [("parallel.tp", "1"), ("parallel.pp", "2"), ("parallel.zero", str(zero))]
        over += [("model.n_layers", "4"), ("run.dir", str(tmp_path))]
        return make_plan(config.load(None, over), 4).ranks

    for two, three in zip(ranks(2), ranks(3)):
        two, three = two["memory"], three["memory"]
        assert three["params"] == -(-two["params"] // 2)  # dp 2
        assert three["buffers"] - two["buffers"] == two["params"]  # the stage, held in the step
        assert three["grads"] == two["grads"]


def job_expert_shards(ctx, run_dir: str) -> dict:
    over = [("parallel.tp", "1"), ("parallel.ep", "2"), ("parallel.zero", "3"), *MOE, ("train.steps", "1")]
    trainer = Trainer(_cfg(run_dir, over), ctx)
    trainer.train_step(0)
    dp, z = trainer.dp, trainer.dp.zero3
    return {
        "groups": {spec.kind: dp.group_of(i).size for i, spec in enumerate(dp.specs)},
        "one_share": all(
            z.shards[i].numel() * dp.group_of(i).size == s.numel for i, s in enumerate(dp.specs)
        ),
        "live_is_shards": z.live_param_bytes() == sum(s.nbytes for s in z.shards),
        "buckets_per_unit": sorted({len(u.buckets) for u in z.units}),
    }


def test_zero3_shards_expert_buckets_over_edp(tmp_path):
    """dp 4 × ep 2: dense buckets 1/4 (dp), a block's expert bucket 1/2 (edp), gathered together."""
    for r in harness.run(4, job_expert_shards, str(tmp_path)):
        assert r["groups"] == {"dp": 4, "expert": 2} and r["one_share"] and r["live_is_shards"], r
        assert max(r["buckets_per_unit"]) > 1, r  # a block holds a dense and an expert bucket
