"""Expert parallelism against the single-device MoE layer, forward and gradients.

Every rank builds the same MoE layer from one seed and the same global batch. The reference
runs the single-device layer on all tokens; the parallel layer on each rank gets its own rows
(ep ranks are data-parallel ranks) and the experts of its block. Compared: this rank's output
rows, this rank's input-gradient rows, its experts' gradients against the matching slice of
the reference, and the replicated parameters' gradients summed over ranks (the dp reduction).

The loss is sum(out * probe) + z_loss: the z-loss (a mean over tokens) gives the router
gradients on experts that no token reaches; summed over ranks of equal token counts it is
ep times the single-device z-loss, so the reference weights its z-loss by ep.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from meshspeed import comm
from meshspeed.comm.placement import chunk_bounds, full_grad, sharding_of
from meshspeed.models.config import ModelConfig
from meshspeed.models.moe import MoE
from meshspeed.parallel.expert import ExpertParallelMoE, expert_parallel, expert_params, sync_grads
from meshspeed.parallel.expert_comm import source_to_expert_order
from tests import harness

DIM, TOKENS = 16, 12  # tokens per rank


def _config(n_experts: int, top_k: int, shared: int) -> ModelConfig:
    return ModelConfig(
        dim=DIM, n_layers=1, n_heads=2, vocab_size=32, n_experts=n_experts, top_k=top_k,
        n_shared_experts=shared, moe_ffn_hidden=10, moe_impl="loop",
    )  # fmt: skip


def _layer(config: ModelConfig, starve_last: int = 0) -> MoE:
    torch.manual_seed(5)
    moe = MoE(config)
    with torch.no_grad():
        for w in (moe.router.gate.weight, moe.experts.w1, moe.experts.w2, moe.experts.w3):
            w.normal_(0, 0.3)
        if starve_last:  # positive inputs, negative gates: no token picks the last experts
            g = moe.router.gate.weight
            g.copy_(g.abs() + 0.1)
            g[-starve_last:] = -g[-starve_last:]
    return moe


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    scale = max(1.0, b.abs().max().item()) if b.numel() else 1.0
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6 * scale)


def job_parity(ctx, n_experts: int, top_k: int, shared: int, dispatcher: str, starve_last: int) -> list[str]:
    g = ctx.world
    p, r = g.size, g.rank
    config = _config(n_experts, top_k, shared)
    ref = _layer(config, starve_last)
    moe = copy.deepcopy(ref)
    x_all = torch.randn(p * TOKENS, DIM, generator=torch.Generator().manual_seed(11))
    if starve_last:
        x_all = x_all.abs()
    probe = torch.randn(p * TOKENS, DIM, generator=torch.Generator().manual_seed(12))

    xr = x_all.clone().requires_grad_()
    out_ref = ref(xr)
    ((out_ref * probe).sum() + p * ref.z_loss).backward()
    ref_grads = {n: q.grad for n, q in ref.named_parameters()}

    rows = slice(r * TOKENS, (r + 1) * TOKENS)
    layer = ExpertParallelMoE(moe, g, dispatcher)
    x = x_all[rows].clone().requires_grad_()
    out = layer(x)
    ((out * probe[rows]).sum() + layer.z_loss).backward()

    bad = []
    if not _close(out.detach(), out_ref.detach()[rows]):
        bad.append(f"output max err {(out - out_ref[rows]).abs().max().item()}")
    if not _close(x.grad, xr.grad[rows]):
        bad.append(f"input grad max err {(x.grad - xr.grad[rows]).abs().max().item()}")
    lo, hi = chunk_bounds(n_experts, p)[r : r + 2]
    expert, other = expert_params(layer)
    if len(expert) != 3:
        bad.append(f"{len(expert)} expert parameters tagged ep, want 3")
    for name, q in layer.named_parameters():
        want = ref_grads[name]
        if any(q is e for e in expert):
            if sharding_of(q).full_shape != want.shape:
                bad.append(f"{name}: full shape {sharding_of(q).full_shape} != {want.shape}")
            if not _close(q.grad, want[lo:hi]):
                bad.append(f"{name}: expert grad max err {(q.grad - want[lo:hi]).abs().max().item()}")
            if not _close(full_grad(q, {"ep": g}), want):  # the tag reassembles the full gradient
                bad.append(f"{name}: full_grad differs")
        else:
            got = comm.all_reduce(q.grad.clone(), g, op="sum")  # the dp reduction
            if not _close(got, want):
                bad.append(f"{name}: grad max err {(got - want).abs().max().item()}")
    if starve_last and layer.tokens_per_expert[-starve_last:].sum() != 0:
        bad.append("the starved experts were routed to (the test forces none)")
    if starve_last and r == p - 1:
        if any(q.grad.abs().max().item() != 0 for q in expert):
            bad.append("a rank with no tokens has nonzero expert gradients")
    return bad


@pytest.mark.parametrize("ep", [2, 3, 4])
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_expert_parallel_matches_single_device(ep, dispatcher):
    # Mixtral-like (few experts, top 2) and fine-grained (8 experts, top 3, 2 shared experts
    # as in DeepSeekMoE); at ep 3 the blocks are uneven: 5 -> (2, 2, 1), 8 -> (3, 3, 2).
    for n_experts, top_k, shared in ((4 if ep != 3 else 5, 2, 0), (8, 3, 2)):
        got = harness.run(ep, job_parity, n_experts, top_k, shared, dispatcher, 0)
        assert got == [[]] * ep, f"E={n_experts} k={top_k} shared={shared}"


@pytest.mark.parametrize("ep", [2, 4])
def test_rank_receiving_no_tokens(ep):
    # At ep 2 the last member's two experts, at ep 4 the last member's one expert, get no
    # tokens: no hang, zero expert gradients there, router gradients still right.
    starve = 4 // ep
    assert harness.run(ep, job_parity, 4, 2, 1, "alltoall", starve) == [[]] * ep


def job_model_swap(ctx) -> list[str]:
    layer = _layer(_config(4, 2, 0))
    wrapper = torch.nn.Sequential(torch.nn.Identity(), layer)
    expert_parallel(wrapper, ctx.world)
    bad = [] if isinstance(wrapper[1], ExpertParallelMoE) else ["MoE not replaced"]
    if (
        wrapper[1].experts.w1.shape[0]
        != chunk_bounds(4, ctx.world.size)[ctx.world.rank + 1]
        - chunk_bounds(4, ctx.world.size)[ctx.world.rank]
    ):
        bad.append("wrong local expert count")
    return bad


def test_expert_parallel_replaces_layers():
    assert harness.run(2, job_model_swap) == [[], []]


def test_source_to_expert_order():
    # 2 sources x 2 local experts: rows [s0e0 s0e0 s0e1 s1e0 s1e1 s1e1] -> expert-major.
    runs = torch.tensor([[2, 1], [1, 2]])
    assert source_to_expert_order(runs).tolist() == [0, 1, 3, 2, 4, 5]


def test_too_many_ranks_is_one_line_error():
    layer = _layer(_config(2, 1, 0))
    fake = type("G", (), {"size": 4, "rank": 0})()
    with pytest.raises(ValueError, match=r"parallel.ep=4 leaves an empty piece .* valid ep: 1, 2$"):
        ExpertParallelMoE(layer, fake)


def job_expert_data_parallel(ctx, ep: int) -> list[str]:
    """dp = world, ep < dp: expert gradients reduced over the expert-data-parallel group."""
    mesh = comm.ParallelDims(dp=ctx.world_size, ep=ep).build(ctx)
    p, r = ctx.world_size, ctx.rank
    ref = _layer(_config(4, 2, 1))
    layer = ExpertParallelMoE(copy.deepcopy(ref), mesh["ep"])
    x_all = torch.randn(p * TOKENS, DIM, generator=torch.Generator().manual_seed(11))
    probe = torch.randn(p * TOKENS, DIM, generator=torch.Generator().manual_seed(12))
    # every rank's loss is the mean over its tokens; the reference is the mean over all tokens
    ((ref(x_all) * probe).sum(-1).mean() + ref.z_loss).backward()
    rows = slice(r * TOKENS, (r + 1) * TOKENS)
    ((layer(x_all[rows]) * probe[rows]).sum(-1).mean() + layer.z_loss).backward()
    sync_grads(layer, mesh)
    ref_grads = dict(ref.named_parameters())
    bad = []
    for name, q in layer.named_parameters():
        want = ref_grads[name].grad
        got = full_grad(q, {"ep": mesh["ep"]})
        if not _close(got, want):
            bad.append(f"{name}: grad max err {(got - want).abs().max().item()}")
    return bad


@pytest.mark.parametrize("world,ep", [(4, 2), (2, 1), (4, 4)])
def test_expert_data_parallel_gradients(world, ep):
    assert harness.run(world, job_expert_data_parallel, ep) == [[]] * world


def _kept(experts: torch.Tensor, n_experts: int, cap: int) -> torch.Tensor:
    """[tokens, k] keep mask: per expert, its first `cap` slots in (token, k) order."""
    seen = [0] * n_experts
    keep = torch.zeros(experts.shape, dtype=torch.bool)
    for t in range(experts.shape[0]):
        for j in range(experts.shape[1]):
            e = int(experts[t, j])
            keep[t, j] = seen[e] < cap
            seen[e] += 1
    return keep


def job_capacity(ctx, cf: float) -> list[str]:
    """Capacity factor against the single-device layer with dropped slots weighted zero."""
    g = ctx.world
    p, r = g.size, g.rank
    n_experts, k = 4, 2
    ref = _layer(_config(n_experts, k, 1))
    layer = ExpertParallelMoE(copy.deepcopy(ref), g, capacity_factor=cf)
    x_all = torch.randn(p * TOKENS, DIM, generator=torch.Generator().manual_seed(11))
    probe = torch.randn(p * TOKENS, DIM, generator=torch.Generator().manual_seed(12))
    weights, experts, logits = ref.router(x_all)
    cap = math.ceil(cf * TOKENS * k / n_experts)  # per rank, from its own slots
    keep = torch.cat([_kept(e, n_experts, cap) for e in experts.split(TOKENS)])
    counts = torch.bincount(experts.flatten(), minlength=n_experts)
    out_ref = ref.routed(x_all, weights * keep, experts, counts) + ref.shared_expert(x_all)
    z = torch.logsumexp(logits, -1).pow(2).mean()
    ((out_ref * probe).sum() + p * z).backward()
    rows = slice(r * TOKENS, (r + 1) * TOKENS)
    out = layer(x_all[rows])
    ((out * probe[rows]).sum() + layer.z_loss).backward()
    bad = [] if _close(out.detach(), out_ref.detach()[rows]) else ["output differs"]
    if cf < 1 and bool(keep.all()):
        bad.append("nothing dropped: the test would not test dropping")
    expert, _ = expert_params(layer)
    lo, hi = chunk_bounds(n_experts, p)[r : r + 2]
    ref_grads = dict(ref.named_parameters())
    for name, q in layer.named_parameters():
        want = ref_grads[name].grad
        if any(q is e for e in expert):
            got, want = q.grad, want[lo:hi]
        else:
            got = comm.all_reduce(q.grad.clone(), g, op="sum")
        if not _close(got, want):
            bad.append(f"{name}: grad max err {(got - want).abs().max().item()}")
    return bad


@pytest.mark.parametrize("ep", [2, 4])
def test_capacity_factor_drops_overflow(ep):
    for cf in (0.5, 1.0, 4.0):  # heavy drops, some, none
        assert harness.run(ep, job_capacity, cf) == [[]] * ep, f"capacity_factor={cf}"


def job_overlap_same(ctx) -> list[str]:
    """The shared expert computed while the dispatch is in flight (moe.overlap_shared) gives the
    same output and gradients as computed after it, and the overlapped path did run: with it on,
    the shared expert runs between the dispatch's launch and its land."""
    g = ctx.world
    config = _config(8, 3, 2)
    x_all = torch.randn(g.size * TOKENS, DIM, generator=torch.Generator().manual_seed(11))
    rows = slice(g.rank * TOKENS, (g.rank + 1) * TOKENS)
    results, events = [], {}
    import meshspeed.parallel.expert_comm as xc

    real_launch, real_land = xc.launch, xc.land
    for overlap in (True, False):
        layer = ExpertParallelMoE(_layer(config), g, "alltoall")
        layer.overlap_shared = overlap
        seen = events[overlap] = []
        layer.shared_expert.register_forward_hook(lambda *_, s=seen: s.append("shared"))
        x = x_all[rows].clone().requires_grad_()
        xc.launch = lambda *a, s=seen: (s.append("launch"), real_launch(*a))[1]
        xc.land = lambda *a, s=seen: (s.append("land"), real_land(*a))[1]
        try:
            out = layer(x)
            (out.square().sum() + layer.z_loss).backward()
        finally:
            xc.launch, xc.land = real_launch, real_land
        results.append([out.detach(), x.grad] + [q.grad for q in layer.parameters()])
    bad = [f"tensor {i} differs" for i, (a, b) in enumerate(zip(*results)) if not torch.equal(a, b)]
    if events[True][:3] != ["launch", "shared", "land"] or events[False][:3] != ["launch", "land", "launch"]:
        bad.append(f"call order {events}, want the shared expert inside the dispatch with overlap only")
    return bad


@pytest.mark.parametrize("ep", [2, 3])
def test_shared_expert_overlap_is_exact(ep):
    assert harness.run(ep, job_overlap_same) == [[]] * ep
