"""The one-pass AdamW (meshspeed.kernels.adamw) against ZeroAdamW's original arithmetic.

The oracle is `adamw_reference`: the per-term passes ZeroAdamW always ran (torch.optim.AdamW's
single-tensor order). The Triton kernel runs here under TRITON_INTERPRET=1 and must equal it bit
for bit (master, both moments, the clipped gradient it leaves in the bucket, the published bf16
parameters) once both take a correctly rounded square root: torch's vectorised CPU sqrt is not
always (on CUDA both are), which moves the master by a few ulps of the update, so against the
plain reference the moments are compared bit for bit and the master within that. The CPU path
(torch's fused AdamW over the decayed and undecayed ranges) is within a few roundings of
torch.optim.AdamW(fused=True) and of the reference. Then the optimizer: every ZeRO stage (dp 2),
ZeRO-1's prefetched gather, the offloaded and the shared (reuse_fp32_param) masters and a sparse
regrowth reset, each trained with the Triton kernel and with the reference, bit for bit; float32
masters are the parameters themselves; bf16 gradients land in the fp32 bucket with one copy, and
later micro-batches add.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernel is built (on first use)
pytest.importorskip("triton", reason="triton is in the dev extra: pip install -e .[dev]")

from meshspeed import comm, models  # noqa: E402
from meshspeed.kernels import adamw as K  # noqa: E402
from meshspeed.parallel.optim import build_data_parallel, clip_coefficient, grad_norm  # noqa: E402
from tests import harness  # noqa: E402

N = 2 * 2048 + 80  # two full Triton blocks and a partial one
RANGES = [(0, 1000), (1008, 2500), (3200, 4100)]  # decayed; starts 16-aligned, as slots are
PADDING = [(e, -(-e // 16) * 16) for _, e in RANGES]  # a slot's end to the next 16: zeros in a bucket


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """The gap to the next representable value of x's dtype (bf16 or fp32)."""
    x = x.abs()
    return torch.nextafter(x, torch.full_like(x, float("inf"))) - x


def _state(seed: int, grad_dtype=torch.float32):
    """On DEVICE: master, gradient, exp_avg, exp_avg_sq."""
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(N, generator=g)
    m, v = torch.randn(N, generator=g) * 0.1, torch.rand(N, generator=g) * 0.01
    # gradients of every magnitude, so that eps and the lerp's nearer end both matter somewhere
    grad = (torch.randn(N, generator=g) * 10.0 ** torch.randint(-5, 2, (N,), generator=g)).to(grad_dtype)
    for a, e in PADDING:  # the kernel's decay mask has 16-element groups; buckets pad slots with zeros
        for t in (master, grad, m, v):
            t[a:e] = 0
    return [t.to(DEVICE) for t in (master, grad, m, v)]


def _run(fn, state, hp, layout, **kw):
    s = [t.clone() for t in state]
    out = torch.full((N,), 7.0, dtype=torch.bfloat16, device=DEVICE)
    fn(*s, hp, layout, out=out, **kw)
    return s + [out]


@pytest.mark.parametrize("beta1", [0.9, 0.3])  # lerp from the start, and from the end
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("clip", [None, 0.37])
def test_triton_kernel_is_the_reference_bit_for_bit(beta1, grad_dtype, clip):
    layout = K.DecayLayout(N, RANGES)
    coef = None if clip is None else torch.tensor(clip, device=DEVICE)
    for step in (1, 7):
        hp = K.AdamWHyper(3e-3, beta1, 0.95, 1e-8, 0.1, step)
        state = _state(step, grad_dtype)
        want = _run(functools.partial(K.adamw_reference, ieee_sqrt=True), state, hp, layout, clip_coef=coef)
        got = _run(K.adamw_triton, state, hp, layout, clip_coef=coef)
        if DEVICE == "cuda":  # compiled: ATen's CUDA rounding order, read from its source; see below
            _assert_within_ulps(got, want, 1)
            continue
        for name, g, w in zip(("master", "grad", "exp_avg", "exp_avg_sq", "published"), got, want):
            assert torch.equal(g, w), f"step {step}: {name} differs in {int((g != w).sum())} places"
        # against the reference's own (vectorised CPU) square root: moments exact, master close
        plain = _run(K.adamw_reference, state, hp, layout, clip_coef=coef)
        assert torch.equal(plain[2], got[2]) and torch.equal(plain[3], got[3])
        decayed = torch.tensor([any(a <= i < e for a, e in RANGES) for i in range(N)], device=DEVICE)
        before = torch.where(decayed, state[0] * hp.decay_factor, state[0])
        scale = torch.maximum(torch.maximum(before.abs(), plain[0].abs()), (plain[0] - before).abs())
        assert ((plain[0] - got[0]).abs() <= 4 * _ulp(scale)).all()


def _assert_within_ulps(got, want, n: int) -> None:
    """master, grad, exp_avg, exp_avg_sq and the bf16 published copy within n ulps (of their
    own dtype) of the larger magnitude; the master's magnitude at least the update's, lr."""
    for name, g, w in zip(("master", "grad", "exp_avg", "exp_avg_sq", "published"), got, want):
        scale = torch.maximum(g.abs(), w.abs())
        if name == "master":
            scale = torch.clamp(scale, min=3e-3)
        tol = n * _ulp(scale).float()
        bad = (g.float() - w.float()).abs() > tol
        assert not bad.any(), f"{name}: beyond {n} ulp in {int(bad.sum())} places"


@pytest.mark.parametrize("impl", ["triton", "torch", "reference"])
def test_a_non_finite_step_writes_nothing(impl):
    state = _state(3)
    hp = K.AdamWHyper(1e-2, 0.9, 0.95, 1e-8, 0.1, 2)
    flag = functools.partial(torch.tensor, device=DEVICE)
    got = _run(functools.partial(K.adamw_, impl=impl), state, hp, K.DecayLayout(N, RANGES),
               clip_coef=flag(0.5), found_inf=flag(1.0))  # fmt: skip
    for g, w in zip(got, state):
        assert torch.equal(g, w)
    assert (got[4] == 7.0).all()
    moved = _run(functools.partial(K.adamw_, impl=impl), state, hp, K.DecayLayout(N, RANGES),
                 found_inf=flag(0.0))  # fmt: skip
    assert not torch.equal(moved[0], state[0])


def test_torch_path_is_torch_fused_adamw_to_rounding():
    """torch's fused kernel over the decayed and undecayed ranges: against torch.optim.AdamW
    (fused=True) per parameter and against the reference, within a few roundings of each value
    (the kernel's vector loop and its scalar tail, which rounds in double, round differently, and
    ranges put the tail on other elements than parameters do)."""
    g = torch.Generator().manual_seed(0)
    shapes = [(37, 5), (64,), (33, 17), (40, 16), (7,), (128, 9)]  # two matrices adjacent: merged
    ps = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    matrices, vectors = [p for p in ps if p.dim() > 1], [p for p in ps if p.dim() == 1]
    groups = [{"params": matrices}, {"params": vectors, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    offs, at = [], 0
    for p in ps:
        offs.append(at)
        at = -(-(at + p.numel()) // 16) * 16
    merged: list[list[int]] = []
    for j, (p, o) in enumerate(zip(ps, offs)):  # buckets.segments' merge of neighbouring slots
        if p.dim() > 1:
            if merged and ps[j - 1].dim() > 1:
                merged[-1][1] = o + p.numel()
            else:
                merged.append([o, o + p.numel()])
    layout = K.DecayLayout(at, [tuple(r) for r in merged])
    assert len(layout.ranges) < len(matrices)
    flats = []
    for _ in range(2):  # torch's kernel, the reference
        flat = torch.zeros(at)
        for p, o in zip(ps, offs):
            flat[o : o + p.numel()] = p.detach().flatten()
        flats.append([flat, torch.zeros(at), torch.zeros(at), torch.zeros(at)])  # master, grad, m, v
    cache = K.ViewCache()
    for step in range(1, 5):
        for p, o in zip(ps, offs):
            p.grad = torch.randn(p.shape, generator=g)
            for f in flats:
                f[1][o : o + p.numel()] = p.grad.flatten()
        opt.step()
        hp = K.AdamWHyper(3e-3, 0.9, 0.95, 1e-8, 0.1, step)
        K.adamw_torch(*flats[0], hp, layout, cache=cache)
        K.adamw_reference(*flats[1], hp, layout)
        for p, o in zip(ps, offs):
            sl = slice(o, o + p.numel())
            torch_state = (p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])
            for k, want in zip((0, 2, 3), torch_state):
                for other in (want.flatten(), flats[1][k][sl]):
                    # a master's rounding errors are the updates' (about lr each), summed over steps
                    got, floor = flats[0][k][sl], torch.tensor(hp.lr if k == 0 else 0.0)
                    scale = torch.maximum(torch.maximum(got.abs(), other.abs()), floor)
                    assert ((got - other).abs() <= 8 * _ulp(scale)).all(), f"step {step} state {k}"


def test_decay_layout():
    layout = K.DecayLayout(96, [(0, 20), (32, 40)])
    assert layout.rest == [(20, 32), (40, 96)]
    assert layout.mask(torch.device("cpu")).tolist() == [1, 1, 1, 0, 0, 0]
    assert K.DecayLayout(32, []).none_decayed and K.DecayLayout(32, [(0, 32)]).all_decayed
    with pytest.raises(ValueError, match="impl='cuda'"):
        K.resolve_impl("cuda", torch.device("cpu"))


# ----------------------------------------------------------------------- the optimizer
def _config():
    return dataclasses.replace(models.get_preset("tiny"), dim=32, n_layers=2, n_heads=2, n_kv_heads=1,
                               vocab_size=64, ffn_hidden=64)  # fmt: skip


@contextlib.contextmanager
def _ieee_reference():
    """Inside a job: the reference takes a correctly rounded sqrt, as the interpreter does."""
    plain = K.adamw_reference
    K.adamw_reference = functools.partial(plain, ieee_sqrt=True)
    try:
        yield
    finally:
        K.adamw_reference = plain


def _train(ctx, impl, zero, dtype, *, variant=None, steps=3, micro=2):
    mesh = comm.ParallelDims(dp=ctx.world_size).build(ctx)
    torch.manual_seed(0)
    model = models.build_model(_config())
    units = "layers" if zero == 3 else None
    hp = dict(lr=1e-2, weight_decay=0.1, impl=impl, units=units)
    dp, opt = build_data_parallel(model, mesh, zero=zero, bucket_mb=0.03, dtype=dtype, **hp)
    extra = variant(dp, opt) if variant else None
    rank, size = dp.group.rank, dp.group.size
    for step in range(steps):
        tokens = torch.randint(0, 64, (micro * 2 * size, 9), generator=torch.Generator().manual_seed(step))
        for i in range(micro):
            rows = tokens[(i * size + rank) * 2 : (i * size + rank + 1) * 2]
            with contextlib.nullcontext() if i == micro - 1 else dp.no_sync():
                (models.cross_entropy_loss(model(rows[:, :-1]), rows[:, 1:]) / micro).backward()
        norm = grad_norm(dp, mesh)
        opt.step(clip_coef=clip_coefficient(norm, 0.5 if step == 1 else 1e3))  # clipped once
        if extra is not None:
            extra(step)
        opt.zero_grad()
    prefetch = getattr(dp, "prefetch", None)
    if prefetch is not None:
        prefetch.wait()
    ctxm = dp.zero3.gathered() if dp.zero3 is not None else contextlib.nullcontext()
    with ctxm:
        params = torch.cat([p.detach().float().flatten() for p in model.parameters()])
    state = opt.state_dict_per_param()
    flat = torch.cat(
        [v.flatten() for n in sorted(k for k in state if k != "__step__") for v in state[n].values()]
    )
    out = {"params": params, "state": flat, "step": state["__step__"], "state_bytes": opt.state_bytes(),
           "numel": sum(s.numel for s in dp.specs), "alias": all(
               st.master.untyped_storage().data_ptr() == dp.param_slice(i).untyped_storage().data_ptr()
               for i, st in enumerate(opt.shards))}  # fmt: skip
    dp.remove_hooks()
    return out


def _prefetch(dp, opt):
    from meshspeed.parallel.zero_prefetch import enable_zero_prefetch

    enable_zero_prefetch(dp)


def _offload(dp, opt):
    from meshspeed.memory import offload_optimizer

    offload_optimizer(opt)


def _shared(dp, opt):
    from meshspeed.memory import share_fp32_masters

    share_fp32_masters(opt)


def _regrow(dp, opt):
    name, p = next((n, p) for n, p in dp.params.items() if p.dim() == 2)

    def after(step):  # a RigL regrowth: weight, master and moments zeroed at a third of the places
        where = torch.arange(p.numel()).reshape(p.shape) % 3 == step % 3
        opt.reset_state_where(p, where)

    return after


VARIANTS = {"plain": None, "prefetch": _prefetch, "offload": _offload, "shared": _shared, "regrow": _regrow}


@contextlib.contextmanager
def _interpreted():
    """Workers hold CPU tensors: the kernel runs interpreted there even on a CUDA machine."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET")


def job_equal(ctx, cases):
    out = []
    with _interpreted(), _ieee_reference():
        for zero, dtype, variant in cases:
            runs = [
                _train(ctx, impl, zero, dtype, variant=VARIANTS[variant]) for impl in ("reference", "triton")
            ]
            out.append((zero, dtype, variant, runs))
    return out


CASES = [
    (0, torch.float32, "plain"),
    (1, torch.float32, "plain"),
    (2, torch.float32, "plain"),
    (3, torch.float32, "plain"),
    (1, torch.bfloat16, "prefetch"),
    (2, torch.bfloat16, "plain"),
    (3, torch.bfloat16, "plain"),
    (1, torch.bfloat16, "offload"),
    (1, torch.bfloat16, "shared"),
    (1, torch.float32, "regrow"),
]


@functools.cache
def _equal_runs():
    return harness.run(2, job_equal, CASES, timeout=300)


def test_every_zero_stage_and_memory_feature_trains_the_same_bits_with_the_kernel():
    res = _equal_runs()
    for r in range(2):
        for zero, dtype, variant, (ref, tri) in res[r]:
            what = f"rank {r} zero={zero} {dtype} {variant}"
            assert ref["step"] == tri["step"] == 3, what
            assert torch.equal(ref["params"], tri["params"]), what + ": parameters"
            assert torch.equal(ref["state"], tri["state"]), what + ": optimizer state"
            assert torch.equal(res[0][CASES.index((zero, dtype, variant))][3][1]["params"], tri["params"])


def test_float32_masters_are_the_parameters_at_every_zero_stage():
    for zero, dtype, variant, (ref, tri) in _equal_runs()[0]:
        if dtype == torch.float32 and variant == "plain":
            assert tri["alias"], f"zero={zero}: the fp32 master is a copy"
            # the moments only: 8 bytes per element of the rank's part (ZeRO-1/2/3: half the bucket)
            assert tri["state_bytes"] == 8 * tri["numel"] // (1 if zero == 0 else 2)
        if dtype == torch.bfloat16 and variant in ("plain", "prefetch"):
            assert not tri["alias"] and tri["state_bytes"] == 12 * tri["numel"] // 2


def test_bf16_gradients_land_in_the_bucket_with_one_copy_then_adds():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    ctx = comm.init()
    mesh = comm.ParallelDims().build(ctx)
    model = models.build_model(_config())
    dp, opt = build_data_parallel(model, mesh, dtype=torch.bfloat16, bucket_mb=0.01)
    calls: list[list[str]] = []
    inner = dp._accumulate

    def spy(p, name, b):
        with Ops() as ops:
            inner(p, name, b)
        calls.append(ops.names)

    dp._accumulate = spy
    tokens = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(0))
    grads = []
    for i in range(2):
        calls.clear()
        with dp.no_sync() if i == 0 else contextlib.nullcontext():
            model.zero_grad(set_to_none=True)
            models.cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        assert all(p.grad is None for p in model.parameters()), "a bf16 p.grad was kept alive"
        grads.append({n: p.main_grad.clone() for n, p in dp.params.items()})
        first = [c for c in calls if c]
        assert len(first) == len(dp.params)
        if i == 0:  # one conversion-copy per parameter, nothing else (no zeroing, no add)
            assert all(c == ["copy_.default"] for c in first), first[:3]
        else:
            assert all("add_.Tensor" in c and "copy_.default" not in c for c in first), first[:3]
    # the second micro-batch added the same gradient again: exactly twice the first (fp32 adds)
    assert all(torch.equal(grads[1][n], 2 * grads[0][n]) for n in grads[0])
    # zero_grad writes no zeros (the next first gradients are copies); what is read without a
    # backward in between is zero all the same
    opt.zero_grad()
    assert all(not b.landed and b.stale for b in dp.buckets)
    dp.finish_grad_sync()
    assert all(not b.stale and not b.grad.any() for b in dp.buckets)
    dp.remove_hooks()


# ------------------------------------------------- whole clipped gradients under ZeRO-1
_GRADS: list = []


def _whole_grads(dp, opt):
    def after(step):
        if step == 1:  # the clipped step: every bucket's gradient before and after the call
            part = torch.cat([b.grad.float() for b in dp.buckets])
            opt.clip_whole_grads()
            _GRADS.append((part, torch.cat([b.grad.float() for b in dp.buckets])))

    return after


def job_whole_grads(ctx):
    out = {}
    for impl in ("torch", "reference"):
        for dtype in (torch.float32, torch.bfloat16):
            for zero in (0, 1):
                _GRADS.clear()
                _train(ctx, impl, zero, dtype, variant=_whole_grads)
                out[impl, dtype, zero] = _GRADS[0]
    return out


def test_clip_whole_grads_leaves_zero1_buckets_as_one_process_would():
    """A clipped step clips only the slice of each bucket's gradient this rank updates; under
    ZeRO-1 (dp 2) clip_whole_grads makes the rest the same product, rounded as the kernel rounds
    it (torch's fused kernel divides by 1 / coef, the others multiply), so every dp rank holds
    the gradient an unsharded optimizer leaves, bit for bit (sparse growth reads it)."""
    res = harness.run(2, job_whole_grads, timeout=240)
    for impl in ("torch", "reference"):
        for dtype in (torch.float32, torch.bfloat16):
            what = f"{impl} {dtype}"
            plain_before, plain = res[0][impl, dtype, 0]
            part, whole = res[0][impl, dtype, 1]
            assert torch.equal(plain_before, plain), what + ": zero 0 clipped everything in step()"
            assert not torch.equal(part, plain), what + ": ZeRO-1 step() clipped the whole gradient"
            assert torch.equal(whole, plain), what + ": ZeRO-1 gradient after clip_whole_grads"
            assert torch.equal(res[1][impl, dtype, 1][1], whole), what + ": dp ranks differ"
