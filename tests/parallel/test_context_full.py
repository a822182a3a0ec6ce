"""Context parallelism with full (non-causal) attention — the dit family's image tokens — against
one device: the attention core alone, then the whole dit built born-sharded through
build_parallel_model with the cp core swapped in (recipe.causal=False: every ring block, no
skipping; recipe.cp_tokens: patch tokens cut after their positions are added, gathered before
unpatchify; the conditioning and text tokens whole on every rank).

Each rank computes the single-device reference from the same seeds. The cp model's output
(gathered whole) must equal the reference's rows of its dp shard, and its gradients averaged over
dp × cp (the trainer's dp_cp reduction) the reference's. A causal core on the same model must not.
"""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch
import torch.nn.functional as F

from meshspeed import comm
from meshspeed.comm.placement import full_grad
from meshspeed.models import ModelConfig, build_model, recipe_for
from meshspeed.parallel.context import apply_context_parallel, context_parallel, shard_sequence
from meshspeed.parallel.materialize import build_parallel_model
from meshspeed.train.objectives.flow import flow_loss, noisy
from tests import harness
from tests.parallel.test_context import close, packed_docs, rnd

# 36 image tokens, 12 heads: split by cp 2, 3 and 4, and by Ulysses 2 inside tp 2's 6 heads
CFG = dict(
    family="dit", dim=48, n_layers=2, n_heads=12, image_size=12, patch_size=2, in_channels=2,
    n_classes=5, learn_sigma=True, text_dim=6,
)  # fmt: skip


def job_full_attention(ctx, impl: str, u: int, packed: bool) -> list[str]:
    b, s, h, d = 2, 24, 6, 8
    q, k, v, w = (rnd(i, b, s, h, d) for i in range(1, 5))
    docs = packed_docs(b, s) if packed else None
    mask = None if docs is None else (docs[:, :, None] == docs[:, None, :])[:, None]
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in ref_in), attn_mask=mask).transpose(1, 2)
    (ref * w).sum().backward()

    mesh = comm.ParallelDims(cp=ctx.world_size).build(ctx)
    core = context_parallel(mesh, impl, cp_ulysses=u, causal=False)
    pos = core.positions(s)
    mine = [shard_sequence(t, pos).requires_grad_() for t in (q, k, v)]
    out = core(*mine, None if docs is None else shard_sequence(docs, pos))
    (out * shard_sequence(w, pos)).sum().backward()
    bad = [] if close(out, shard_sequence(ref.detach(), pos)) else ["output"]
    bad += [f"d{n}" for n, t, r in zip("qkv", mine, ref_in) if not close(t.grad, shard_sequence(r.grad, pos))]
    return bad


@pytest.mark.parametrize("packed", [False, True], ids=["whole", "packed"])
@pytest.mark.parametrize("ws,impl,u", [(2, "ring", 1), (3, "ulysses", 1), (4, "hybrid", 2)])
def test_full_attention_matches_single_device(ws, impl, u, packed):
    assert harness.run(ws, job_full_attention, impl, u, packed) == [[]] * ws


def random_init(fqn: str, shape, seed: int = 0) -> torch.Tensor:
    """Every parameter random (the zero-initialised modulations too: every path carries a
    gradient), from (seed, name) only, so each rank's piece is the reference's slice."""
    gen = torch.Generator().manual_seed(seed * 7919 + zlib.crc32(fqn.encode()))
    return 0.1 * torch.randn(tuple(shape), generator=gen)


def random_reference(cfg: ModelConfig):
    """(the recipe whose init is random_init, the one-device model holding those values)."""
    recipe = dataclasses.replace(recipe_for(cfg), init=random_init)
    ref = build_model(cfg)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(random_init(name, p.shape))
    return recipe, ref


def _batch(cfg: ModelConfig, n: int):
    gen = torch.Generator().manual_seed(11)
    x0, eps = (torch.randn(n, cfg.in_channels, 12, 12, generator=gen) for _ in range(2))
    t, y = torch.rand(n, generator=gen), torch.randint(0, cfg.n_classes + 1, (n,), generator=gen)
    return x0, eps, t, y, torch.randn(n, 5, cfg.text_dim, generator=gen)


def _run(model, batch):
    x0, eps, t, y, text = batch
    out = model(noisy(x0, eps, t), t, y, text)
    return out, flow_loss(out, x0, eps)


def job_dit_cp(ctx, impl: str, u: int, dp: int, tp: int, sp: bool) -> list[str]:
    cfg = ModelConfig(**CFG)
    recipe, ref = random_reference(cfg)
    batch = _batch(cfg, 2 * dp)
    ref_out, ref_loss = _run(ref, batch)
    ref_loss.backward()

    cp = ctx.world_size // (dp * tp)
    mesh = comm.ParallelDims(dp=dp, cp=cp, tp=tp).build(ctx)
    model = build_parallel_model(recipe, mesh, sequence_parallel=sp)
    core = context_parallel(mesh, impl, cp_ulysses=u, causal=recipe.causal)
    assert apply_context_parallel(model, core, tokens=recipe.cp_tokens) == cfg.n_layers
    seen = []  # the tokens each block's attention runs on: this rank's share only
    model.blocks["0"].attention.wq.register_forward_hook(lambda m, i, o: seen.append(o.shape[1]))
    rows = slice(2 * mesh["dp"].rank, 2 * mesh["dp"].rank + 2)
    out, loss = _run(model, [x[rows] for x in batch])
    loss.backward()
    bad = [] if seen == [36 // cp] else [f"attention ran on {seen} tokens, want [{36 // cp}]"]
    if not close(out, ref_out[rows].detach()):
        bad.append(f"output max err {(out - ref_out[rows]).abs().max().item():.3g}")
    mean = comm.all_reduce(loss.detach().clone(), mesh["dp"], "avg")
    if not torch.allclose(mean, ref_loss, rtol=1e-5):
        bad.append(f"loss {mean.item()} != {ref_loss.item()}")
    want = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        comm.all_reduce(p.grad, mesh["dp_cp"], "avg")  # what the trainer's gradient reduction does
        got = full_grad(p, {"tp": mesh["tp"]})
        if not close(got, want[name].grad):
            bad.append(f"{name}: grad max err {(got - want[name].grad).abs().max().item():.3g}")

    # The test has the power to see a causal mask: the same model under a causal core differs.
    causal = context_parallel(mesh, impl, cp_ulysses=u, causal=True)
    apply_context_parallel(model, causal)
    with torch.no_grad():
        if close(_run(model, [x[rows] for x in batch])[0], ref_out[rows].detach()):
            bad.append("a causal core gives the same output: the check cannot see causality")
    return bad


# (world size, impl, cp_ulysses, dp, tp, sequence parallel): cp 2 ring and Ulysses, cp 3 (not a
# power of two), cp 2 × dp 2, cp 2 × tp 2 with SP (Ulysses over each tp rank's 6 heads), and
# hybrid (Ulysses 2 × ring 2) at cp 4.
DIT_CASES = [
    (2, "ring", 1, 1, 1, False),
    (2, "ulysses", 1, 1, 1, False),
    (3, "ring", 1, 1, 1, False),
    (3, "ulysses", 1, 1, 1, False),
    (4, "ring", 1, 2, 1, False),
    (4, "ulysses", 1, 1, 2, True),
    (4, "hybrid", 2, 1, 1, False),
]


@pytest.mark.parametrize("ws,impl,u,dp,tp,sp", DIT_CASES)
def test_dit_context_parallel_matches_single_device(ws, impl, u, dp, tp, sp):
    assert harness.run(ws, job_dit_cp, impl, u, dp, tp, sp) == [[]] * ws


# --- through the Trainer: train.objective=flow on the built-in digits ------------------------

FLOW_BASE = [
    ("model.preset", "dit-tiny"),  # 16 image tokens, 4 heads
    ("train.objective", "flow"),
    ("train.global_batch_size", "8"),
    ("train.micro_batch_size", "2"),
    ("train.dtype", "float32"),
    ("train.eval_interval", "0"),
    ("train.warmup_steps", "1"),
    ("train.lr", "3e-3"),
    ("flow.sample_n", "0"),
    ("train.eval_batches", "1"),
    ("parallel.tp", "1"),
]
STEPS = 4


def job_flow_losses(ctx, run_dir: str, extra: list) -> tuple[list, list]:
    from meshspeed.plan import config
    from meshspeed.train.trainer import Trainer

    cfg = config.load(None, FLOW_BASE + [("run.dir", run_dir), ("train.steps", str(STEPS))] + extra)
    trainer = Trainer(cfg, ctx)
    rows = [trainer.train_step(s) for s in range(STEPS)]
    # then the validation loss (every sample at the 8 stratified timesteps: 8× the rows)
    return [r["loss"] for r in rows] + [trainer.validate()], [r["grad_norm"] for r in rows]


FLOW_LAYOUTS = [
    ("cp2-ring", 2, [("parallel.cp", "2"), ("parallel.cp_impl", "ring")]),
    ("cp2-dp2-ulysses", 4, [("parallel.cp", "2"), ("parallel.cp_impl", "ulysses")]),
    ("cp2-dp2-zero3", 4, [("parallel.cp", "2"), ("parallel.zero", "3")]),
    (
        "cp2-tp2-sp-ring",
        4,
        [("parallel.cp", "2"), ("parallel.tp", "2"), ("parallel.sequence_parallel", "true")],
    ),
]
_FLOW_REF: list = []


@pytest.mark.parametrize("name,ws,extra", FLOW_LAYOUTS, ids=[x[0] for x in FLOW_LAYOUTS])
def test_flow_training_under_cp_equals_single_process(tmp_path_factory, name, ws, extra):
    from tests.train.test_trainer import assert_rows_close

    if not _FLOW_REF:
        ref_dir = str(tmp_path_factory.mktemp("flow-ref"))
        _FLOW_REF.append(harness.run(1, job_flow_losses, ref_dir, [], timeout=180)[0])
    want = _FLOW_REF[0]
    got = harness.run(ws, job_flow_losses, str(tmp_path_factory.mktemp(name)), extra, timeout=240)
    assert_rows_close(got, want, name)
    assert want[0][-2] < want[0][0] - 0.1  # learning: the equality is not about constants


@pytest.mark.parametrize(
    "extra,match",
    [
        (
            [("parallel.cp", "3")],
            r"parallel.cp=3 does not divide the 16 image tokens .* use cp among \[2, 4, 8, 16\]",
        ),
        ([("parallel.cp", "8"), ("parallel.cp_impl", "ulysses")], "splits 4 attention heads over 8 ranks"),
    ],
)
def test_plan_refuses_bad_dit_cp_in_one_line(tmp_path, extra, match):
    from meshspeed.comm.errors import ConfigError
    from meshspeed.plan import config
    from meshspeed.plan.run_plan import make_plan

    cfg = config.load(None, FLOW_BASE + [("run.dir", str(tmp_path))] + extra)
    with pytest.raises(ConfigError, match=match) as e:
        make_plan(cfg, int(dict(extra)["parallel.cp"]), ranks=False)
    assert "\n" not in str(e.value)
