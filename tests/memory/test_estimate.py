"""The activation estimator (meshspeed.memory.estimate) against the bytes counted with
saved-tensor hooks: dense and MoE models, every recompute mode, single device, tp 2 / 3 with
and without sequence parallelism, and expert parallelism (ep 2 / 3), within 10%."""

from __future__ import annotations

import pytest
import torch

from meshspeed import comm
from meshspeed.memory import RECOMPUTE_MODES, apply_recompute, chunked_model_loss, count_saved
from meshspeed.memory.estimate import model_activation_bytes
from meshspeed.models import build_model, cross_entropy_loss, get_preset, recipe_for
from meshspeed.parallel.expert import expert_parallel
from meshspeed.parallel.tensor import loss_fn, model_loss, parallelize
from tests import harness

CONFIGS = (
    (
        "tiny",
        dict(dim=96, n_layers=2, n_heads=24, n_kv_heads=12, vocab_size=256, ffn_hidden=102, max_seq_len=32),
    ),
    (
        "tiny",
        dict(dim=96, n_layers=3, n_heads=12, n_kv_heads=6, vocab_size=384, ffn_hidden=160, max_seq_len=32),
    ),
    # MoE: Mixtral-like with a shared expert, and fine-grained (softmax before top-k, first layer dense)
    (
        "tiny-moe",
        dict(dim=96, n_heads=6, n_kv_heads=6, n_experts=6, vocab_size=256, max_seq_len=32, moe_impl="loop"),
    ),
    ("tiny-fine-moe", dict(dim=96, n_heads=6, n_kv_heads=6, vocab_size=256, max_seq_len=32, moe_impl="loop")),
)
BATCH, SEQ = 2, 24


def _errors(mesh=None, sp: bool = False, ep=None) -> list[str]:
    bad = []
    tp = 1 if mesh is None else mesh["tp"].size
    for preset, overrides in CONFIGS:
        if ep is not None and preset == "tiny":
            continue
        config = get_preset(preset, **overrides)
        gen = torch.Generator().manual_seed(5 + (ep.rank if ep is not None else 0))
        tokens = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=gen)
        counted = []
        for mode, layers in [(m, None) for m in RECOMPUTE_MODES] + [("full", 1)]:
            model = build_model(config, seed=3)
            if ep is not None:
                expert_parallel(model, ep)
            elif mesh is not None:
                model = parallelize(model, mesh, recipe_for(config), sequence_parallel=sp)
            apply_recompute(model, mode, layers)
            with count_saved(model) as c:
                if mesh is None or ep is not None:
                    cross_entropy_loss(model(tokens), tokens)
                else:
                    model_loss(model, tokens, tokens)
            est = model_activation_bytes(
                config, tokens=BATCH * SEQ, mode=mode, layers=layers, tp=tp, sequence_parallel=sp
            )
            counted_bytes = c.bytes
            if ep is not None:
                # What a rank receives depends on the routing; summed over the ep ranks the
                # slots are exactly ep·T·k, what the estimate assumes per rank.
                counted_bytes = int(comm.all_reduce(torch.tensor([c.bytes]), ep, op="sum")) // ep.size
            if abs(est - counted_bytes) > 0.1 * counted_bytes:
                bad.append(
                    f"{preset} {mode}/{layers} tp {tp} sp {sp} ep {ep and ep.size}: estimate {est}, "
                    f"counted {counted_bytes}"
                )
            if layers is None:
                counted.append(counted_bytes)
        if not all(a > b for a, b in zip(counted, counted[1:])):
            bad.append(f"counted bytes do not fall none > activation > selective > full: {counted}")
    return bad


def test_estimate_matches_count_single_device():
    assert _errors() == []


def job(ctx, sp: bool) -> list[str]:
    return _errors(comm.ParallelDims(tp=ctx.world.size).build(ctx), sp)


@pytest.mark.parametrize("tp", [2, 3])
def test_estimate_matches_count_tensor_parallel(tp):
    for sp in (False, True):
        assert harness.run(tp, job, sp) == [[]] * tp, f"sp={sp}"


def job_ep(ctx) -> list[str]:
    return _errors(ep=ctx.world)


@pytest.mark.parametrize("ep", [2, 3])
def test_estimate_matches_count_expert_parallel(ep):
    assert harness.run(ep, job_ep) == [[]] * ep


def job_chunked(ctx, sp: bool) -> list[str]:
    """memory.chunked_loss keeps no logits but the fused head's d weight [vocab/tp, dim]: the
    estimate, counted within 10%. (Fewer bytes than the logits only when tokens > dim: not at
    these sizes, so that is not asserted.)"""
    mesh = comm.ParallelDims(tp=ctx.world.size).build(ctx) if ctx.world.size > 1 else None
    tp = ctx.world.size
    config = get_preset("tiny", vocab_size=512, n_heads=4, n_kv_heads=4, max_seq_len=32)
    tokens = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(5))
    model = build_model(config, seed=3)
    if mesh is not None:
        model = parallelize(model, mesh, recipe_for(config), sequence_parallel=sp)
    with count_saved(model) as c:
        chunked_model_loss(model, lambda: model(tokens), tokens, loss_fn(model), 7, tp if sp else 1)
    est = model_activation_bytes(config, tokens=BATCH * SEQ, tp=tp, sequence_parallel=sp, chunked=True)
    full = model_activation_bytes(config, tokens=BATCH * SEQ, tp=tp, sequence_parallel=sp)
    if abs(est - c.bytes) > 0.1 * c.bytes:
        return [f"tp {tp} sp {sp}: chunked estimate {est} (full logits {full}), counted {c.bytes}"]
    return []


@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (2, True)])
def test_estimate_matches_count_with_chunked_loss(tp, sp):
    assert harness.run(tp, job_chunked, sp) == [[]] * tp
