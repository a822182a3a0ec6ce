"""What `parallelize(load_from=...)` is given (issue 44, item 7): a missing directory or a file
(a FileNotFoundError traceback before), integer or boolean tensors for floating-point weights
(cast to float32 without a word before) are one line each, the model left on meta; a sharded
model in the Hugging Face hub cache (shards linked to ../../blobs) loads as `from_pretrained`
loads it (refused before), while a link that leaves the cache's models-- tree is still refused.
Real files and links; two gloo ranks at tp 2."""

from __future__ import annotations

import json
import os

import torch

from meshspeed import comm
from tests import harness
from tests.interop.test_parallelize import TINYNET_PLAN, tiny_net


def job_load(ctx, cases: list[str]):
    """(error line or None, parameters equal to the whole model's pieces) per load_from."""
    import meshspeed

    mesh = comm.ParallelDims(tp=2).build(ctx)
    whole, _ = meshspeed.parallelize(tiny_net(), mesh, plan=TINYNET_PLAN)
    want = dict(whole.named_parameters())
    out = []
    for path in cases:
        with torch.device("meta"):
            born = tiny_net()
        try:
            born, _ = meshspeed.parallelize(born, mesh, plan=TINYNET_PLAN, load_from=path)
        except comm.ConfigError as e:
            out.append((str(e), all(p.is_meta for p in born.parameters())))
            continue
        out.append((None, all(torch.equal(p, want[n]) for n, p in born.named_parameters())))
    return out


def _hub_cache(root, escape: bool = False) -> str:
    """models--me--tiny/snapshots/<rev>/ as the hub writes it: two shards and their index, each
    a relative link to blobs/<name>; `escape`: the second shard's blob sits outside the tree."""
    from safetensors.torch import save_file

    repo = root / "hub" / "models--me--tiny"
    blobs, snap = repo / "blobs", repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    state = tiny_net().state_dict()
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    index = {"metadata": {}, "weight_map": {n: f for f, ns in halves.items() for n in ns}}
    for i, (file, ns) in enumerate(halves.items()):
        where = root / "elsewhere" if escape and i == 1 else blobs
        where.mkdir(exist_ok=True)
        save_file({n: state[n] for n in ns}, str(where / f"blob{i}"))
        os.symlink(os.path.relpath(where / f"blob{i}", snap), snap / file)
    (blobs / "blob-index").write_text(json.dumps(index))
    os.symlink("../../blobs/blob-index", snap / "model.safetensors.index.json")
    return str(snap)


def test_what_load_from_is_given(tmp_path):
    from safetensors.torch import save_file

    state = tiny_net().state_dict()
    for kind, dtype in (("int64", torch.int64), ("bool", torch.bool)):
        (tmp_path / kind).mkdir()
        bad = {**state, "blocks.0.fc1.weight": state["blocks.0.fc1.weight"].to(dtype)}
        save_file(bad, str(tmp_path / kind / "model.safetensors"))
    (tmp_path / "escape").mkdir()
    cases = {
        "missing": str(tmp_path / "nowhere"),
        "a file": str(tmp_path / "int64" / "model.safetensors"),
        "int64": str(tmp_path / "int64"),
        "bool": str(tmp_path / "bool"),
        "hub cache": _hub_cache(tmp_path),
        "escaping link": _hub_cache(tmp_path / "escape", escape=True),
    }
    for rank in harness.run(2, job_load, list(cases.values()), timeout=120):
        got = dict(zip(cases, rank))
        for kind, (line, ok) in got.items():
            assert ok, (kind, line)  # refused: left on meta; loaded: the whole model's pieces
            assert (line is None) == (kind == "hub cache"), (kind, line)
            assert line is None or "\n" not in line, line
        missing = f"load_from={cases['missing']!r} does not exist; give the directory save_pretrained wrote"
        assert got["missing"][0] == "parallelize: " + missing, got["missing"]
        assert "is a file, not a directory" in got["a file"][0]
        for kind, code in (("int64", "I64"), ("bool", "BOOL")):
            assert f"blocks.0.fc1.weight holds {code} values" in got[kind][0], got[kind]
            assert "torch.float32; it is not cast" in got[kind][0], got[kind]
        assert (
            "weight_map" in got["escaping link"][0]
            and "expected a safetensors file name" in got["escaping link"][0]
        )
