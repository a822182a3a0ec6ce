"""Each term of the planner's predicted step (`predict_step`), in a layout where it is not hidden.

tests/plan/test_planner.py checks the ranking of layouts; here each part of one prediction is
computed another way and compared:
- compute: the model's FLOPs from the published formula (6 per matmul parameter per token, the
  parameters counted on the model's own Linear modules, plus 12·L·H·Q·T for attention), at the
  machine's achievable rates; the tile term as documented (a matmul at `tile` rows runs at half
  rate, so at `tile` rows *and* columns at a quarter);
- bubble: 1F1B idles (pp − 1) micro-batch slots per stage, so it adds (pp − 1) / m of compute;
- comm: each collective written out from the α-β formulas of the textbook algorithms the
  backend's op behaves like (ring all-gather, ring reduce-scatter, ring all-reduce, pairwise
  all-to-all), with the machine's links (α doubled across nodes): every group crosses nodes
  here (one device per node), on a slow link so that the overlapped terms (cp's ring behind
  attention, dp's reduce-scatter behind the last backward) stick out by much more than the
  compute that may hide them;
- optimizer: about 30 bytes per parameter the rank updates, at memory bandwidth.
bfloat16 throughout, so that a float32 gradient's 4 bytes differ from a parameter's 2.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from meshspeed.comm.recipe import build_on_meta
from meshspeed.models import recipe_for
from meshspeed.plan import config
from meshspeed.plan.machine import MACHINES
from meshspeed.plan.planner import predict_step
from meshspeed.plan.run_plan import make_plan

SEQ, MBS, GBS = 32, 2, 8
BASE = [
    ("train.seq_len", str(SEQ)),
    ("train.micro_batch_size", str(MBS)),
    ("train.global_batch_size", str(GBS)),
    ("train.dtype", "bfloat16"),
    ("parallel.tp", "1"),
]
ELEM = 2  # bfloat16
INTER_GBS = 1e-3  # 1 MB/s between nodes: communication dwarfs every compute term
# an H100 per node; tile 0: no occupancy charge unless a test sets one
MACHINE = dataclasses.replace(MACHINES["h100"], gpus_per_node=1, inter_gbs=INTER_GBS, tile=1e-12)
ALPHA = 2 * MACHINE.alpha_us * 1e-6  # across nodes: twice the per-message latency
BETA = 1 / (INTER_GBS * 1e9)
GAMMA = 1 / (MACHINE.mem_bw_gbs * 1e9)


def _plan(*over, world=2):
    cfg = config.load(None, BASE + list(over))
    return cfg, make_plan(cfg, world, ranks=False, local_gpus=0, local_ranks=0)


def _model(plan):
    with torch.device("meta"):
        return build_on_meta(recipe_for(plan.model_config()))


def _params(plan) -> int:
    return sum(p.numel() for p in _model(plan).parameters())


def _compute(plan, machine=MACHINE) -> float:
    """Seconds of matmuls and attention per step and rank at the achievable rates (no tile)."""
    return sum(_compute_parts(plan, machine))


def _compute_parts(plan, machine=MACHINE) -> tuple[float, float]:
    """(matmuls, attention core) seconds per step and rank."""
    c = plan.model_config()
    linear = sum(m.weight.numel() for m in _model(plan).modules() if isinstance(m, nn.Linear))
    tokens = GBS * SEQ / plan.world_size
    mm = 6 * linear * tokens
    attn = 12 * c.n_layers * c.n_heads * c.head_dim * SEQ * tokens
    peak = machine.peak_tflops * 1e12
    return mm / (peak * machine.matmul_eff), attn / (peak * machine.attn_eff)


# one call of each collective on p ranks, one per node, of n bytes (the output for all-gather,
# the input for reduce-scatter and all-to-all, the buffer for all-reduce)
def ring_all_gather(p, n):
    return (p - 1) * ALPHA + (p - 1) / p * n * BETA


def ring_reduce_scatter(p, n):  # nccl's: one pass around the ring, reducing as it goes
    return (p - 1) * ALPHA + (p - 1) / p * n * (BETA + GAMMA)


def ring_all_reduce(p, n):  # reduce-scatter then all-gather
    return 2 * (p - 1) * ALPHA + 2 * (p - 1) / p * n * BETA + (p - 1) / p * n * GAMMA


def pairwise_all_to_all(p, n):
    return (p - 1) * ALPHA + (p - 1) / p * n * BETA


def _check_sum(pred):
    parts = pred["compute_s"] + pred["bubble_s"] + sum(pred["comm_s"].values()) + pred["optimizer_s"]
    assert pred["step_s"] == pytest.approx(parts, rel=1e-12)
    assert pred["tokens_per_s"] == pytest.approx(GBS * SEQ / pred["step_s"], rel=1e-12)


def test_compute_optimizer_and_no_comm_on_one_rank():
    cfg, plan = _plan(world=1)
    params = _params(plan)
    pred = predict_step(cfg, plan, MACHINE, params)
    assert pred["comm_s"] == {} and pred["bubble_s"] == 0
    assert pred["compute_s"] == pytest.approx(_compute(plan), rel=1e-9)
    assert pred["optimizer_s"] == pytest.approx(30 * params / (MACHINE.mem_bw_gbs * 1e9), rel=1e-12)
    _check_sum(pred)
    # the tile: 64 tokens per micro-batch and 128 columns, at tiles of 64 and 128 rows
    assert MBS * SEQ == 64 and plan.model_config().dim == 128
    for tile, slower in ((64, 2 * (128 + 64) / 128), (128, (64 + 128) / 64 * 2)):
        tiled = predict_step(cfg, plan, dataclasses.replace(MACHINE, tile=tile), params)
        assert tiled["compute_s"] == pytest.approx(_compute(plan) * slower, rel=1e-9), tile


def test_full_recompute_adds_a_forward():
    cfg, plan = _plan(("memory.recompute", "full"), world=1)
    pred = predict_step(cfg, plan, MACHINE, _params(plan))
    assert pred["compute_s"] == pytest.approx(_compute(plan) * 4 / 3, rel=1e-9)  # 3 passes -> 4


def test_dp_reduce_scatters_float32_gradients_and_gathers_parameters():
    """ZeRO-1 at dp 2: the reduce-scatter moves the float32 gradients (4 B each), the all-gather
    the bf16 parameters (2 B); the reduce-scatter hides behind the last micro-batch's backward
    (2/3 of its compute), the all-gather after the step does not."""
    cfg, plan = _plan(("parallel.zero", "1"))
    params, m = _params(plan), plan.microbatches
    pred = predict_step(cfg, plan, MACHINE, params)
    assert set(pred["comm_s"]) == {"dp"}
    rs, ag = ring_reduce_scatter(2, 4 * params), ring_all_gather(2, ELEM * params)
    compute = _compute(plan)
    assert rs > 100 * compute
    assert pred["comm_s"]["dp"] - (rs + ag - 2 / 3 * compute / m) == pytest.approx(0, abs=1e-3 * compute)
    # a machine slow enough to compute that the reduce-scatter hides entirely: the gather is left
    slow = dataclasses.replace(MACHINE, peak_tflops=1e-6)
    assert 2 / 3 * _compute(plan, slow) / m > rs
    hidden = predict_step(cfg, plan, slow, params)
    assert hidden["comm_s"]["dp"] == pytest.approx(ag, rel=1e-12)
    assert pred["optimizer_s"] == pytest.approx(30 * params / 2 / (MACHINE.mem_bw_gbs * 1e9), rel=1e-12)
    _check_sum(pred)


def test_zero3_gathers_the_parameters_for_every_micro_batch():
    cfg, plan = _plan(("parallel.zero", "3"))
    params, m = _params(plan), plan.microbatches
    assert m == GBS // MBS // 2
    pred = predict_step(cfg, plan, MACHINE, params)
    rs, ag = ring_reduce_scatter(2, 4 * params), ring_all_gather(2, ELEM * params)
    # ZeRO-1's terms, plus a gather per micro-batch forward and backward, behind the forwards
    compute = _compute(plan)
    want = rs - 2 / 3 * compute / m + ag + 2 * m * ag - compute / 3
    assert pred["comm_s"]["dp"] - want == pytest.approx(0, abs=1e-3 * compute)


@pytest.mark.parametrize("sp", [True, False])
def test_tp_exchanges_each_blocks_activations_forward_and_backward(sp):
    cfg, plan = _plan(("parallel.tp", "2"), ("parallel.sequence_parallel", str(sp).lower()))
    pred = predict_step(cfg, plan, MACHINE, _params(plan) // 2)
    assert set(pred["comm_s"]) == {"tp"}
    c, m = plan.model_config(), plan.microbatches
    act = MBS * SEQ * c.dim * ELEM  # one block's input [mbs, seq, dim]
    one = ring_all_gather(2, act) + ring_reduce_scatter(2, act) if sp else ring_all_reduce(2, act)
    # two blocks (attention, ffn) per layer, forward and backward, every micro-batch
    assert pred["comm_s"]["tp"] == pytest.approx(2 * 2 * one * c.n_layers * m, rel=1e-9)


def test_cp_ring_passes_k_and_v_three_times_behind_attention():
    cfg, plan = _plan(("parallel.cp", "2"))
    pred = predict_step(cfg, plan, MACHINE, _params(plan))
    assert set(pred["comm_s"]) == {"cp", "dp"}
    c, m = plan.model_config(), plan.microbatches
    kv = 2 * MBS * SEQ // 2 * c.n_kv_heads * c.head_dim * ELEM  # a rank's K and V, its s/cp tokens
    # forward: K, V around the ring; backward: K, V again and dK, dV back
    ring = 3 * ring_all_gather(2, 2 * kv) * c.n_layers * m
    mm, attn = _compute_parts(plan)
    assert ring > 100 * attn
    assert pred["comm_s"]["cp"] - (ring - attn) == pytest.approx(0, abs=1e-3 * attn)  # behind attention
    # dp × cp shard the gradients: the dp term is over both (2 ranks)
    params = _params(plan)
    dp = ring_reduce_scatter(2, 4 * params) + ring_all_gather(2, ELEM * params) - 2 / 3 * (mm + attn) / m
    assert pred["comm_s"]["dp"] - dp == pytest.approx(0, abs=1e-3 * attn)


def test_ep_all_to_all_dispatches_and_combines_forward_and_backward():
    cfg, plan = _plan(("model.preset", "tiny-moe"), ("parallel.ep", "2"))
    pred = predict_step(cfg, plan, MACHINE, _params(plan))
    assert set(pred["comm_s"]) == {"ep", "dp"}
    c, m = plan.model_config(), plan.microbatches
    routed = MBS * SEQ * c.top_k * c.dim * ELEM  # every token sent to its top_k experts
    moe_layers = sum(c.is_moe_layer(i) for i in range(c.n_layers))
    assert pred["comm_s"]["ep"] == pytest.approx(
        4 * pairwise_all_to_all(2, routed) * moe_layers * m, rel=1e-9
    )


def test_pp_sends_one_activation_each_way_per_micro_batch_and_the_bubble():
    cfg, plan = _plan(("parallel.pp", "2"))
    pred = predict_step(cfg, plan, MACHINE, _params(plan) // 2)
    assert set(pred["comm_s"]) == {"pp"}
    m, dim = plan.microbatches, plan.model_config().dim
    assert m == GBS // MBS
    act = MBS * SEQ * dim * ELEM
    assert pred["comm_s"]["pp"] == pytest.approx(2 * m * (ALPHA + act * BETA), rel=1e-9)
    # 1F1B: each stage idles pp - 1 micro-batch slots of the m it works
    assert plan.bubble == pytest.approx(1 / (m + 1))
    assert pred["bubble_s"] == pytest.approx(pred["compute_s"] * 1 / m, rel=1e-9)
    assert pred["compute_s"] == pytest.approx(_compute(plan), rel=1e-9)  # the world's share
    _check_sum(pred)


@pytest.mark.parametrize("sp", [True, False])
def test_a_measured_wait_is_charged_to_every_blocking_tp_collective(sp):
    """sync_us (what `plan --calibrate` measures on ranks sharing cores) is added to each
    collective, and the latency-bound all-reduces then count too: the vocab-parallel loss's two
    and, under SP, each norm's weight gradient (2 per layer + the final norm), per micro-batch."""
    over = (("parallel.tp", "2"), ("parallel.sequence_parallel", str(sp).lower()))
    cfg, plan = _plan(*over)
    params = _params(plan) // 2
    base = predict_step(cfg, plan, MACHINE, params)["comm_s"]["tp"]
    wait = 1e-3
    waits = {"2": wait * 1e6, "4": 99.0}  # groups of 4 wait longer; tp's group is 2
    pred = predict_step(cfg, plan, dataclasses.replace(MACHINE, sync_us=waits), params)["comm_s"]["tp"]
    c, m = plan.model_config(), plan.microbatches
    calls = 2 * 2 * (2 if sp else 1) * c.n_layers * m  # the blocks' exchanges, as above
    small = (2 + (2 * c.n_layers + 1 if sp else 0)) * m
    scalars = small * (ring_all_reduce(2, 8 * MBS * SEQ) + wait)
    assert pred - base == pytest.approx(calls * wait + scalars, rel=1e-9)


@pytest.mark.parametrize("pp,mbs,cores", [(2, MBS, 1), (4, GBS, 3), (2, MBS, 0)])
def test_on_shared_cores_the_bubble_costs_only_what_no_other_rank_can_use(pp, mbs, cores):
    """World ranks on `cores` shared cores: while a stage idles in the bubble its core runs
    another rank, so the step stretches only when fewer than `cores` ranks have work:
    compute × max(1, (cores / world) / (1 − bubble)); dedicated devices (cores 0) pay 1/(1 − bubble)."""
    world = pp
    over = [("parallel.pp", str(pp)), ("train.micro_batch_size", str(mbs)), ("model.n_layers", str(pp))]
    cfg, plan = _plan(*over, world=world)
    machine = dataclasses.replace(MACHINE, shared_cores=cores)
    pred = predict_step(cfg, plan, machine, _params(plan) // pp)
    busy = 1 - plan.bubble
    want = max(1.0, cores / world / busy) if cores else 1 / busy
    assert pred["compute_s"] + pred["bubble_s"] == pytest.approx(pred["compute_s"] * want, rel=1e-9)
    assert (pred["bubble_s"] > 0) == (want > 1)
