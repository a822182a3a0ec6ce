"""Ring attention's explicit-mask block path, the one CUDA takes (there is no flash kernel with
a log-sum-exp there), run on the CPU by forcing it: outputs and q/k/v gradients against the
single-device SDPA attention, causal and packed documents, at every ring cp size the CPU path
is tested at (ring 2, 3, 4; hybrid 2 × 2 and its ring-only form at 3).

On the CPU the ring sends fully visible and same-chunk (causal) blocks to torch's fused kernel,
so the explicit path's own causal mask (`_causal_mask`) and its unmasked blocks run nowhere else
on a machine without a GPU. The job counts the blocks each kind of mask reached, so a test that
silently took the fused path again would fail.
"""

from __future__ import annotations

import pytest

from tests import harness
from tests.parallel.test_context import job_attention

# (world size, impl, cp_ulysses): every case of test_context.CASES with a ring of 2 or more
RING_CASES = [(2, "ring", 1), (3, "ring", 1), (4, "ring", 1), (4, "hybrid", 2), (3, "hybrid", 1)]


def job_forced(ctx, impl: str, u: int, packed: bool) -> tuple[list[str], dict]:
    from meshspeed.parallel import ring_blocks

    fused, causal_mask = ring_blocks.fused, ring_blocks.causal_mask
    seen = {"none": 0, "causal": 0, "documents": 0}

    def counting(mask, q, k):
        kind = "none" if mask is None else "causal" if mask is ring_blocks.CAUSAL else "documents"
        seen[kind] += 1
        return causal_mask(mask, q, k)

    ring_blocks.fused = lambda q, mask: False  # what any device but the CPU gets
    ring_blocks.causal_mask = counting
    try:
        return job_attention(ctx, impl, u, packed), seen
    finally:
        ring_blocks.fused, ring_blocks.causal_mask = fused, causal_mask


@pytest.mark.parametrize("packed", [False, True], ids=["causal", "packed"])
@pytest.mark.parametrize("ws,impl,u", RING_CASES)
def test_explicit_mask_blocks_match_single_device(ws, impl, u, packed):
    results = harness.run(ws, job_forced, impl, u, packed)
    assert [bad for bad, _ in results] == [[]] * ws
    seen = {k: sum(s[k] for _, s in results) for k in ("none", "causal", "documents")}
    if packed:  # every block carries its document mask
        assert seen["documents"] > 0 and seen["none"] == seen["causal"] == 0, seen
    else:  # zigzag: fully visible blocks and same-chunk (causal) blocks, forward and backward
        assert seen["none"] > 0 and seen["causal"] > 0 and seen["documents"] == 0, seen
