"""DualPipeV and the forward-backward overlap in the pipeline runtime, against one process.

- Every run equals the single-device loss and gradients (float32, 1e-5 relative): DualPipeV
  alone, with the overlap, with expert parallelism (pp 2 × ep 2), with tp, with ZeRO-1 (whose
  reduced gradients stay readable; ZeRO-2 is checked on the trainer's losses).
- The overlap changes only the order in which two independent computations are issued: losses
  are bitwise those of the same schedule without it (forwards run on the calling thread either
  way); gradients agree to float32 rounding, because the backward runs on a helper thread and
  MKL rounds some small matmuls differently per thread (MKL_CBWR=AUTO makes them bitwise too).
  And it did overlap: pairs ran, and with experts the two sides handed over at the all-to-alls.

Router losses are off in the MoE runs (NO_AUX): with dp 2 each rank's aux loss is over its
own tokens, a different function from one process's over the whole micro-batch.
"""

from __future__ import annotations

import pytest
import torch

from meshspeed import comm
from meshspeed.comm.placement import full_grad
from meshspeed.models import build_model, cross_entropy_loss, get_preset, recipe_for
from meshspeed.parallel.expert import expert_parallel
from meshspeed.parallel.expert_tp import expert_tensor_parallel
from meshspeed.parallel.optim import build_data_parallel
from meshspeed.parallel.pipeline.runtime import PipelineRuntime
from meshspeed.parallel.pipeline.schedules import get_schedule
from meshspeed.parallel.pipeline.stage import build_stages
from tests import harness

MICRO, SEQ, M = 2, 8, 4  # micro-batch rows, sequence length, micro-batches per step (2 * pp)
NO_AUX = dict(aux_loss_coef=0.0, z_loss_coef=0.0)
MODELS = {
    "tiny": dict(n_layers=4, dim=32, n_heads=4, n_kv_heads=2),
    "tiny-moe": dict(n_layers=4, dim=32, n_heads=4, n_kv_heads=2, moe_ffn_hidden=16, **NO_AUX),
}


def _batch(rows: int):
    t = torch.randint(0, 256, (rows, SEQ + 1), generator=torch.Generator().manual_seed(3))
    return t[:, :-1], t[:, 1:]


def job_runs(ctx, dims: dict, preset: str, runs: list):
    """Per run (schedule, overlap, zero): (mean loss over the global batch, this rank's full
    gradients or None on tp/dp peers, overlapped pairs run, hand-overs)."""
    cfg = get_preset(preset, **MODELS[preset])
    mesh = comm.ParallelDims(**dims).build(ctx)
    n_dp, r = mesh.dims.dp, mesh.coords["dp"]
    x, y = _batch(M * n_dp * MICRO)
    rows = [slice((a * n_dp + r) * MICRO, (a * n_dp + r + 1) * MICRO) for a in range(M)]
    micro = [(x[s], y[s]) for s in rows]

    def experts(model):
        if mesh.dims.tp > 1:
            return expert_tensor_parallel(model, mesh["ep"], mesh["tp"], "split")
        return expert_parallel(model, mesh["ep"])

    out = []
    for name, overlap, zero in runs:
        vpp = 2 if get_schedule(name).interleaved else 1
        stages = build_stages(
            recipe_for(cfg),
            mesh,
            vpp=vpp,
            seed=0,
            placement=get_schedule(name).placement,
            transform=experts if cfg.n_experts else None,
        )
        dp, _ = build_data_parallel(stages.model, mesh, dtype=torch.float32, zero=zero)
        rt = PipelineRuntime(stages, mesh, name, M, micro_batch_size=MICRO, seq_len=SEQ, overlap=overlap)
        total = rt.train_step(micro, dp)
        dp.finish_grad_sync()
        loss = comm.all_reduce(total / M, mesh["dp"], "avg").item()
        grads = {n: full_grad(p, mesh) for n, p in stages.model.named_parameters()}
        val = comm.all_reduce(rt.evaluate(micro) / M, mesh["dp"], "avg").item()
        dp.remove_hooks()
        keep = mesh.coords["tp"] == 0 and r == 0
        handed = sum(d.switches for d in rt.last_duets)
        out.append((name, overlap, zero, loss, val, grads if keep else None, len(rt.last_duets), handed))
    return out


def _reference(preset: str, n_dp: int):
    model = build_model(get_preset(preset, **MODELS[preset]), seed=0)
    x, y = _batch(M * n_dp * MICRO)
    loss = cross_entropy_loss(model(x), y)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _check(results, preset: str, n_dp: int) -> dict:
    """Every run against one process; returns {(name, overlap, zero): rank 0's run} for more."""
    want_loss, want = _reference(preset, n_dp)
    for per_rank in zip(*results):
        name, overlap, zero = per_rank[0][:3]
        what = f"{name} overlap={overlap} zero={zero}"
        seen = set()
        for _, _, _, loss, val, grads, _, _ in per_rank:
            assert abs(loss - want_loss) <= 1e-5 * abs(want_loss), f"{what}: loss {loss} vs {want_loss}"
            assert abs(val - want_loss) <= 1e-5 * abs(want_loss), f"{what}: evaluate {val} vs {want_loss}"
            for fqn, g in (grads or {}).items():
                seen.add(fqn)
                err = ((g - want[fqn]).norm() / want[fqn].norm()).item()
                assert err <= 1e-5, f"{what}: {fqn} gradient off by {err:.2e} relative"
        assert seen == set(want), f"{what}: gradients missing for {sorted(set(want) - seen)[:4]}"
    return {run[:3]: run for run in results[0]}


def _same(a, b) -> None:
    """The overlapped run against the plain one: the same loss bit for bit, gradients to float32
    rounding (module docstring)."""
    assert a[3] == b[3], f"loss {a[3]} vs {b[3]}"
    for fqn, g in (a[5] or {}).items():
        err = ((g - b[5][fqn]).norm() / b[5][fqn].norm().clamp(min=1e-30)).item()
        assert err <= 1e-6, f"{fqn} differs with the overlap by {err:.2e} relative"


def test_dualpipev_and_overlap_match_one_process_pp2():
    runs = [("dualpipev", False, 0), ("dualpipev", True, 0), ("1f1b", False, 0)]
    got = _check(harness.run(2, job_runs, {"pp": 2}, "tiny", runs), "tiny", 1)
    _same(got[("dualpipev", True, 0)], got[("dualpipev", False, 0)])
    assert got[("dualpipev", True, 0)][6] > 0  # pairs ran (a dense model has nothing to hand over)


@pytest.mark.parametrize(
    "dims,zero",
    [({"pp": 2, "dp": 2, "ep": 2}, 0), ({"pp": 2, "dp": 2, "ep": 2}, 1), ({"pp": 2, "tp": 2}, 0)],
    ids=["pp2-ep2", "pp2-ep2-zero1", "pp2-tp2"],
)
def test_moe_overlap_is_exact_and_hands_over(dims, zero):
    """pp 2 × ep 2 (and tp 2, the experts split over tp): DualPipeV with and without the
    overlap, and 1F1B, all equal one process; the overlapped step handed over at the
    exchanges."""
    runs = [("dualpipev", True, zero), ("dualpipev", False, zero)]
    ws = dims["pp"] * dims.get("dp", 1) * dims.get("tp", 1)
    results = harness.run(ws, job_runs, dims, "tiny-moe", runs)
    got = _check(results, "tiny-moe", dims.get("dp", 1))
    _same(got[("dualpipev", True, zero)], got[("dualpipev", False, zero)])
    if dims.get("ep", 1) > 1:
        assert all(run[0][7] > 0 for run in results), "no hand-over at the all-to-alls"
