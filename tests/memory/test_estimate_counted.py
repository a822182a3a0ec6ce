"""The run plan's memory estimate (`--dry-run`, `ranks[].memory`) against bytes counted on a
real trainer, one test per row of benchmarks/memory.py (plus pp peak in flight and MoE).

Each row builds the trainer on 2 gloo ranks with a tiny model, trains one step, and counts on
the rank, without asking the estimator anything:
- the distinct storages held on the device by the parameters, the gradient buckets and the
  optimizer's state (storage sizes, each storage once, whoever holds it);
- activations: the bytes autograd keeps for one micro-batch (`count_saved`, saved-tensor hooks),
  and under pipeline parallelism the peak of bytes kept alive over a whole schedule's step
  (saved-tensor hooks that see each saved tensor released);
- transients the estimate books as buffers: ZeRO-3's gathered blocks (parameter storages
  sampled at every module's forward), offload's optimizer state in flight, swap's attention
  tensors brought back (their device copies, sampled while they live), and the loss's backward
  (the two float32 gradients of the whole logits its operators return).
The estimate's parts must equal those counts within BOUND bytes (the rows marked below state
theirs), and its `total` the sum of the counted storages, taken as one set, plus activations
and transients: a count that never went through the estimator's own sum.
"""

from __future__ import annotations

import os
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from meshspeed.memory import count_saved
from meshspeed.plan import config
from meshspeed.plan.run_plan import make_plan
from tests import harness

SEQ, MB = 32, 2
BASE = [
    ("model.preset", "tiny"),
    ("model.n_layers", "4"),  # ZeRO-3 gathers root + 2 blocks: fewer than all of them
    ("parallel.tp", "1"),
    ("train.seq_len", str(SEQ)),
    ("train.micro_batch_size", str(MB)),
    ("train.global_batch_size", str(2 * MB)),  # one micro-batch per rank at dp 2
    ("train.dtype", "float32"),
    ("train.eval_interval", "0"),
    ("train.eval_batches", "1"),
    ("train.steps", "2"),
    ("data.path", os.path.abspath(__file__)),  # a few KB of text: no corpus to read
    ("checkpoint.interval", "0"),
]
T = SEQ * MB  # tokens of a micro-batch
# Bytes the estimate leaves out, by design or as known omissions (each stated where it is
# used); anything else must agree within SCALARS: the loss's float32 scalars, not modelled.
SCALARS = 64
TIES = 1024  # reuse_fp32_param's tie list: 8 B per tie, ~1 master in 2^17 (~100 B here)
BF16 = [("train.dtype", "bfloat16")]
ROWS = {
    "baseline": [],
    "recompute activation": [("memory.recompute", "activation")],
    "recompute selective": [("memory.recompute", "selective")],
    "recompute full": [("memory.recompute", "full")],
    "recompute first 2 layers": [("memory.recompute", "full"), ("memory.recompute_layers", "2")],
    "chunked loss": [("memory.chunked_loss", "true"), ("memory.loss_chunk", "8")],
    "swap activations": [("memory.swap_activations", "true")],
    "swap first layer": [("memory.swap_activations", "true"), ("memory.swap_layers", "1")],
    "ZeRO-1": [("parallel.zero", "1")],
    "ZeRO-2": [("parallel.zero", "2")],
    "ZeRO-3": [("parallel.zero", "3")],
    # small buckets: the step brings several over, two at a time
    "offload optimizer": [("memory.offload_optimizer", "true"), ("parallel.bucket_mb", "0.25")],
    "baseline bf16": BF16,
    "reuse fp32 param (bf16)": BF16 + [("memory.reuse_fp32_param", "true")],
    "moe": [("model.preset", "tiny-moe")],
}


def _storage_bytes(tensors) -> dict[int, int]:
    """{storage id: bytes} of distinct storages."""
    out = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            st = t.untyped_storage()
            out[st._cdata] = st.nbytes()
    return out


def _shard_tensors(opt) -> list[torch.Tensor]:
    """Every tensor an optimizer shard holds as an attribute (whatever kind of shard)."""
    return [v for sh in opt.shards for v in vars(sh).values() if isinstance(v, torch.Tensor)]


class LivePeak:
    """Saved-tensor hooks that count the bytes of distinct storages autograd keeps alive, and
    their peak: a storage counts from its first save until autograd releases its last one."""

    def __init__(self, exclude):
        self.skip = {t.untyped_storage()._cdata for t in exclude}
        self.refs: dict[int, int] = {}
        self.live = self.peak = 0

    def _release(self, key: int, nbytes: int) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.live -= nbytes

    def pack(self, t: torch.Tensor):
        st = t.untyped_storage()
        if t.device.type == "meta" or st._cdata in self.skip:
            return t
        holder = _Held(t)
        key, n = st._cdata, st.nbytes()
        if key not in self.refs:
            self.refs[key] = 0
            self.live += n
            self.peak = max(self.peak, self.live)
        self.refs[key] += 1
        weakref.finalize(holder, self._release, key, n)
        return holder

    @staticmethod
    def unpack(h):
        return h.t if isinstance(h, _Held) else h

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _Held:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t


def _sample_params(model, shards, samples: list) -> list:
    """Forward hooks on every module recording the parameter storages alive (ZeRO-3: the rank's
    shards plus whatever is gathered at that moment)."""
    params = list(model.parameters())
    shard_bytes = sum(_storage_bytes(shards).values())

    def hook(*_):
        samples.append(sum(_storage_bytes(params).values()) + shard_bytes)

    return [
        h for m in model.modules() for h in (m.register_forward_pre_hook(hook), m.register_forward_hook(hook))
    ]


def _count_live(live: dict, tensors) -> None:
    """Count `tensors` (distinct new device copies) in live["now"] until each is freed."""
    for t in tensors:
        n = t.untyped_storage().nbytes()
        live["now"] += n
        live["peak"] = max(live["peak"], live["now"])
        weakref.finalize(t, _sub, live, n)


def _sub(live: dict, n: int) -> None:
    live["now"] -= n


def _patch_copies(live: dict, host: dict) -> list:
    """Count the device copies swap and offload make (live), and the host copies swap makes
    (host["swap"]), from outside: wrappers around the methods that make them."""
    from meshspeed.memory.offload import HostState
    from meshspeed.memory.swap import _Group

    fetch_group, offload_group, fetch_state = _Group.fetch, _Group.offload, HostState.fetch

    def group_fetch(self):
        before, fresh = list(self.host), self.device is None
        fetch_group(self)
        if fresh:  # copies of what went to the host; ("kept", t) entries come back as t itself
            _count_live(live, [d for h, d in zip(before, self.device) if not isinstance(h, tuple)])

    def group_offload(self, outputs):
        offload_group(self, outputs)
        host["swap"] += sum(_storage_bytes(h for h in self.host if not isinstance(h, tuple)).values())

    def state_fetch(self, j):
        fresh = j not in self._fetched
        fetch_state(self, j)
        if fresh:
            _count_live(live, [self._fetched[j][0]])

    _Group.fetch, _Group.offload, HostState.fetch = group_fetch, group_offload, state_fetch
    return [
        (_Group, "fetch", fetch_group),
        (_Group, "offload", offload_group),
        (HostState, "fetch", fetch_state),
    ]


def job_row(ctx, run_dir: str, settings: list) -> dict:
    """This rank's estimate and counts for one row (see the module docstring)."""
    from meshspeed.train.trainer import Trainer

    cfg = config.load(None, BASE + settings + [("run.dir", run_dir)])
    plan = make_plan(cfg, ctx.world_size)
    est = plan.ranks[ctx.rank]["memory"]
    live, host = {"now": 0, "peak": 0}, {"swap": 0}
    patched = _patch_copies(live, host)
    try:
        trainer = Trainer(cfg, ctx, plan)
        trainer.train_step(0)  # the optimizer state and buffers as every later step holds them
        got = {"offload_in_flight": live["peak"]}
        got.update(_count_state(trainer))
        live["now"] = live["peak"] = 0
        got.update(_count_activations(trainer, cfg, live, host))
    finally:
        for cls, name, orig in patched:
            setattr(cls, name, orig)
    return {"est": est, "got": got, "omitted": _omitted(plan, ctx.rank)}


def _omitted(plan, rank: int) -> tuple[int, int]:
    """(least, most) activation bytes the estimate leaves out on this rank, known omissions:
    - the token ids the embedding keeps for its backward (int64 [T]; the estimate's 8·T is the
      targets): one micro-batch's without pp, one to all of those in flight on the first stage
      (interleaved: which chunks' micro-batches are in flight at the peak is not in the plan);
    - under pp, RoPE's cos and sin gathered at the stage's positions for each chunk-micro-batch
      in flight ([seq, head_dim/2] float32 each; without pp they are views of model buffers);
    - MoE: up to 8 B per expert per MoE layer (the group offsets of torch._grouped_mm)."""
    m, coords = plan.model_config(), plan.ranks[rank]["coords"]
    ids, lo, hi = 8 * T, 0, 0
    if plan.dims["pp"] > 1:
        in_flight = plan.peak_microbatches[coords["pp"]]
        rope = in_flight * 2 * SEQ * (m.head_dim // 2) * 4
        embedding = any(s["embedding"] for s in plan.stages if s["rank"] == coords["pp"])
        lo, hi = rope + (ids if embedding else 0), rope + (in_flight * ids if embedding else 0)
    else:
        lo = hi = ids
    if m.n_experts:
        hi += 8 * m.n_experts * sum(m.is_moe_layer(i) for i in range(m.n_layers))
    return lo, hi


def _count_state(trainer) -> dict:
    """Device storages after a step: parameters (ZeRO-3: its shards), gradients, optimizer
    state, their union; host: offloaded optimizer state."""
    dp, opt = trainer.dp, trainer.opt
    z3 = dp.zero3.shards if dp.zero3 is not None else []
    params = _storage_bytes([*trainer.model.parameters(), *z3])
    grads = _storage_bytes([t for b in dp.buckets for t in (b.grad, b.grad_shard)])
    offloaded = getattr(opt, "offload", None)
    host = _storage_bytes(sh.host for sh in offloaded.shards) if offloaded is not None else {}
    state = _storage_bytes(_shard_tensors(opt))
    optimizer = {k: n for k, n in state.items() if k not in params and k not in host}
    union = {**params, **grads, **optimizer}
    return {
        "params": sum(params.values()),
        "grads": sum(grads.values()),
        "optimizer": sum(optimizer.values()),
        "host": sum(host.values()),
        "device": sum(union.values()),
    }


def _count_activations(trainer, cfg, live: dict, host: dict) -> dict:
    """Saved bytes of one micro-batch (pp: the peak over a whole step), ZeRO-3's gathered
    parameter bytes at their peak, swap's copies brought back in backward."""
    model = trainer.model
    whole = T * trainer.model_config.vocab_size  # the whole logits' elements (tp 1 rows)
    if trainer.pipeline is not None:
        peak = LivePeak([*model.parameters(), *model.buffers()])
        with peak.hooks(), LossBackward(whole) as lb:
            trainer.train_step(1)
        return {
            "activations": peak.peak,
            "gathered": 0,
            "swap_back": 0,
            "swap_host": 0,
            "loss_backward": lb.bytes,
        }
    gen = torch.Generator().manual_seed(trainer.ctx.rank)
    # inputs and targets apart, as training has them (one tensor for both would hide the ids)
    x, y = torch.randint(0, trainer.model_config.vocab_size, (2, MB, SEQ), generator=gen)
    samples: list[int] = []
    z3 = trainer.dp.zero3
    hooks = _sample_params(model, z3.shards, samples) if z3 is not None else []
    host["swap"] = 0
    with count_saved(model) as c:
        ce, aux = trainer._loss(x, y)
    activations = c.bytes  # read now: backward brings recomputed storages back
    swap_host = host["swap"]
    for h in hooks:
        h.remove()
    with LossBackward(whole) as lb:
        (ce if aux is None else ce + aux).backward()
    trainer.dp.zero_grad()
    shards = sum(_storage_bytes(z3.shards).values()) if z3 is not None else 0
    return {
        "activations": activations,
        "gathered": max(samples) - shards if samples else 0,
        "swap_back": live["peak"],
        "swap_host": swap_host,
        "loss_backward": lb.bytes,
    }


class LossBackward(TorchDispatchMode):
    """The loss's backward transients: the gradients nll_loss and log-softmax's backward make
    for the whole [T, vocab] logits, alive together (one micro-batch's: the largest of each).
    A chunked loss makes them a chunk at a time: not whole, not counted (nor estimated)."""

    def __init__(self, whole: int):
        super().__init__()
        self.whole, self.sizes = whole, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in ("nll_loss_backward", "_log_softmax_backward_data") and out.numel() == self.whole:
            self.sizes[name] = max(self.sizes.get(name, 0), out.numel() * out.element_size())
        return out

    @property
    def bytes(self) -> int:
        return sum(self.sizes.values())


def _check(row: str, r: dict) -> list[str]:
    est, got, (lo, hi) = r["est"], r["got"], r["omitted"]
    bad = []

    def within(what: str, e: int, g: int, least: int = 0, most: int = 0) -> None:
        if not e + least <= g <= e + most:
            bad.append(f"{row}: {what} estimated {e:,}, counted {g:,} (allowed: + {least:,} to {most:,} B)")

    # the state is exact (no bucket padding at these sizes); reuse keeps the masters' residuals
    # in the parameters' storage, so only their sum compares, with the tie list
    reuse = "reuse" in row
    state = est["params"] + est["grads"] + est["optimizer"]
    within("params + grads + optimizer", state, got["device"], 0, TIES if reuse else 0)
    within("grads", est["grads"], got["grads"])
    if not reuse:
        within("params", est["params"], got["params"])
        within("optimizer", est["optimizer"], got["optimizer"])
    within("activations", est["activations"], got["activations"], lo - SCALARS, hi + SCALARS)
    within("host", est["host"], got["host"] + got["swap_host"])
    transient = got["gathered"] + got["swap_back"] + got["loss_backward"]
    if "offload" in row:
        # "about two buckets": the two largest neighbours' state, never more than two caps
        transient = got["offload_in_flight"] + got["loss_backward"]
        within("buffers (offload in flight)", est["buffers"], transient, -est["buffers"] // 2, 0)
    else:
        within("buffers", est["buffers"], transient)
    total = got["device"] + got["activations"] + transient  # counted, not the estimate's own sum
    slack = TIES if reuse else 0
    if "offload" in row:
        slack = est["buffers"] // 2
    within("total", est["total"], total, lo - SCALARS - slack, hi + SCALARS + slack)
    return bad


@pytest.mark.parametrize("row", list(ROWS))
def test_estimate_equals_the_bytes_counted_on_the_rank(tmp_path, row):
    bad = []
    for rank, r in enumerate(harness.run(2, job_row, str(tmp_path), ROWS[row])):
        bad += [f"rank {rank} {b}" for b in _check(row, r)]
    assert bad == []


# cp 2 (dp 1): the trainer shards ZeRO's state over the dp × cp group. Only the state is
# compared: the estimate's activations under cp are 4.3% above the counted bytes here (1,527,168
# against 1,463,940 per rank), a gap in the ring attention's model still to close.
CP_ROWS = {
    "ZeRO-1 cp2": [("parallel.cp", "2"), ("parallel.zero", "1")],
    "ZeRO-2 cp2": [("parallel.cp", "2"), ("parallel.zero", "2")],
}


@pytest.mark.parametrize("row", list(CP_ROWS))
def test_zero_state_under_cp_is_sharded_over_dp_times_cp(tmp_path, row):
    for r in harness.run(2, job_row, str(tmp_path), CP_ROWS[row]):
        est, got = r["est"], r["got"]
        assert (est["params"], est["grads"], est["optimizer"]) == (
            got["params"],
            got["grads"],
            got["optimizer"],
        ), row


PP = [("parallel.pp", "2"), ("train.global_batch_size", str(4 * MB))]  # dp 1: 4 micro-batches
PP_ROWS = {
    "pp2 1f1b": PP,
    "pp2 interleaved vpp2": PP + [("parallel.vpp", "2"), ("parallel.pp_schedule", "interleaved")],
}


@pytest.mark.parametrize("row", list(PP_ROWS))
def test_pipeline_estimate_equals_the_peak_in_flight(tmp_path, row):
    """Activations at the schedule's peak of micro-batches in flight: the most bytes autograd
    held at once over a whole step, on each pp rank (the last one adds the head)."""
    bad = []
    for rank, r in enumerate(harness.run(2, job_row, str(tmp_path), PP_ROWS[row])):
        bad += [f"pp rank {rank} {b}" for b in _check(row, r)]
    assert bad == []
