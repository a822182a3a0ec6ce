"""ModelConfig validation, presets and the analytic counts."""

import pytest
import torch

from meshspeed.models import (
    ModelConfig,
    flops_per_token,
    get_preset,
    llama_ffn_hidden,
    matmul_params,
    param_count,
    preset_names,
    recipe_for,
)

PUBLISHED = {
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "mixtral-8x7b": 46_702_792_704,
    "qwen2-7b": 7_615_616_512,
    # deepseek-ai/deepseek-moe-16b-base: "16.4B" (its config: 28 layers, 64 routed + 2 shared
    # experts of width 1408, first layer dense): counted from those shapes
    "deepseek-moe-16b": 16_375_728_128,
}


def meta_count(config: ModelConfig) -> int:
    with torch.device("meta"):
        model = recipe_for(config).build()
    return sum(p.numel() for p in model.parameters())  # a tied weight is listed once


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_big_presets_match_published_counts(name):
    config = get_preset(name)
    assert meta_count(config) == PUBLISHED[name]
    assert param_count(config) == PUBLISHED[name]


def test_llama3_ffn_width_rule():
    assert llama_ffn_hidden(4096, 1024, 1.3) == 14336
    assert llama_ffn_hidden(8192, 4096, 1.3) == 28672
    assert get_preset("llama3-8b").ffn_dim == 14336


def test_mixtral_active_params():
    # Mistral quotes 12.9B active parameters per token.
    assert round(param_count(get_preset("mixtral-8x7b"), active=True) / 1e9, 1) == 12.9


def test_deepseek_moe_active_params():
    # DeepSeek quotes 2.8B activated parameters (6 of 64 routed experts + the 2 shared).
    assert round(param_count(get_preset("deepseek-moe-16b"), active=True) / 1e9, 1) == 2.8


@pytest.mark.parametrize(
    "config",
    [
        get_preset("tiny"),
        get_preset("tiny-moe"),
        get_preset("small"),
        get_preset("tiny", tie_embeddings=True),
        get_preset("tiny-qwen2"),
        get_preset("tiny-moe", n_layers=4, moe_every=2, first_k_dense=1, n_shared_experts=2),
        get_preset("tiny-moe", n_shared_experts=0, moe_ffn_hidden=None, n_kv_heads=None),
    ],
)
def test_analytic_count_equals_built_model(config):
    assert param_count(config) == meta_count(config)


def test_small_and_tiny_sizes():
    assert param_count(get_preset("tiny")) < 1_000_000
    assert 10_000_000 < param_count(get_preset("small")) < 100_000_000


def test_flops_per_token_formula():
    c = get_preset("tiny")
    norms = c.dim * (2 * c.n_layers + 1)
    n = param_count(c) - c.vocab_size * c.dim - norms  # all but the embedding lookup and norms
    assert matmul_params(c) == n
    assert flops_per_token(c, 64) == 6 * n + 12 * c.n_layers * c.n_heads * c.head_dim * 64
    tied = get_preset("tiny", tie_embeddings=True)
    assert matmul_params(tied) == n  # the tied output is still a matmul
    moe = get_preset("tiny-moe")
    assert matmul_params(moe) == param_count(moe, active=True) - moe.vocab_size * moe.dim - norms
    with pytest.raises(ValueError, match="seq_len=0"):
        flops_per_token(c, 0)


def test_moe_layer_selection():
    c = get_preset("tiny-moe", n_layers=6, moe_every=2, first_k_dense=1)
    assert [c.is_moe_layer(i) for i in range(6)] == [False, True, False, True, False, True]
    assert not any(get_preset("tiny").is_moe_layer(i) for i in range(2))


@pytest.mark.parametrize(
    "kwargs, fragments",
    [
        (dict(dim=512, n_heads=7), ["n_heads=7", "dim=512", "1, 2, 4, 8"]),
        (dict(dim=12, n_heads=4), ["n_heads=4", "head_dim=3", "odd", "1, 2, 3, 6"]),
        (dict(dim=128, n_heads=8, n_kv_heads=3), ["n_kv_heads=3", "n_heads=8", "1, 2, 4, 8"]),
        (dict(n_experts=4, top_k=5), ["top_k=5", "n_experts=4", "between 1 and 4"]),
        (dict(dim=0), ["dim=0", ">= 1"]),
        (dict(n_layers=True), ["n_layers=True", "integer"]),
        (dict(norm_eps=0.0), ["norm_eps=0.0", "> 0"]),
        (dict(aux_loss_coef=-1.0), ["aux_loss_coef=-1.0", ">= 0"]),
        (dict(router_softmax="bogus"), ["router_softmax='bogus'", "after_topk", "before_topk"]),
        (dict(moe_impl="fast"), ["moe_impl='fast'", "grouped_mm", "loop"]),
        (dict(n_shared_experts=1), ["n_shared_experts=1", "n_experts"]),
        (dict(tie_embeddings="yes"), ["tie_embeddings='yes'"]),
        (dict(ffn_dim_multiplier=-2.0), ["ffn_dim_multiplier=-2.0", "1.3"]),
    ],
)
def test_validation_messages(kwargs, fragments):
    with pytest.raises(ValueError) as err:
        ModelConfig(**kwargs)
    message = str(err.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message


def test_unknown_preset_lists_valid_names():
    with pytest.raises(ValueError) as err:
        get_preset("llama-9000")
    for name in preset_names():
        assert name in str(err.value)


def test_preset_overrides_are_validated_and_isolated():
    c = get_preset("tiny", n_layers=3)
    assert c.n_layers == 3 and get_preset("tiny").n_layers == 2
    c.dim = 999  # mutating a returned config must not leak into the preset
    assert get_preset("tiny").dim == 128
    with pytest.raises(ValueError, match="n_heads=5"):
        get_preset("tiny", n_heads=5)
    with pytest.raises(ValueError, match="n_layer"):
        get_preset("tiny", n_layer=3)
