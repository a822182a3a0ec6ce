"""Windowed reads of safetensors files split 3 and 4 ways, against the whole tensors.

Born-sharded loading (`model.init_from` a Hugging Face directory, `parallelize(load_from=...)`)
reads each rank's window [a, b) of a tensor through `SafetensorsFiles.read`. The tests that
load a model do it at tp 2, where a window is either [0, n/2) or [n/2, n): a read of
[a, a + b) would be clipped back to the right rows for the last rank and equal [a, b) for the
first, so it passes. Split 3 or 4 ways (unevenly too) every middle window is a real check:
- tensor level, in this process: every window of every dim of tensors of 1 to 3 dims, through
  `read` and through a `LazyParam` narrowed as materialize narrows it, equals the whole tensor
  (read with safetensors' own loader) sliced;
- model level, at tp 3 and tp 4: a Llama (rotary rows read as a span and picked) and a Qwen2
  (q/k/v biases) built born sharded from their files as `model.init_from` builds them; each
  rank's pieces equal the parameters of the same model read whole in one process, each piece in
  torch.chunk's place; and `parallelize(load_from=...)` on a custom module split by a plan of
  the user's (tests/interop/test_parallelize_load.py's, at tp 2 there) equals the same module
  loaded in memory and split.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from meshspeed import comm
from meshspeed.comm.placement import chunk_bounds, sharding_of
from meshspeed.interop.hf_import import HFCheckpoint, LazyParam, SafetensorsFiles, hf_recipe
from meshspeed.models.hf import HFTensor
from meshspeed.parallel.materialize import build_parallel_model
from tests import harness

needs_hf = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")

SHAPES = {"vec": (13,), "mat": (10, 7), "cube": (5, 9, 4)}  # uneven at 3 and 4 ways


def _windows(n: int, parts: int) -> list[tuple[int, int]]:
    """torch.chunk's pieces of a length-n dim (the split materialize makes), and tensor_split's."""
    offs = chunk_bounds(n, parts)
    out = [(offs[i], offs[i + 1]) for i in range(parts)]
    at = 0
    for i in range(parts):  # tensor_split: the first n % parts pieces one longer
        size = n // parts + (i < n % parts)
        out.append((at, at + size))
        at += size
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    d = tmp_path_factory.mktemp("st")
    g = torch.Generator().manual_seed(0)
    save_file({k: torch.randn(s, generator=g) for k, s in SHAPES.items()}, str(d / "model.safetensors"))
    whole = load_file(str(d / "model.safetensors"))  # safetensors' own reader: the reference
    return SafetensorsFiles(str(d), "test"), whole


@pytest.mark.parametrize("parts", [3, 4])
def test_every_window_read_equals_the_whole_tensor_sliced(files, parts):
    st, whole = files
    checked = 0
    for name, shape in SHAPES.items():
        for dim, n in enumerate(shape):
            for a, b in _windows(n, parts):
                window = [(0, m) for m in shape]
                window[dim] = (a, b)
                got = st.read(name, window)
                want = whole[name].narrow(dim, a, b - a)
                assert got.shape == want.shape and torch.equal(got, want), (name, dim, (a, b), parts)
                # as materialize cuts a rank's piece: a handle narrowed, then read by .to()
                lazy = LazyParam(st, name, HFTensor((name,)), torch.Size(shape)).narrow(dim, a, b - a)
                assert torch.equal(lazy.to(torch.float32), want), (name, dim, (a, b), parts)
                checked += 1
        # a window in two dims at once (a tp piece of an expert's or a 2-D split weight)
        if len(shape) > 1:
            for (a, b), (c, e) in zip(_windows(shape[0], parts), _windows(shape[1], parts)):
                rest = [(0, m) for m in shape[2:]]
                want = whole[name][a:b, c:e]
                assert torch.equal(st.read(name, [(a, b), (c, e), *rest]), want), (name, (a, b), (c, e))
    assert checked >= 2 * parts * sum(len(s) for s in SHAPES.values())


# Heads divide 3 and 4 (GQA, 2 query heads per kv head); the FFN splits unevenly at 4 and the
# vocabulary at 3 (test_tensor.py's DENSE shapes, as a Hugging Face config).
HF = dict(
    vocab_size=256,
    hidden_size=96,
    intermediate_size=102,
    num_hidden_layers=2,
    num_attention_heads=24,
    num_key_value_heads=12,
    max_position_embeddings=64,
)
FAMILIES = {"llama": ("LlamaForCausalLM", "LlamaConfig"), "qwen2": ("Qwen2ForCausalLM", "Qwen2Config")}


def _save(kind: str, path: str) -> None:
    import transformers

    cls, cfg_cls = FAMILIES[kind]
    torch.manual_seed(1)
    model = getattr(transformers, cls)(getattr(transformers, cfg_cls)(**HF))
    with torch.no_grad():  # every entry distinct and away from zero, biases and norms included
        for p in model.parameters():
            p.normal_(1.0, 0.1) if p.dim() == 1 else p.normal_(0.0, 0.1)
    model.save_pretrained(path, max_shard_size="40KB")  # several shards and an index


def job_pieces(ctx, dirs: dict, net_dir: str) -> dict:
    """This rank's pieces of each model born sharded at tp = world, with their split dims."""
    mesh = comm.ParallelDims(tp=ctx.world_size).build(ctx)
    out = {}
    for kind, path in dirs.items():
        model = build_parallel_model(hf_recipe(HFCheckpoint(path)), mesh)
        pieces = {}
        for name, p in model.named_parameters():
            s = sharding_of(p)
            pieces[name] = (p.detach().clone(), s.shard_dims().get("tp") if s is not None else None)
        out[kind] = pieces
    if net_dir:  # parallelize(load_from=...) on a custom module with a plan of the user's
        import meshspeed
        from tests.interop.test_parallelize import TINYNET_PLAN, tiny_net

        with torch.device("meta"):
            born = tiny_net()
        born, _ = meshspeed.parallelize(born, mesh, plan=TINYNET_PLAN, load_from=net_dir)
        whole, _ = meshspeed.parallelize(tiny_net(), mesh, plan=TINYNET_PLAN)  # cut from memory
        pairs = zip(born.named_parameters(), whole.named_parameters(), strict=True)
        out["net"] = {
            n: (list(p.shape), list(q.shape), p.shape == q.shape and torch.equal(p, q))
            for (n, p), (_, q) in pairs
        }
    return out


@needs_hf
@pytest.mark.parametrize("tp", [3, 4])
def test_born_sharded_pieces_at_tp_3_and_4_are_the_whole_models(tmp_path, tp):
    dirs = {kind: str(tmp_path / kind) for kind in FAMILIES}
    for kind, path in dirs.items():
        _save(kind, path)
    from safetensors.torch import save_file

    from tests.interop.test_parallelize import tiny_net

    (tmp_path / "net").mkdir()
    save_file(tiny_net().state_dict(), str(tmp_path / "net" / "model.safetensors"))
    results = harness.run(tp, job_pieces, dirs, str(tmp_path / "net"), timeout=180)
    solo = comm.ParallelDims().build(comm.init())
    for kind, path in dirs.items():
        whole = dict(build_parallel_model(hf_recipe(HFCheckpoint(path)), solo).named_parameters())
        assert sorted(results[0][kind]) == sorted(whole), kind
        split = 0
        for name, full in whole.items():
            dims = {r[kind][name][1] for r in results}
            assert len(dims) == 1, (kind, name, dims)
            dim = dims.pop()
            if dim is None:  # replicated: every rank holds all of it
                for rank, r in enumerate(results):
                    assert torch.equal(r[kind][name][0], full), (kind, name, rank)
                continue
            split += 1
            offs = chunk_bounds(full.shape[dim], tp)
            for rank, r in enumerate(results):
                piece = r[kind][name][0]
                want = full.narrow(dim, offs[rank], offs[rank + 1] - offs[rank])
                assert piece.shape == want.shape, (kind, name, rank, list(piece.shape), list(want.shape))
                assert torch.equal(piece, want), (kind, name, rank)
        assert split >= 7 * HF["num_hidden_layers"], (kind, split)  # q k v o gate up down per layer
    for rank, r in enumerate(results):  # the custom module: each parameter the piece cut from memory
        wrong = {n: v for n, v in r["net"].items() if not v[2]}
        assert not wrong, (rank, wrong)
        split = {
            n for n, (shape, _, _) in r["net"].items() if shape != list(tiny_net().get_parameter(n).shape)
        }
        assert {"blocks.0.fc1.weight", "blocks.1.fc2.weight", "head.weight"} <= split, split
