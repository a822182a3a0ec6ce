"""SFT and DPO under every layout equal one process: losses, gradient norms and DPO's reward
metrics per step, at world sizes 2, 3 and 4 (dp with ZeRO-3, tp + SP, pp, cp over packed
conversations, MoE with ep), through the real Trainer in the pooled gloo workers.

Also the identities that hold whatever the layout: at step 0 the DPO loss is ln 2 and the
rewards, margins and accuracy are 0; gradient accumulation 8 × 1 equals 1 × 8 for SFT (whose
loss is per token over the global batch, not a mean of micro-batch means); precomputed and
live reference give the same losses.
"""

from __future__ import annotations

import json
import math
import random

import pytest

from meshspeed.plan import config
from meshspeed.train.trainer import Trainer
from tests import harness

STEPS = 3
BASE = [
    ("model.n_heads", "4"),
    ("model.n_kv_heads", "4"),
    ("train.seq_len", "32"),
    ("train.global_batch_size", "12"),
    ("train.micro_batch_size", "2"),
    ("train.dtype", "float32"),
    ("train.eval_interval", "0"),
    ("train.eval_batches", "1"),
    ("train.warmup_steps", "2"),
    ("train.lr", "1e-2"),
    ("parallel.tp", "1"),
]
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")


def write_data(d) -> dict[str, str]:
    """Conversations (one and two assistant turns: answers of different lengths, so
    micro-batches hold different numbers of answer tokens) and preference pairs."""
    r = random.Random(0)
    chat, pairs = d / "chat.jsonl", d / "pairs.jsonl"
    with open(chat, "w") as f:
        for i in range(96):
            a, b = r.randint(1, 99), r.randint(1, 99)
            msgs = [{"role": "user", "content": f"{a}+{b}?"}, {"role": "assistant", "content": str(a + b)}]
            if i % 3 == 0:
                msgs += [
                    {"role": "user", "content": "x2?"},
                    {"role": "assistant", "content": str(2 * (a + b))},
                ]
            f.write(json.dumps({"messages": msgs}) + "\n")
    with open(pairs, "w") as f:
        for _ in range(96):
            a, b = r.randint(1, 99), r.randint(1, 99)
            wrong = a + b + r.choice([-10, -1, 1, 10])
            f.write(json.dumps({"prompt": f"{a}+{b}?", "chosen": str(a + b), "rejected": str(wrong)}) + "\n")
    return {"sft": str(chat), "dpo": str(pairs)}


def job_rows(ctx, run_dir: str, extra: list, steps: int):
    cfg = config.load(None, BASE + [("run.dir", run_dir), ("train.steps", str(steps))] + extra)
    trainer = Trainer(cfg, ctx)
    rows = [trainer.train_step(s) for s in range(steps)]
    val = trainer.validate()
    return [[r["loss"], r["grad_norm"]] + [r.get(k, 0.0) for k in METRICS] for r in rows] + [[val]]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_data(tmp_path_factory.mktemp("post-data"))


_REF: dict = {}


def reference(tmp_path_factory, data, objective: str, extra=()):
    key = (objective, tuple(extra))
    if key not in _REF:
        d = str(tmp_path_factory.mktemp(f"ref-{objective}"))
        base = [("train.objective", objective), ("data.path", data[objective]), *extra]
        _REF[key] = harness.run(1, job_rows, d, base, STEPS)[0]
    return _REF[key]


def assert_close(got: list, want: list, name: str, rel: float = 2e-5, norm_rel: float = 2e-4):
    assert all(g == got[0] for g in got), f"{name}: ranks disagree"
    g_rows, w_rows = got[0], want
    for step, (g, w) in enumerate(zip(g_rows, w_rows)):
        for i, (a, b) in enumerate(zip(g, w)):
            # rewards are beta × differences of float32 sums of log-probabilities: an absolute
            # floor of 1e-6 (rel × 0.05) for those near zero
            tol = (norm_rel if i == 1 else rel) * max(abs(b), 0.05)
            assert abs(a - b) <= tol, f"{name} step {step} column {i}: {a} vs one process {b}"


MOE = [("model.preset", "tiny-moe"), ("model.n_kv_heads", "2")]
LAYOUTS = [
    ("dp2-zero3", 2, [("parallel.zero", "3")]),
    ("dp3", 3, []),
    ("tp2-sp", 2, [("parallel.tp", "2"), ("parallel.sequence_parallel", "true")]),
    ("dp2-tp2-sp", 4, [("parallel.tp", "2"), ("parallel.sequence_parallel", "true")]),
    ("pp2", 2, [("parallel.pp", "2")]),
    ("pp2-dp2-zero1", 4, [("parallel.pp", "2"), ("parallel.zero", "1")]),
    ("cp2", 2, [("parallel.cp", "2")]),
    ("cp2-ulysses-dp2", 4, [("parallel.cp", "2"), ("parallel.cp_impl", "ulysses")]),
    ("moe-ep2", 2, MOE + [("parallel.ep", "2")]),
]


@pytest.mark.parametrize("objective", ["sft", "dpo"])
@pytest.mark.parametrize("name,ws,extra", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_layout_equals_one_process(tmp_path_factory, data, objective, name, ws, extra):
    want = reference(tmp_path_factory, data, objective, MOE if name.startswith("moe") else ())
    d = str(tmp_path_factory.mktemp(f"{objective}-{name}"))
    got = harness.run(
        ws, job_rows, d, [("train.objective", objective), ("data.path", data[objective])] + extra, STEPS
    )
    assert_close(got, want, f"{objective} {name}")


def test_sft_packed_under_cp_equals_one_process(tmp_path_factory, data):
    packed = [("data.packing", "true")]
    want = reference(tmp_path_factory, data, "sft", packed)
    d = str(tmp_path_factory.mktemp("sft-packed-cp"))
    extra = [("train.objective", "sft"), ("data.path", data["sft"]), ("parallel.cp", "2")] + packed
    assert_close(harness.run(2, job_rows, d, extra, STEPS), want, "sft packed cp2")


def test_dpo_step0_identities(tmp_path_factory, data):
    rows = reference(tmp_path_factory, data, "dpo")
    loss, _, chosen, rejected, acc, margin = rows[0]
    assert abs(loss - math.log(2)) < 1e-6
    assert chosen == rejected == acc == margin == 0.0
    assert rows[STEPS - 1][4] > 0, "the policy moved away from the reference"


@pytest.mark.parametrize("loss,want", [("hinge", 1.0), ("ipo", (1 / (2 * 0.1)) ** 2)])
def test_dpo_step0_other_losses(tmp_path_factory, data, loss, want):
    rows = reference(tmp_path_factory, data, "dpo", [("dpo.loss", loss)])
    assert abs(rows[0][0] - want) < 1e-6 * want


def test_sft_accumulation_8x1_equals_1x8(tmp_path_factory, data):
    """SFT normalises by the global batch's answer tokens: accumulation does not change it."""
    base = [("train.objective", "sft"), ("data.path", data["sft"]), ("train.global_batch_size", "8")]
    d1, d8 = (str(tmp_path_factory.mktemp(f"acc{m}")) for m in (1, 8))
    one = harness.run(1, job_rows, d1, base + [("train.micro_batch_size", "1")], STEPS)[0]
    eight = harness.run(1, job_rows, d8, base + [("train.micro_batch_size", "8")], STEPS)[0]
    for step, (a, b) in enumerate(zip(one[:STEPS], eight[:STEPS])):
        assert abs(a[0] - b[0]) <= 1e-5 * abs(b[0]), f"step {step}: loss {a[0]} (8 × 1) vs {b[0]} (1 × 8)"
        assert abs(a[1] - b[1]) <= 1e-4 * abs(b[1]), f"step {step}: grad norm {a[1]} vs {b[1]}"


def test_dpo_precomputed_reference_equals_live(tmp_path_factory, data):
    live = reference(tmp_path_factory, data, "dpo")
    d = str(tmp_path_factory.mktemp("dpo-pre"))
    extra = [("train.objective", "dpo"), ("data.path", data["dpo"]), ("dpo.precompute_reference", "true")]
    got = harness.run(2, job_rows, d, extra + [("parallel.pp", "2")], STEPS)
    assert_close(got, live, "dpo precomputed reference, pp2")


def job_reference_frozen(ctx, run_dir: str, extra: list, steps: int):
    """After `steps` DPO steps: the largest change of any reference weight, whether any has a
    gradient or sits in the data-parallel buckets the optimizer updates, and how far the loss
    moved (the policy must learn while the reference stays)."""
    cfg = config.load(None, BASE + [("run.dir", run_dir), ("train.steps", str(steps))] + extra)
    trainer = Trainer(cfg, ctx)
    before = {n: p.detach().clone() for n, p in trainer.reference.model.named_parameters()}
    losses = [trainer.train_step(s)["loss"] for s in range(steps)]
    ref = dict(trainer.reference.model.named_parameters())
    ref_change = max(float((ref[n] - before[n]).abs().max()) for n in before)
    with_grad = [n for n, p in ref.items() if p.grad is not None or p.requires_grad]
    in_opt = {id(p) for p in trainer.dp.params.values()} & {id(p) for p in ref.values()}
    return ref_change, with_grad, len(in_opt), abs(losses[-1] - losses[0])


@pytest.mark.parametrize("ws,extra", [(1, []), (2, [("parallel.tp", "2")]), (2, [("parallel.zero", "3")])])
def test_dpo_reference_stays_the_starting_weights(tmp_path, data, ws, extra):
    extra = [("train.objective", "dpo"), ("data.path", data["dpo"])] + extra
    for ref_change, with_grad, in_opt, moved in harness.run(
        ws, job_reference_frozen, str(tmp_path), extra, 3
    ):
        assert ref_change == 0.0 and not with_grad and in_opt == 0
        assert moved > 0
