"""The activation estimator (meshspeed.memory.estimate) against the bytes counted with
saved-tensor hooks: dense models, every recompute mode, single device and tp 2 / 3 with and
without sequence parallelism, within 10%."""

from __future__ import annotations

import pytest
import torch

from meshspeed import comm
from meshspeed.memory import RECOMPUTE_MODES, apply_recompute, count_saved
from meshspeed.memory.estimate import model_activation_bytes
from meshspeed.models import build_model, cross_entropy_loss, get_preset, recipe_for
from meshspeed.parallel.tensor import model_loss, parallelize
from tests import harness

CONFIGS = (
    dict(dim=96, n_layers=2, n_heads=24, n_kv_heads=12, vocab_size=256, ffn_hidden=102, max_seq_len=32),
    dict(dim=96, n_layers=3, n_heads=12, n_kv_heads=6, vocab_size=384, ffn_hidden=160, max_seq_len=32),
)
BATCH, SEQ = 2, 24


def _errors(mesh=None, sp: bool = False) -> list[str]:
    bad = []
    tp = 1 if mesh is None else mesh["tp"].size
    for overrides in CONFIGS:
        config = get_preset("tiny", **overrides)
        gen = torch.Generator().manual_seed(5)
        tokens = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=gen)
        counted = []
        for mode, layers in [(m, None) for m in RECOMPUTE_MODES] + [("full", 1)]:
            model = build_model(config, seed=3)
            if mesh is not None:
                model = parallelize(model, mesh, recipe_for(config), sequence_parallel=sp)
            apply_recompute(model, mode, layers)
            with count_saved(model) as c:
                if mesh is None:
                    cross_entropy_loss(model(tokens), tokens)
                else:
                    model_loss(model, tokens, tokens)
            est = model_activation_bytes(
                config, tokens=BATCH * SEQ, mode=mode, layers=layers, tp=tp, sequence_parallel=sp
            )
            if abs(est - c.bytes) > 0.1 * c.bytes:
                bad.append(
                    f"dim {config.dim} {mode}/{layers} tp {tp} sp {sp}: estimate {est}, counted {c.bytes}"
                )
            if layers is None:
                counted.append(c.bytes)
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
