"""One AdamW step over a flat shard whose `DecayLayout` decays nothing, or everything.

A ZeRO shard is a slice of a bucket, so it can hold only norms and biases (no decayed range) or
only matrices (every element decayed); tests/parallel/test_fused_adamw.py checks mixed layouts
only. Each impl (torch's fused kernel, the reference, the Triton kernel under its interpreter)
is compared with torch.optim.AdamW given the parameters in the right param groups (weight decay
0 for the norms and biases), over a few steps, within a few roundings of each value.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import pytest
import torch

from meshspeed.kernels import adamw as K

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernel is built, as test_fused_adamw.py does
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LR, BETAS, EPS, WD = 3e-3, (0.9, 0.95), 1e-8, 0.1

# (shapes, decayed?) per case: norm weights and biases alone; matrices alone, the shard ending
# on a 16-aligned slot (the layout's one range is the whole shard) or padded after the last slot
# (the undecayed rest is padding only)
CASES = {
    "none decayed": ([(64,), (48,), (33,), (7,)], False),
    "all decayed, whole shard": ([(16, 5), (8, 6), (4, 4)], True),
    "all decayed, padded slots": ([(37, 5), (33, 17), (3, 3)], True),
}
IMPLS = {
    "torch": K.adamw_torch,
    "reference": K.adamw_reference,
    "triton": K.adamw_triton,
}


def _ulp(x: torch.Tensor) -> torch.Tensor:
    x = x.abs()
    return torch.nextafter(x, torch.full_like(x, float("inf"))) - x


def _slots(ps) -> tuple[list[int], int]:
    """Each parameter's offset in the shard (16-aligned, as bucket slots are) and its length."""
    offs, at = [], 0
    for p in ps:
        offs.append(at)
        at = -(-(at + p.numel()) // 16) * 16
    return offs, at


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("case", list(CASES))
def test_a_shard_decayed_nowhere_or_everywhere_steps_as_torch_adamw(case, impl):
    if impl == "triton" and importlib.util.find_spec("triton") is None:
        pytest.skip("triton is in the dev extra: pip install -e .[dev]")
    shapes, decayed = CASES[case]
    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    offs, n = _slots(ps)
    # each decayed slot a range of its own (buckets.segments would merge them: either is valid)
    ranges = [(o, o + p.numel()) for p, o in zip(ps, offs)] if decayed else []
    layout = K.DecayLayout(n, ranges)
    assert layout.none_decayed == (not decayed)
    assert layout.all_decayed == (case == "all decayed, whole shard")
    opt = torch.optim.AdamW(
        [{"params": ps, "weight_decay": WD if decayed else 0.0}], lr=LR, betas=BETAS, eps=EPS, foreach=False
    )
    master, grad, m, v = (torch.zeros(n) for _ in range(4))
    for p, o in zip(ps, offs):
        master[o : o + p.numel()] = p.detach().flatten()
    master, grad, m, v = (t.to(DEVICE) for t in (master, grad, m, v))
    fn = IMPLS[impl]
    if impl == "reference":
        fn = functools.partial(fn, ieee_sqrt=True)
    for step in range(1, 4):
        for p, o in zip(ps, offs):
            p.grad = torch.randn(p.shape, generator=g)
            grad[o : o + p.numel()] = p.grad.flatten().to(DEVICE)
        opt.step()
        fn(master, grad, m, v, K.AdamWHyper(LR, *BETAS, EPS, WD, step), layout)
        for p, o in zip(ps, offs):
            sl = slice(o, o + p.numel())
            want = (p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])
            for name, got, w in zip(("param", "exp_avg", "exp_avg_sq"), (master, m, v), want):
                got, w = got[sl].cpu(), w.flatten()
                # a parameter's rounding errors are the updates' (about lr each), summed over steps
                floor = torch.tensor(LR if name == "param" else 0.0)
                scale = torch.maximum(torch.maximum(got.abs(), w.abs()), floor)
                worst = ((got - w).abs() / _ulp(scale)).max().item()
                assert worst <= 8, f"{case} {impl} step {step} {name} {list(p.shape)}: {worst:.0f} ulp off"
        pad = torch.ones(n, dtype=torch.bool)
        for p, o in zip(ps, offs):
            pad[o : o + p.numel()] = False
        assert not master.cpu()[pad].any(), "padding between slots must stay zero"
