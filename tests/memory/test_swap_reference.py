"""`attention_swap_bytes` (what the run plan moves to the host per swapped block) against the
bytes `count_saved` sees leave the device, for the local heads of tp 1, 2 and 4 ranks, grouped-
query attention (one kv head on the rank included: k and v are then broadcast views of it,
which stay), float32 and bfloat16 (whose log-sum-exp stays float32). The formula is never the
expectation here: the device storages swap replaces by host copies, counted around it, are.
The activation estimate's attention term is checked against `count_saved` on the same model.

A rank of tp holds n_heads / tp query heads of head_dim each; its attention core sees exactly
what a one-device model with that many heads (and dim = heads × head_dim) sees, so that model
stands in for the rank."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from meshspeed.memory import apply_swap_activations, count_saved
from meshspeed.memory.estimate import model_activation_bytes
from meshspeed.memory.swap import _Group, attention_swap_bytes
from meshspeed.models import cross_entropy_loss, get_preset, recipe_for

BATCH, SEQ, HEAD_DIM = 2, 16, 8


def _saved(config, dtype, swap: bool) -> tuple[int, int, int]:
    """(bytes count_saved sees, bytes of the device storages swap replaced by host copies,
    bytes of those host copies), the last two counted here around swap's offload."""
    torch.manual_seed(0)
    model = recipe_for(config).build().to(dtype)
    x, y = torch.randint(0, config.vocab_size, (2, BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    moved, host = {}, {}
    offload = _Group.offload

    def counting(self, outputs):
        before = list(self.host)  # the device tensors the core saved
        offload(self, outputs)
        for t, h in zip(before, self.host):
            if not isinstance(h, tuple):  # replaced by a host copy: its storage leaves the device
                moved[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
                host[h.untyped_storage()._cdata] = h.untyped_storage().nbytes()

    if swap:
        apply_swap_activations(model, "cpu")
        _Group.offload = counting
    try:
        with count_saved(model) as c:
            loss = cross_entropy_loss(model(x), y)
    finally:
        _Group.offload = offload
    loss.backward()
    return c.bytes, sum(moved.values()), sum(host.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n_heads,n_kv,tp", [(4, 4, 1), (4, 2, 2), (8, 2, 4), (8, 4, 2)])
def test_attention_swap_bytes_is_what_leaves_the_device(n_heads, n_kv, tp, dtype):
    heads, kv = n_heads // tp, max(1, n_kv // tp)  # this rank's
    config = dataclasses.replace(
        get_preset("tiny"), n_layers=1, n_heads=heads, n_kv_heads=kv, dim=heads * HEAD_DIM, ffn_hidden=32
    )
    assert config.head_dim == HEAD_DIM
    plain, _, _ = _saved(config, dtype, swap=False)
    _, moved, host = _saved(config, dtype, swap=True)
    elem = torch.empty((), dtype=dtype).element_size()
    want = attention_swap_bytes(
        tokens=BATCH * SEQ, n_heads=n_heads, head_dim=HEAD_DIM, tp=tp, elem=elem, n_kv_heads=n_kv
    )
    assert moved == want, f"{moved} B of device storage went to the host, the formula says {want}"
    assert host == want  # and the host copies hold exactly that (no broadcast view written out)
    # the whole model's saved bytes: the estimate's, plus the token ids it leaves out (int64 [T];
    # tests/memory/test_estimate_counted.py) and the loss's scalars (up to 64 B)
    est = model_activation_bytes(config, tokens=BATCH * SEQ, elem=elem) + 8 * BATCH * SEQ
    assert 0 <= plain - est <= 64, f"counted {plain} B saved, the estimate (with the ids) says {est}"
