"""`meshspeed.parallelize` on a `transformers` MistralForCausalLM (a sliding window shorter than
the sequence) and an untied Qwen2ForCausalLM (q/k/v biases, its own head, a full-attention layer
then a sliding-window one): the plain loop of
test_parallelize.py at tp 2 and at dp 2 × tp 2 with sequence parallelism gives the losses and
gradient norms of the same loop on one process within 1e-5, and `save_pretrained` of
`gather_for_save` loads with `from_pretrained` and gives the one-process model's logits. Both
families run inside one worker call per layout: each pool pays its `transformers` import once."""

from __future__ import annotations

import pytest
import torch

from tests import harness
from tests.interop.test_parallelize import (
    EPS,
    TOL,
    VOCAB,
    batches,
    job_loop,
    logits_of,
    needs_hf,
    one_process,
    tiny_llama,
)

FAMILIES = ("mistral", "qwen2-untied")
STEPS = 4  # a short loop: the claim is the first losses (AdamW's eps: EPS, see there)


def job_families(ctx, dims: dict, kw: dict, out: str):
    return {kind: job_loop(ctx, kind, dims, kw, f"{out}/{kind}", STEPS)[:2] for kind in FAMILIES}


@needs_hf
@pytest.mark.parametrize(
    "ws, dims, kw",
    [
        pytest.param(2, dict(tp=2), dict(zero=1), id="tp2"),
        pytest.param(4, dict(dp=2, tp=2), dict(zero=1, sequence_parallel=True), id="dp2-tp2-sp"),
    ],
)
def test_mistral_and_qwen2_loops_equal_one_process(tmp_path, ws, dims, kw):
    import transformers

    results = harness.run(ws, job_families, dims, {**kw, "eps": EPS}, str(tmp_path), timeout=180)
    for kind in FAMILIES:
        want_losses, want_norms, want_logits, _ = one_process(kind, STEPS, EPS)
        for rank_result in results:
            losses, norms = rank_result[kind]
            assert max(abs(a - b) for a, b in zip(losses, want_losses)) < TOL, (kind, losses, want_losses)
            assert max(abs(a - b) for a, b in zip(norms, want_norms)) < TOL, (kind, norms, want_norms)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / kind)).float()
        assert type(loaded).__name__ == type(tiny_llama(kind)).__name__
        got = logits_of(loaded, True)
        torch.testing.assert_close(got, want_logits, atol=TOL, rtol=0, msg=lambda m: f"{kind}: {m}")


@needs_hf
def test_the_windows_are_live_and_the_qwen2_biases_are_split():
    """What the parity above exercises: Mistral's window and Qwen2's windowed layer change their
    logits at SEQ (so a tp path that lost either would differ), and the untied Qwen2's plan
    splits q/k/v with their biases."""
    import transformers

    from meshspeed.interop.hf_plan import hf_recipe

    mistral = tiny_llama("mistral")
    x = batches(VOCAB)[0][:2]
    with torch.no_grad():
        windowed = mistral(input_ids=x).logits
        mistral.config.sliding_window = None
        full = mistral(input_ids=x).logits
    assert (windowed - full).abs().max() > 1e-3

    qwen = tiny_llama("qwen2-untied")
    assert qwen.config.layer_types == ["full_attention", "sliding_attention"], qwen.config.layer_types
    unwindowed = qwen.config.to_dict() | dict(use_sliding_window=False, layer_types=None)
    plain = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**unwindowed)).float()
    plain.load_state_dict(qwen.state_dict())
    with torch.no_grad():
        assert (qwen(input_ids=x).logits - plain(input_ids=x).logits).abs().max() > 1e-3
    assert qwen.model.layers[0].self_attn.q_proj.bias is not None
    plan = dict(hf_recipe(qwen, 2, sequence_parallel=False).tp_plan)
    for proj in ("q_proj", "k_proj", "v_proj"):
        assert plan[f"model.layers.*.self_attn.{proj}"] == "colwise", plan
    assert plan["lm_head"] == "colwise_gathered", plan


@needs_hf
def test_a_config_the_plan_cannot_describe_is_one_line():
    import transformers

    from meshspeed.comm import ConfigError
    from meshspeed.interop.hf_plan import hf_recipe

    config = transformers.LlamaConfig(**tiny_llama("llama").config.to_dict())
    config.attention_bias = True  # meshspeed's Llama has no attention biases
    with pytest.raises(ConfigError) as e:
        hf_recipe(transformers.LlamaForCausalLM(config), 2, sequence_parallel=False)
    msg = str(e.value)
    assert "\n" not in msg and "LlamaForCausalLM" in msg and "attention_bias" in msg and "plan=" in msg, msg
