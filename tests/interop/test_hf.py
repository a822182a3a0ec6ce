"""Hugging Face interop: tiny random models of each family made with `transformers` -> import ->
meshspeed logits equal theirs; export -> from_pretrained logits equal meshspeed's; round trip
exact; config fields meshspeed cannot reproduce are one-line errors naming them."""

from __future__ import annotations

import json
import os

import pytest
import torch

from meshspeed import comm
from meshspeed.checkpoint.safetensors_io import read_safetensors
from meshspeed.cli import main
from meshspeed.comm.errors import ConfigError
from meshspeed.interop.hf_export import export_hf
from meshspeed.interop.hf_import import HFCheckpoint, hf_recipe
from meshspeed.models.hf import config_from_hf, interleaved_rows, to_interleaved, to_rotate_half
from meshspeed.parallel.materialize import build_parallel_model

transformers = pytest.importorskip("transformers")

COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}  # 16 < seq: the scaled frequencies matter
FAMILIES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(rope_theta=500000.0, rope_scaling=LLAMA3_ROPE)),
    "llama-tied": ("LlamaForCausalLM", "LlamaConfig", dict(tie_word_embeddings=True)),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(sliding_window=None)),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", {}),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
}
TOL = 1e-4
MEASURED: dict[str, dict[str, float]] = {}


def make_hf(name: str, path: str, seed: int = 1, **over):
    """A tiny random `transformers` model of family `name`, saved in shards to `path`. Weights are
    redrawn at std 0.1 (norms and biases around 1) so every tensor, bias and norm matters."""
    cls, cfg_cls, extra = FAMILIES[name]
    torch.manual_seed(seed)
    model = getattr(transformers, cls)(getattr(transformers, cfg_cls)(**{**COMMON, **extra, **over})).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(1.0, 0.1) if p.dim() == 1 else p.normal_(0.0, 0.1)
    model.save_pretrained(path, max_shard_size="20KB")  # several shards + an index
    return model


@pytest.fixture(scope="module")
def solo():
    return comm.ParallelDims().build(comm.init())


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, COMMON["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(0))


def _files(d: str) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            out.update(read_safetensors(os.path.join(d, f))[0])
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_import_export_round_trip(tmp_path, solo, tokens, family):
    src, out = str(tmp_path / "hf"), str(tmp_path / "out")
    theirs = make_hf(family, src)
    ckpt = HFCheckpoint(src)
    ours = build_parallel_model(hf_recipe(ckpt), solo).eval()
    with torch.no_grad():
        want, got = theirs(tokens).logits, ours(tokens)
    imported = (want - got).abs().max().item()
    assert imported <= TOL, f"{family}: import logits differ by {imported}"

    files = export_hf(ours, solo, out, ckpt.config, hf_extra=ckpt.hf_config, max_shard_bytes=30_000)
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 1 and os.path.join(out, "config.json") in files
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back).__name__ == FAMILIES[family][0]
    with torch.no_grad():
        exported = (back(tokens).logits - got).abs().max().item()
    assert exported <= TOL, f"{family}: exported logits differ by {exported}"

    a, b = _files(src), _files(out)  # every tensor back bit for bit, under the same names
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    MEASURED[family] = {"import": imported, "export": exported}


def test_report_measured_differences():
    """Prints the largest absolute logit differences measured above (pytest -s to see them)."""
    for family, d in MEASURED.items():
        print(f"{family:11s} import {d['import']:.2e}  export {d['export']:.2e}")


def test_rotary_permutation_is_needed_and_exact(tmp_path, solo, tokens):
    """Without the q/k row permutation the logits are wrong; the permutation is a pure reorder
    within each head and its inverse undoes it."""
    rows = interleaved_rows(16, 8)
    assert rows.tolist() == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]
    w = torch.randn(16, 5)
    assert torch.equal(to_rotate_half(to_interleaved(w, 8), 8), w)
    src = str(tmp_path / "hf")
    theirs = make_hf("llama", src)
    ckpt = HFCheckpoint(src)
    for s in ckpt.sources.values():
        object.__setattr__(s, "head_dim", 0)  # a name-only mapping
    naive = build_parallel_model(hf_recipe(ckpt), solo).eval()
    with torch.no_grad():
        assert (theirs(tokens).logits - naive(tokens)).abs().max() > 0.01


def test_bf16_files_import_exactly(tmp_path, solo):
    src = str(tmp_path / "hf")
    theirs = make_hf("qwen2", str(tmp_path / "fp32")).to(torch.bfloat16)
    theirs.save_pretrained(src)
    ours = build_parallel_model(hf_recipe(HFCheckpoint(src)), solo)
    assert next(ours.parameters()).dtype == torch.float32
    q = ours.layers["0"].attention.wq.bias
    want = to_interleaved(theirs.model.layers[0].self_attn.q_proj.bias.detach().float(), 16)
    assert torch.equal(q.detach(), want)


def test_cli_convert_both_ways(tmp_path, tokens, capsys):
    src, run, out = str(tmp_path / "hf"), str(tmp_path / "run"), str(tmp_path / "out")
    theirs = make_hf("mixtral", src)
    assert main(["convert", "--from-hf", src, "--out", run]) == 0
    assert os.path.isfile(os.path.join(run, "step-000000", "COMPLETE"))
    assert main(["convert", "--checkpoint", run, "--to-hf", out, "--max-shard-mb", "0.03"]) == 0
    a, b = _files(src), _files(out)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert (cfg["model_type"], cfg["bos_token_id"], cfg["num_local_experts"]) == ("mixtral", 1, 4)
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(back(tokens).logits, theirs(tokens).logits)
    assert main(["convert", "--from-hf", src]) == 2
    assert "give either --from-hf DIR --out RUN_DIR" in capsys.readouterr().err


BASE_HF = {
    "model_type": "llama",
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 80,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"model_type": "gpt2"}, "model_type='gpt2'"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"attention_bias": True}, "attention_bias=True"),
        ({"head_dim": 32}, "head_dim=32"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type='yarn'"),
        ({"quantization_config": {"bits": 4}}, "quantization_config="),
        ({"model_type": "mixtral", "router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
    ],
)
def test_unsupported_config_fields_are_one_line_errors(change, needle):
    with pytest.raises(ConfigError) as e:
        config_from_hf({**BASE_HF, **change})
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_config_mapping():
    c = config_from_hf(
        {
            **BASE_HF,
            "model_type": "mistral",
            "sliding_window": 32,
            "max_position_embeddings": 4096,
            "num_key_value_heads": 2,
            "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
            "torch_dtype": "bfloat16",
            "bos_token_id": 1,
        }
    )
    # a window equals full attention on sequences it covers: the model is capped there
    assert (c.family, c.max_seq_len, c.rope_theta, c.n_kv_heads, c.ffn_hidden) == ("llama", 32, 1e6, 2, 80)
    c = config_from_hf(
        {
            **BASE_HF,
            "model_type": "qwen2",
            "use_sliding_window": False,
            "sliding_window": 8,
            "max_window_layers": 2,
        }
    )
    assert (c.family, c.qkv_bias, c.max_seq_len) == ("qwen2", True, 2048)


def test_mixtral_router_semantics_match():
    """HF Mixtral: softmax over all experts, top-k, renormalise; meshspeed 'after_topk': top-k of
    the logits, softmax over those k. Softmax is monotone and renormalising cancels the other
    experts' share of the denominator, so the choice and the weights are the same."""
    from meshspeed.models.moe import TopKRouter

    router = TopKRouter(16, 8, 2, "after_topk")
    x = torch.randn(200, 16)
    weights, experts, logits = router(x)
    probs = logits.softmax(-1)
    top, idx = probs.topk(2, dim=-1)
    top = top / top.sum(-1, keepdim=True)
    assert torch.equal(experts, idx) and (weights - top).abs().max() <= 1e-6
