"""Generation on the device the model is on (issue 25): the prompt tokens, the masks and the
key/value cache live beside the weights, the cache is allocated once and written in place, and
`meshspeed generate --run.device` runs the whole command there. Each check runs on the CPU and,
where there is one, on a CUDA GPU."""

from __future__ import annotations

import json

import pytest
import torch

from meshspeed import comm
from meshspeed.cli import main
from meshspeed.data.tokenizer import load_tokenizer
from meshspeed.infer import KVCache, generate, left_pad
from meshspeed.infer.cache import installed
from meshspeed.infer.runner import resolve
from meshspeed.interop.hf_import import HFCheckpoint, hf_recipe
from meshspeed.models import build_model, get_preset
from meshspeed.parallel.materialize import build_parallel_model

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; the cpu case runs here")
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (one per replica)")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
SMALL = dict(dim=48, n_layers=2, n_heads=6, n_kv_heads=2, vocab_size=64, ffn_hidden=64, max_seq_len=32)
PROMPTS = [[5, 9, 2], [7, 1, 4, 4, 8, 3, 11], [30], [12, 13, 14, 15, 16]]  # different lengths
TEXTS = ["hello", "a longer prompt here", "x"]


def _model(device: str):
    return build_model(get_preset("tiny", **SMALL), seed=3).eval().to(device)


def _recompute_greedy(m, prompt: list[int], n: int, device: str) -> list[int]:
    """The oracle: no cache, no padding; the whole sequence through the model every step."""
    seq = list(prompt)
    for _ in range(n):
        with torch.no_grad():
            seq.append(int(m(torch.tensor([seq], device=device))[0, -1].argmax()))
    return seq[len(prompt) :]


@pytest.mark.parametrize("device", DEVICES)
def test_cache_is_allocated_once_on_the_device_and_written_in_place(device):
    m = _model(device)
    tokens, valid = (t.to(device) for t in left_pad(PROMPTS))
    steps = [[3, 6, 9, 12], [1, 2, 3, 4], [60, 61, 62, 63]]  # forced next tokens, one per step
    cache = KVCache(valid[:, :0], capacity=tokens.shape[1] + len(steps))
    with torch.no_grad(), installed(m, cache):
        cache.append(valid)
        got = [m(tokens, cache.positions(tokens.shape[1]))[:, -1]]
        where = {i: (k.data_ptr(), cache.v[i].data_ptr()) for i, k in cache.k.items()}
        for s in steps:
            cache.append(torch.ones(len(PROMPTS), 1, dtype=torch.bool))
            got.append(m(torch.tensor(s, device=device)[:, None], cache.positions(1))[:, -1])
    assert sorted(cache.k) == [0, 1]
    for i, k in cache.k.items():
        assert k.device.type == device and k.shape == (4, SMALL["n_kv_heads"], cache.capacity, 8)
        assert (k.data_ptr(), cache.v[i].data_ptr()) == where[i]  # no step reallocated the cache
    assert cache.valid.device.type == device and cache.slots == tokens.shape[1] + len(steps)
    for i, p in enumerate(PROMPTS):  # every cached step's logits equal the whole sequence's
        seq = p + [s[i] for s in steps]
        with torch.no_grad():
            ref = m(torch.tensor([seq], device=device))[0]  # [seq, vocab]
        for j, g in enumerate(got):
            torch.testing.assert_close(g[i], ref[len(p) - 1 + j], rtol=1e-4, atol=1e-4)


def test_cache_without_a_capacity_grows_and_keeps_what_it_held():
    """A cache made without a capacity (the library's old call) doubles when full."""
    m = _model("cpu")
    tokens, valid = left_pad(PROMPTS)
    cache = KVCache(valid[:, :0])
    with torch.no_grad(), installed(m, cache):
        cache.append(valid)
        first = m(tokens, cache.positions(tokens.shape[1]))[:, -1]
        before = cache.k[0][:, :, : cache.slots].clone()
        cache.append(torch.ones(len(PROMPTS), 1, dtype=torch.bool))
        m(torch.tensor([[1], [2], [3], [4]]), cache.positions(1))
    assert cache.capacity >= cache.slots == tokens.shape[1] + 1
    torch.testing.assert_close(cache.k[0][:, :, : tokens.shape[1]], before, rtol=0, atol=0)
    assert first.isfinite().all()


@pytest.mark.parametrize("device", DEVICES)
def test_generate_on_the_device_equals_recomputing(device):
    m = _model(device)
    out = generate(m, PROMPTS, max_new_tokens=6)
    assert out == [_recompute_greedy(m, p, 6, device) for p in PROMPTS]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from tests.interop.test_hf import make_hf

    pytest.importorskip("transformers")
    d = str(tmp_path_factory.mktemp("hf") / "llama")
    make_hf("llama", d, vocab_size=260)  # ≥ 256: the byte tokenizer's ids
    return d


def _cli(hf_dir, out, *extra) -> list[list[int]]:
    argv = ["generate", "--hf", hf_dir, "--max-new-tokens", "5", "--json", str(out), *extra]
    for p in TEXTS:
        argv += ["--prompt", p]
    assert main(argv) == 0
    return [o["token_ids"] for o in json.load(open(out))["outputs"]]


@pytest.mark.parametrize("device", DEVICES)
def test_generate_command_runs_on_the_chosen_device(hf_dir, tmp_path, capsys, device):
    tok = load_tokenizer("bytes")
    ours = build_parallel_model(hf_recipe(HFCheckpoint(hf_dir)), comm.ParallelDims().build(comm.init("gloo")))
    want = generate(ours.eval(), [tok.encode(t) for t in TEXTS], max_new_tokens=5, eos_id=tok.eot)  # CPU
    assert _cli(hf_dir, tmp_path / "out.json", "--run.device", device) == want
    assert f"(rank 0 of 1 on {device};" in capsys.readouterr().out


@pytest.mark.parametrize(
    "device", [pytest.param("cpu", marks=pytest.mark.slow), pytest.param("cuda", marks=TWO_GPUS)]
)
def test_generate_command_data_parallel_on_the_device(hf_dir, tmp_path, device):
    """Two replicas gather their tokens through the backend (NCCL moves device tensors only)."""
    solo = _cli(hf_dir, tmp_path / "solo.json", "--run.device", "cpu")
    dp = ["--nproc", "2", "--parallel.dp", "2", "--run.device", device]
    assert _cli(hf_dir, tmp_path / "dp.json", *dp) == solo


def test_generate_device_choice_with_the_gpu_count_injected(hf_dir):
    opts = dict(hf=hf_dir, prompt=["hi"], max_new_tokens=2, nproc=2, tp=2, dp=1, pp=1)
    job = resolve({**opts, "device": "auto"}, local_gpus=1)
    assert job["device"] == "cpu"
    assert "2 local ranks but 1 GPU" in job["device_notice"]
    assert "add --nproc 1 --parallel.tp 1" in job["device_notice"]
    assert resolve({**opts, "device": "auto"}, local_gpus=2)["device"] == "cuda"
    with pytest.raises(comm.ConfigError) as err:
        resolve({**opts, "device": "cuda"}, local_gpus=1)
    assert "--run.device=cuda needs a GPU per local rank: 2 local ranks, 1 GPU visible" in str(err.value)
