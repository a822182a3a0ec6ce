"""`--memory.swap_activations`: the attention cores' saved q, k, v and log-sum-exp go to host
memory in forward (counted: the device keeps exactly attention_swap_bytes less per block) and
come back in backward, the next core's copy started ahead; gradients are bit-identical on one
model, and training on one process, dp 2 × tp 2 with sequence parallelism and pp 2 × dp 2;
swap_layers picks the first blocks; the dry run moves the bytes from activations to host."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from meshspeed import cli
from meshspeed.memory import apply_swap_activations, count_saved
from meshspeed.memory.swap import attention_swap_bytes
from meshspeed.models import get_preset, recipe_for
from tests import harness
from tests.memory.test_fp32_reuse import assert_identical, job_rows
from tests.memory.test_trainer_recompute import BASE


def _run(config, swap_layers):
    torch.manual_seed(0)
    model = recipe_for(config).build()
    x = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    swap = apply_swap_activations(model, "cpu", swap_layers) if swap_layers != "off" else None
    with count_saved(model) as counted:
        logits = model(x)
    logits.float().logsumexp(-1).mean().backward()
    return counted.bytes, swap, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("layers", [None, 1])
def test_swapped_bytes_leave_the_device_and_gradients_are_identical(kv_heads, layers):
    config = dataclasses.replace(get_preset("tiny"), n_layers=3, n_heads=4, n_kv_heads=kv_heads)
    plain_bytes, _, plain_grads = _run(config, "off")
    kept, swap, grads = _run(config, layers)
    n = config.n_layers if layers is None else layers
    per = attention_swap_bytes(tokens=64, n_heads=4, head_dim=config.head_dim, elem=4)
    assert swap.stats["swapped_bytes"] == n * per and swap.stats["swapped_tensors"] == 4 * n
    assert plain_bytes - kept == n * per  # what autograd still holds on the device
    # backward fetched the last core on demand, each earlier one ahead of its use
    assert swap.stats["fetched_on_demand"] == 1 and swap.stats["prefetched"] == n - 1
    assert all(torch.equal(a, b) for a, b in zip(plain_grads, grads))


LAYOUTS = {  # name: (ranks, settings)
    "one-process": (1, [("parallel.tp", "1")]),
    "dp2-tp2-sp": (4, [("parallel.tp", "2"), ("parallel.sequence_parallel", "true")]),
    "pp2-dp2": (4, [("parallel.tp", "1"), ("parallel.pp", "2")]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_training_is_bit_identical_with_swapped_activations(tmp_path, name):
    ranks, extra = LAYOUTS[name]
    variants = [[], [("memory.swap_activations", "true")], [("memory.swap_activations", "true")]]
    variants[2] += [("memory.recompute", "activation"), ("memory.swap_layers", "1")]
    for got in harness.run(ranks, job_rows, str(tmp_path), BASE + extra, variants, 3, timeout=300):
        assert_identical(got, name)


def test_dry_run_moves_the_attention_bytes_to_the_host(tmp_path, capsys):
    args = ["train", "--nproc", "4", "--parallel.tp", "2", "--model.n_layers", "4"]
    args += ["--train.seq_len", "64", "--train.micro_batch_size", "2", "--train.global_batch_size", "8"]
    args += ["--run.dir", str(tmp_path / "r"), "--dry-run", "--json"]
    plans = []
    for extra in (
        [],
        ["--memory.swap_activations", "true"],
        ["--memory.swap_activations", "true", "--memory.swap_layers", "1"],
    ):
        assert cli.main(args + extra) == 0
        plans.append(json.loads(capsys.readouterr().out))
    c = get_preset("tiny")
    # tiny's 2 kv heads at tp 2: one per rank, so k and v stay (broadcast views; test_swap_reference.py)
    per = attention_swap_bytes(
        tokens=64 * 2, n_heads=c.n_heads, head_dim=c.dim // c.n_heads, tp=2, elem=4, n_kv_heads=c.n_kv_heads
    )
    for n, plan in ((4, plans[1]), (1, plans[2])):
        for plain, swapped in zip(plans[0]["ranks"], plan["ranks"]):
            p, s = plain["memory"], swapped["memory"]
            assert p["activations"] - s["activations"] == n * per and s["host"] == n * per
            back = min(n, 2) * per  # in backward: the core being run and the prefetched one
            assert s["buffers"] - p["buffers"] == back and s["saved"] == {"swap_activations": n * per - back}
