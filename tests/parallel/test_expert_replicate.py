"""Hot experts brought to the data (moe.replicate_hot): the layer's outputs and gradients equal
plain expert parallelism's and the single-device layer's, with the copies really made.

Routing is skewed on purpose (inputs leaning along one direction that the first two experts'
gates favour): experts 0 and 1 take most slots and live on member 0, so the copies go to
members that own none of the hot experts; every member routes different counts (a routing
where all members send the same rows would hide a plan made from one member's counts). K runs
from 1 to more than there are experts. The plan itself (integers only) is checked on hand-made
and Zipf-drawn counts; the setting's one-line errors are in tests/plan/test_plan.py, the
trainer's losses and expert gradient norms in tests/train/test_expert_replicate_trainer.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

from meshspeed import comm
from meshspeed.comm.placement import chunk_bounds
from meshspeed.parallel.expert import ExpertParallelMoE, expert_params
from meshspeed.parallel.expert_replicate import plan
from tests import harness
from tests.parallel.test_expert import DIM, TOKENS, _close, _config, _layer

HIDDEN = 10  # _config's moe_ffn_hidden


def _skewed(config):
    moe = _layer(config)
    with torch.no_grad():  # inputs lean along dim 0 (_inputs), and experts 0 and 1 favour it
        moe.router.gate.weight[:2, 0] += torch.tensor([2.0, 1.2])
    return moe


def _inputs(rows: int) -> torch.Tensor:
    """Routing skewed, not degenerate: every member routes a different count to each expert
    (ep 4: [7, 10, 3, 2, 1, 0, 1, 0], [8, 8, 6, 0, 1, 1, 0, 0], ...)."""
    x = torch.randn(rows, DIM, generator=torch.Generator().manual_seed(11))
    x[:, 0] += 1.5
    return x


def _run(layer, x, probe):
    x = x.clone().requires_grad_()
    out = layer(x)
    ((out * probe).sum() + layer.z_loss).backward()
    return out.detach(), x.grad


def job_replicate(ctx, n_experts: int, top_k: int, ks: list[int]) -> list[str]:
    g = ctx.world
    p, r = g.size, g.rank
    config = _config(n_experts, top_k, 1)
    ref = _skewed(config)
    x_all = _inputs(p * TOKENS)
    probe = torch.randn(p * TOKENS, DIM, generator=torch.Generator().manual_seed(12))
    rows = slice(r * TOKENS, (r + 1) * TOKENS)
    xr = x_all.clone().requires_grad_()
    out_ref = ref(xr)
    ((out_ref * probe).sum() + p * ref.z_loss).backward()  # z-loss: ep ranks of equal tokens
    lo, hi = chunk_bounds(n_experts, p)[r : r + 2]
    bad, plain = [], None
    for k in [0] + ks:  # 0: plain expert parallelism, the baseline the copies must equal
        layer = ExpertParallelMoE(copy.deepcopy(_skewed(config)), g)
        layer.replicate_hot = k
        computed = []  # rows per call of the experts' forward (a copy runs it too)
        layer.experts.register_forward_hook(lambda m, args, out: computed.append(args[0].shape[0]))
        out, xg = _run(layer, x_all[rows], probe[rows])
        expert, _ = expert_params(layer)
        grads = {n: q.grad.clone() for n, q in layer.named_parameters()}
        what = f"ep={p} K={k}"
        checks = [("output", out, out_ref.detach()[rows]), ("input grad", xg, xr.grad[rows])]
        for name, q in layer.named_parameters():
            want = ref.get_parameter(name).grad
            if any(q is e for e in expert):  # the owner's gradient, its copies' gradients included
                checks.append((name, grads[name], want[lo:hi]))
            else:  # the data-parallel reduction's sum
                checks.append((name, comm.all_reduce(grads[name].clone(), g, op="sum"), want))
        if plain is not None:  # and the same as plain ep, not only as one device
            checks += [("output vs plain ep", out, plain[0]), ("input grad vs plain ep", xg, plain[1])]
            checks += [(f"{n} vs plain ep", grads[n], plain[2][n]) for n in grads]
        for name, got, want in checks:
            if not _close(got, want):
                err = (got - want).abs().max().item() if got.shape == want.shape else "shape"
                bad.append(f"{what}: {name} max err {err}")
        if k == 0:
            plain = (out, xg, grads)
            continue
        rep = layer.last_replicas
        before, after = rep.imbalance
        if not rep.entries or not after < before:
            bad.append(f"{what}: no copy made or no balance gained: {rep.entries} {before} -> {after}")
        blocks = chunk_bounds(n_experts, p)  # experts 0 and 1, the hot ones, are member 0's
        if not any(e < 2 and blocks[s] >= 2 for e, _, s in rep.entries):
            bad.append(f"{what}: no hot expert copied to a member owning none of them: {rep.entries}")
        if rep.weight_bytes != len(rep.entries) * 3 * HIDDEN * DIM * 4:
            bad.append(f"{what}: weight bytes {rep.weight_bytes} for {len(rep.entries)} copies")
        if layer.replication.weight_bytes != rep.weight_bytes:  # what the metrics row reports
            bad.append(f"{what}: the step's tally has {layer.replication.weight_bytes} weight bytes")
        if sum(rep.before) != sum(rep.after) or layer.replication.forwards != 1:
            bad.append(f"{what}: rows not conserved {rep.before} -> {rep.after}")
        # this member's experts and copies computed exactly the rows the plan gives it
        if sum(computed) != rep.after[r] or (k and len(computed) != 1 + any(s == r for *_, s in rep.entries)):
            bad.append(f"{what}: member {r} computed {computed} rows, the plan says {rep.after[r]}")
    return bad


@pytest.mark.parametrize("ep", [2, 3, 4])
def test_replicated_hot_experts_equal_plain_expert_parallelism(ep):
    # 8 experts, top 2 (at ep 3 blocks of 3, 3, 2); member 0 owns the two hot ones;
    # K = 1, 2 and 11 > 8 experts
    assert harness.run(ep, job_replicate, 8, 2, [1, 2, 11]) == [[]] * ep


def test_plan_on_hand_made_counts():
    # 4 experts over 2 members (0: experts 0-1, 1: experts 2-3); expert 0 is hot and member 1
    # routes 29 rows to it: computing them there takes member 0 from 50 rows to 21, member 1
    # from 10 to 39
    counts = torch.tensor([[20, 0, 10, 0], [29, 1, 0, 0]])
    rep = plan(counts, [0, 2, 4], k=1)
    assert rep.entries == [(0, 0, 1)] and rep.before == [50, 10] and rep.after == [21, 39]
    assert rep.counts.tolist() == [[20, 0, 10, 0], [0, 1, 0, 0]] and rep.rows_kept == 29
    # a copy that would leave member 1 as busy as member 0 was (25 + 30 >= 50) is not made
    assert plan(torch.tensor([[20, 0, 10, 0], [30, 0, 25, 0]]), [0, 2, 4], k=1).entries == []
    # K beyond the experts that carry rows: the same copies, every one a run that exists
    many = plan(counts, [0, 2, 4], k=100)
    assert sum(many.after) == sum(many.before) and all(counts[s, e] > 0 for e, _, s in many.entries)
    assert max(many.after) <= max(rep.after)
    assert plan(torch.zeros(2, 4, dtype=torch.long), [0, 2, 4], k=3).entries == []
    # the member receiving a copy owns none of the hot experts; the busiest member gives first
    three = plan(torch.tensor([[40, 0, 0], [30, 1, 0], [30, 0, 1]]), [0, 1, 2, 3], k=2)
    assert three.entries == [(0, 0, 1), (0, 0, 2)] and three.after == [40, 31, 31]


@pytest.mark.parametrize("ep,n_experts,zipf", [(2, 8, 1.0), (3, 8, 1.0), (4, 8, 1.5), (4, 16, 1.2)])
def test_zipf_routing_is_balanced_to_within_1_2(ep, n_experts, zipf):
    """Counted, so exact: Zipf-drawn routing (each member 2048 slots) at max/mean rows per member
    of 1.5 to 2.8 comes to at most 1.2 with K = 4."""
    w = torch.tensor([1 / (i + 1) ** zipf for i in range(n_experts)])
    draws = [torch.multinomial(w, 2048, True, generator=torch.Generator().manual_seed(r)) for r in range(ep)]
    counts = torch.stack([d.bincount(minlength=n_experts) for d in draws])
    before, after = plan(counts, chunk_bounds(n_experts, ep), k=4).imbalance
    assert before > 1.5 and after <= 1.2, (before, after)
