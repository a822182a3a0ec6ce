"""`meshspeed.parallelize` on the user's own model and loop (issue 29): a `transformers` Llama and
a custom nn.Module trained by a plain loop under tp, dp × tp + SP, ZeRO-1/2/3, compared step by
step with the same loop on one process without meshspeed (torch.optim.AdamW): losses and
gradient norms within 1e-5, and `save_pretrained` of `gather_for_save` loads in `transformers`
with the one-process model's logits. An unrecognised model with tp and no plan is one line."""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshspeed import comm
from tests import harness

STEPS, BATCH, SEQ, VOCAB, LR = 10, 12, 32, 256, 1e-3  # BATCH: divisible by dp 2, 3 and 4
TOL = 1e-5
CLIP = 0.5  # max_norm: below the Llama's first gradient norm (0.72), so clipping acts
WINDOW = 8  # Mistral's sliding window, a quarter of SEQ
# AdamW's eps for the Hugging Face parities whose saved logits are compared: at torch's 1e-8 the
# first step moves an element whose gradient is ~1e-8 (an lm_head row of a token no target
# uses) by lr * g / (|g| + eps), a sign function of g, so a 1e-12 rounding difference in g
# became 3e-6 of weight and a 1.1e-5 logit difference (seen on Llama and Mistral at tp 2). At
# 1e-6 such an element moves by lr * g / eps and its rounding stays ~1e-9: the comparison
# measures the parallel path, not AdamW's conditioning. Both sides use the same eps.
EPS = 1e-6

needs_hf = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")


# --- the models and the loop, as a user writes them ------------------------------------------


def tiny_llama(family: str = "llama") -> nn.Module:
    import transformers  # here, not at the top: spawned ranks import this module to find jobs

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
    )
    cfg, cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen2-untied": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    }[family]
    if family == "qwen2":
        common["tie_word_embeddings"] = True  # the head and the embedding split alike, one Parameter
    if family == "qwen2-untied":  # q/k/v biases, a head of its own, and layer 1 of 2 windowed
        common.update(tie_word_embeddings=False, use_sliding_window=True, sliding_window=WINDOW)
        common["max_window_layers"] = 1  # Qwen2 windows the layers from this index on
    if family == "mistral":
        common["sliding_window"] = WINDOW  # shorter than SEQ, so the window changes the loss
    if family == "mixtral":  # 6 experts, 2 per token: ep 2 and 3 each leave every member experts
        common.update(num_local_experts=6, num_experts_per_tok=2, intermediate_size=48)
    torch.manual_seed(0)
    return cls(cfg(**common)).float()


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, h):
        return h + self.fc2(F.gelu(self.fc1(self.norm(h))))


class TinyNet(nn.Module):
    """Not a Llama: embedding, MLP blocks with LayerNorm and biases, a head."""

    def __init__(self, vocab: int = 64, dim: int = 32, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


TINYNET_PLAN = {"blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise", "head": "colwise_gathered"}


def tiny_net() -> nn.Module:
    torch.manual_seed(0)
    return TinyNet()


def batches(vocab: int, steps: int = STEPS) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (BATCH, SEQ), generator=g) for _ in range(steps)]


def loss_of(model, x, hf: bool):
    if hf:
        return model(input_ids=x, labels=x).loss
    logits = model(x[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())


def logits_of(model, hf: bool):
    x = batches(VOCAB if hf else 64)[0][:2]
    with torch.no_grad():
        return (model(input_ids=x).logits if hf else model(x)).float()


@functools.cache
def one_process(kind: str, steps: int = STEPS, eps: float = 1e-8):
    """The loop on one process, without meshspeed: (losses, grad norms, final logits, weights)."""
    hf = kind != "net"
    model = tiny_llama(kind) if hf else tiny_net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=eps)
    losses, norms = [], []
    for x in batches(VOCAB if hf else 64, steps):
        loss = loss_of(model, x, hf)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, logits_of(model, hf), model.state_dict()


def job_loop(ctx, kind: str, dims: dict, kw: dict, out: str | None, steps: int = STEPS, model=None):
    """The same loop through meshspeed.parallelize (of `model`, default a new one of `kind`);
    rank 0 saves with save_pretrained."""
    import meshspeed

    hf = kind != "net"
    if model is None:
        model = tiny_llama(kind) if hf else tiny_net()
    mesh = comm.ParallelDims(**dims).build(ctx)
    model, opt = meshspeed.parallelize(model, mesh, lr=LR, **kw)
    st = model.meshspeed
    rows = BATCH // st.dp_size
    losses, norms = [], []
    for x in batches(VOCAB if hf else 64, steps):
        x = x[st.dp_rank * rows : (st.dp_rank + 1) * rows]  # this replica's samples
        loss = loss_of(model, x, hf)
        loss.backward()
        norms.append(float(meshspeed.clip_grad_norm_(model, CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(float(comm.all_reduce(loss.detach().reshape(1), mesh["dp"], "avg")))
    state = meshspeed.gather_for_save(model)
    if hf and out and ctx.rank == 0:
        model.save_pretrained(out, state_dict=state)
    full = {k: v.clone() for k, v in state.items()} if not hf and ctx.rank == 0 else None
    return losses, norms, full


LLAMA_LAYOUTS = [
    pytest.param(2, dict(tp=2), dict(zero=1), id="tp2"),
    pytest.param(4, dict(dp=2, tp=2), dict(zero=1, sequence_parallel=True), id="dp2-tp2-sp"),
    pytest.param(2, dict(dp=2), dict(zero=3), id="dp2-zero3"),
]


@needs_hf
@pytest.mark.parametrize("ws, dims, kw", LLAMA_LAYOUTS)
def test_hf_llama_loop_equals_one_process(tmp_path, ws, dims, kw):
    import transformers

    want_losses, want_norms, want_logits, _ = one_process("llama", STEPS, EPS)
    kw = {**kw, "eps": EPS}
    results = harness.run(ws, job_loop, "llama", dims, kw, str(tmp_path / "hf"), timeout=120)
    for losses, norms, _ in results:
        assert max(abs(a - b) for a, b in zip(losses, want_losses)) < TOL, (losses, want_losses)
        assert max(abs(a - b) for a, b in zip(norms, want_norms)) < TOL, (norms, want_norms)
    assert want_norms[0] > CLIP  # clipping was active, so the clip path is checked too
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).float()
    torch.testing.assert_close(logits_of(loaded, True), want_logits, atol=TOL, rtol=0)


@needs_hf
def test_qwen2_tied_tp2_sp_with_biases_equals_one_process(tmp_path):
    want_losses, want_norms, want_logits, _ = one_process("qwen2")
    kw = dict(zero=2, sequence_parallel=True)
    results = harness.run(2, job_loop, "qwen2", dict(tp=2), kw, str(tmp_path / "q"), timeout=120)
    for losses, norms, _ in results:
        assert max(abs(a - b) for a, b in zip(losses, want_losses)) < TOL
        assert max(abs(a - b) for a, b in zip(norms, want_norms)) < TOL
    import transformers

    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "q")).float()
    torch.testing.assert_close(logits_of(loaded, True), want_logits, atol=TOL, rtol=0)


NET_LAYOUTS = [
    pytest.param(2, dict(dp=2), dict(zero=2), id="dp2-zero2"),
    pytest.param(3, dict(dp=3), dict(zero=3), id="dp3-zero3"),
    pytest.param(4, dict(dp=2, tp=2), dict(zero=1, plan=TINYNET_PLAN), id="dp2-tp2-plan"),
]


@pytest.mark.parametrize("ws, dims, kw", NET_LAYOUTS)
def test_custom_module_loop_equals_one_process(ws, dims, kw):
    want_losses, want_norms, _, weights = one_process("net")
    results = harness.run(ws, job_loop, "net", dims, kw, None)
    for losses, norms, _ in results:
        assert max(abs(a - b) for a, b in zip(losses, want_losses)) < TOL, (losses, want_losses)
        assert max(abs(a - b) for a, b in zip(norms, want_norms)) < TOL, (norms, want_norms)
    full = results[0][2]  # gather_for_save: the one-process model's weights after the same steps
    assert sorted(full) == sorted(weights)
    diffs = {name: (full[name] - t).abs().max().item() for name, t in weights.items()}
    # 1e-4, not 1e-5: on an element whose gradient is ~0 (a vocabulary row no target used),
    # AdamW's normalised update turns a 1e-9 rounding difference into ~1e-5 of weight (seen:
    # 1.1e-5 on one head.weight element, every other tensor within 3e-7)
    assert max(diffs.values()) < 1e-4, diffs


def job_refused(ctx, plan):
    import meshspeed

    try:
        meshspeed.parallelize(tiny_net(), comm.ParallelDims(tp=2).build(ctx), plan=plan)
    except comm.ConfigError as e:
        return str(e)
    return None


def test_unrecognised_model_with_tp_and_no_plan_is_one_line():
    msgs = harness.run(2, job_refused, None)
    msg = msgs[0]
    assert msg is not None and "\n" not in msg, msg
    assert "'embed' (Embedding)" in msg and "plan=" in msg and "docs/parallelize.md" in msg, msg
