"""Checkpoints: resharding across tp / dp / ZeRO, atomicity, keep-last-N, RNG, safetensors.

Tensor-parallel layers live elsewhere, so the tests shard a model themselves: build the full
model identically on every rank, replace chosen parameters by their torch.chunk shard and tag
them (contract 1). The optimizer is a stand-in implementing contract 2, with an optional ZeRO
mode that keeps a 1/dp slice of each state tensor and gathers in `state_dict_per_param`.
Every expected value is computed from the full single-device tensors, never from the code
under test.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import random
import struct

import pytest
import torch
from torch import nn

from meshspeed import comm
from meshspeed.checkpoint import dcp as ckpt
from meshspeed.checkpoint.export import export_safetensors
from meshspeed.checkpoint.safetensors_io import read_safetensors, write_safetensors
from meshspeed.comm import placement
from meshspeed.models import Transformer, get_preset, init_weights
from tests import harness

# (FQN suffix, dim) of tensor-parallel shards; the odd sizes give uneven and empty shards.
PLAN = [
    ("tok_embeddings.weight", 0),
    ("wq.weight", 0),
    ("wk.weight", 0),
    ("wv.weight", 0),
    ("wo.weight", 1),
    ("w1.weight", 0),
    ("w3.weight", 0),
    ("w2.weight", 1),
    ("output.weight", 0),
    ("odd.weight", 0),
    ("odd.bias", 0),
    ("odd2", 1),
    ("lowp", 1),
]
STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")


class Model(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        self.net = Transformer(get_preset("tiny", n_layers=1))
        init_weights(self.net, seed)
        g = torch.Generator().manual_seed(seed)
        self.odd = nn.Linear(5, 6)  # weight [6, 5] over tp 4: rows 2,2,2,0
        with torch.no_grad():
            self.odd.weight.copy_(torch.randn(6, 5, generator=g))
            self.odd.bias.copy_(torch.randn(6, generator=g))
        self.odd2 = nn.Parameter(torch.randn(3, 7, generator=g))  # dim 1 over tp 4: 2,2,2,1
        self.lowp = nn.Parameter(torch.randn(4, 6, generator=g).bfloat16())


def _bounds(n: int, parts: int, i: int) -> tuple[int, int]:
    c = math.ceil(n / parts)
    start = min(i * c, n)
    return start, max(0, min(c, n - start))


def _dim_of(name: str):
    return next((d for suffix, d in PLAN if name.endswith(suffix)), None)


def _local(full: torch.Tensor, dim, tp: int, i: int) -> torch.Tensor:
    if dim is None:
        return full
    start, length = _bounds(full.shape[dim], tp, i)
    return full.narrow(dim, start, length)


def sharded_model(mesh, seed: int) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The model with planned params replaced by this rank's tp shard; also the full values.
    With pp > 1, stage s keeps only its share of the parameters (same FQNs)."""
    model = Model(seed)
    if mesh.dims.pp > 1:
        names = [n for n, _ in model.named_parameters()]
        mine = set(names[mesh.coords["pp"] :: mesh.dims.pp])
        for name in names:
            if name not in mine:
                owner, _, leaf = name.rpartition(".")
                (model.get_submodule(owner) if owner else model)._parameters.pop(leaf)
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    tp, i = mesh.dims.tp, mesh.coords["tp"]
    for name, p in list(model.named_parameters()):
        dim = _dim_of(name)
        if dim is None:
            continue
        owner, _, leaf = name.rpartition(".")
        q = nn.Parameter(_local(p.detach(), dim, tp, i).clone())
        placement.tag(q, placement.Sharding(p.shape, (("tp", placement.Shard(dim)),)))
        setattr(model.get_submodule(owner) if owner else model, leaf, q)
    return model, full


def full_state(name: str, shape, key: str) -> torch.Tensor:
    seed = int.from_bytes(hashlib.blake2b(f"{name}/{key}".encode(), digest_size=7).digest(), "little")
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


class StandInOptimizer:
    """Contract 2. zero=True: each dp rank keeps a torch.chunk slice of each flattened state."""

    def __init__(self, model, mesh, zero: bool = False, fill: bool = True):
        self.mesh, self.zero = mesh, zero
        self.params = dict(model.named_parameters())
        self.step = 7 if fill else 0
        self.state, self.shapes = {}, {}
        tp, i = mesh.dims.tp, mesh.coords["tp"]
        for name, p in self.params.items():
            self.shapes[name] = p.shape
            sharding = placement.sharding_of(p)
            full_shape = sharding.full_shape if sharding is not None else p.shape
            self.state[name] = {}
            for k in STATE_KEYS:
                local = (
                    _local(
                        full_state(name, full_shape, k),
                        _dim_of(name) if sharding is not None else None,
                        tp,
                        i,
                    )
                    if fill
                    else torch.zeros(p.shape)
                )
                self.state[name][k] = self._keep(local)

    def _keep(self, local: torch.Tensor) -> torch.Tensor:
        if not self.zero:
            return local.clone()
        dp = self.mesh["dp"]
        start, length = _bounds(local.numel(), dp.size, dp.rank)
        return local.reshape(-1)[start : start + length].clone()

    def state_dict_per_param(self) -> dict:
        out: dict = {"__step__": self.step}
        for name, st in self.state.items():
            entry = {}
            for k, v in st.items():
                if self.zero:
                    dp, n = self.mesh["dp"], self.shapes[name].numel()
                    sizes = [_bounds(n, dp.size, r)[1] for r in range(dp.size)]
                    v = comm.all_gather(v, dp, sizes=sizes).reshape(self.shapes[name])
                entry[k] = v
            out[name] = entry
        return out

    def load_state_dict_per_param(self, d: dict) -> None:
        self.step = d["__step__"]
        for name in self.state:
            for k in STATE_KEYS:
                assert d[name][k].shape == self.shapes[name], (name, k, d[name][k].shape)
                self.state[name][k] = self._keep(d[name][k].float())


def _check_layout(mesh, model, opt, expect_seed: int) -> None:
    """Every local param and state tensor equals this rank's chunk of the expected full tensor."""
    full = {n: p.detach() for n, p in Model(expect_seed).named_parameters()}
    tp, i = mesh.dims.tp, mesh.coords["tp"]
    for name, p in model.named_parameters():
        want = _local(full[name], _dim_of(name), tp, i)
        assert p.dtype == full[name].dtype and torch.equal(p.detach(), want), f"param {name} differs"
    per = opt.state_dict_per_param()
    assert per["__step__"] == 7
    for name, p in model.named_parameters():
        for k in STATE_KEYS:
            want = _local(full_state(name, full[name].shape, k), _dim_of(name), tp, i)
            assert torch.equal(per[name][k], want), f"optimizer state {name}.{k} differs"


def _reshard(ctx, run_dir: str, save: dict, loads: list[dict]) -> int:
    dims = {k: v for k, v in save.items() if k != "zero"}
    mesh = comm.ParallelDims(**dims).build(ctx)
    model, _ = sharded_model(mesh, seed=1)
    opt = StandInOptimizer(model, mesh, zero=save.get("zero", False))
    path = ckpt.save_checkpoint(run_dir, 5, model, opt, mesh)
    checked = 0
    for layout in loads:
        dims = {k: v for k, v in layout.items() if k != "zero"}
        mesh2 = comm.ParallelDims(**dims).build(ctx)
        model2, _ = sharded_model(mesh2, seed=2)  # different weights: the load must overwrite them
        opt2 = StandInOptimizer(model2, mesh2, zero=layout.get("zero", False), fill=False)
        state = ckpt.load_checkpoint(path, model2, opt2, mesh2)
        assert state["step"] == 5
        _check_layout(mesh2, model2, opt2, expect_seed=1)
        checked += 1
    return checked


def test_reshard_tp2_to_tp1_and_zero_dp2_to_tp2(tmp_path):
    assert harness.run(2, _reshard, str(tmp_path / "a"), {"tp": 2}, [{"dp": 2}, {"dp": 2, "zero": True}]) == [
        2,
        2,
    ]
    assert harness.run(2, _reshard, str(tmp_path / "b"), {"dp": 2, "zero": True}, [{"tp": 2}]) == [1, 1]


def test_reshard_pipeline_stages_to_one_stage_and_back(tmp_path):
    # Each stage writes only its parameters; DCP's metadata is the union the loader reads.
    out = harness.run(
        4, _reshard, str(tmp_path / "a"), {"pp": 2, "tp": 2}, [{"dp": 2, "tp": 2}, {"pp": 2, "dp": 2}]
    )
    assert out == [2] * 4


def test_reshard_dp2_tp2_zero_to_tp4_and_dp4(tmp_path):
    out = harness.run(
        4,
        _reshard,
        str(tmp_path),
        {"dp": 2, "tp": 2, "zero": True},
        [{"tp": 4}, {"dp": 4}, {"dp": 2, "tp": 2}],
    )
    assert out == [3] * 4


def _saved_data_is_deduplicated(ctx, run_dir: str) -> int:
    mesh = comm.ParallelDims(dp=2, tp=2).build(ctx)
    model, _ = sharded_model(mesh, seed=1)
    path = ckpt.save_checkpoint(run_dir, 1, model, None, mesh)
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".distcp"))


def test_replicas_are_written_once(tmp_path):
    nbytes = harness.run(4, _saved_data_is_deduplicated, str(tmp_path))[0]
    payload = sum(p.numel() * p.element_size() for p in Model(1).parameters())
    assert payload <= nbytes < 1.5 * payload  # dp=2 replicas of every shard would double it


@dataclasses.dataclass
class _Cfg:
    lr: float = 3e-4
    name: str = "tiny"


def _resume(ctx, run_dir: str) -> list:
    mesh = comm.ParallelDims(tp=2).build(ctx)
    model, _ = sharded_model(mesh, seed=1)
    torch.manual_seed(100 + ctx.rank)
    random.seed(200 + ctx.rank)
    ckpt.save_checkpoint(
        run_dir,
        3,
        model,
        StandInOptimizer(model, mesh),
        mesh,
        config=_Cfg(),
        scheduler_state={"last_epoch": 3, "base_lrs": [0.1]},
        extra={"data": {"epoch": 1}},
    )
    first = (torch.rand(4), random.random())
    torch.manual_seed(0)  # lose the stream
    random.seed(0)
    model2, _ = sharded_model(mesh, seed=2)
    state = ckpt.load_checkpoint(run_dir, model2, StandInOptimizer(model2, mesh, fill=False), mesh)
    again = (torch.rand(4), random.random())
    assert torch.equal(first[0], again[0]) and first[1] == again[1], "RNG not restored"
    assert state["rng_restored"] and state["step"] == 3
    assert state["scheduler_state"] == {"last_epoch": 3, "base_lrs": [0.1]}
    assert state["extra"] == {"data": {"epoch": 1}} and state["config"] == {"lr": 3e-4, "name": "tiny"}
    return first[0].tolist()


def test_resume_restores_step_scheduler_extra_config_and_rng(tmp_path):
    firsts = harness.run(2, _resume, str(tmp_path))
    assert firsts[0] != firsts[1]  # each rank got its own stream back


class _Fault(OSError):
    pass


def _atomic(ctx, run_dir: str, where: str) -> str:
    from meshspeed.comm import checkpoint_io

    mesh = comm.ParallelDims(tp=2).build(ctx)
    model, _ = sharded_model(mesh, seed=1)
    good = ckpt.save_checkpoint(run_dir, 1, model, None, mesh)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1)
    target, attr = (checkpoint_io.FileSystemWriter, "write_data") if where == "dcp" else (ckpt, "_save_rng")
    original = getattr(target, attr)

    def broken(*a, **k):
        raise _Fault("disk full (injected)")

    if ctx.rank == 1:
        setattr(target, attr, broken)
    try:
        ckpt.save_checkpoint(run_dir, 2, model, None, mesh)
    except ckpt.CheckpointError as e:
        msg = str(e)
    else:
        raise AssertionError("a save that failed on rank 1 reported success")
    finally:
        setattr(target, attr, original)
    assert "rank 1" in msg, msg
    assert ckpt.latest_checkpoint(run_dir) == good
    # After the failed save: the previous checkpoint loads and holds the old values.
    fresh, _ = sharded_model(mesh, seed=2)
    assert ckpt.load_checkpoint(run_dir, fresh, None, mesh)["step"] == 1
    _check_params_only(mesh, fresh, seed=1)
    comm.barrier(mesh["world"])
    return msg


def _check_params_only(mesh, model, seed: int) -> None:
    full = {n: p.detach() for n, p in Model(seed).named_parameters()}
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), _local(full[name], _dim_of(name), mesh.dims.tp, mesh.coords["tp"])), (
            name
        )


@pytest.mark.parametrize("where", ["dcp", "rng"])
def test_failed_save_leaves_previous_checkpoint_latest(tmp_path, where):
    msgs = harness.run(2, _atomic, str(tmp_path), where)
    assert "disk full" in msgs[1] and "rank 1" in msgs[0]
    assert sorted(os.listdir(tmp_path)) == ["step-000001"]  # no step-000002, no temp dir


def _crash_leftovers(ctx, run_dir: str) -> list:
    mesh = comm.ParallelDims(dp=2).build(ctx)
    model, _ = sharded_model(mesh, seed=1)
    ckpt.save_checkpoint(run_dir, 1, model, None, mesh)
    if ctx.rank == 0:  # what a crash mid-save leaves: a temp dir, even one holding a COMPLETE marker
        for name in ("step-000007.tmp-00000000dead", "step-000008"):
            os.makedirs(os.path.join(run_dir, name))
            open(os.path.join(run_dir, name, ".metadata"), "w").close()
        open(os.path.join(run_dir, "step-000007.tmp-00000000dead", "COMPLETE"), "w").close()
    comm.barrier(mesh["world"])
    latest = ckpt.latest_checkpoint(run_dir)
    try:
        ckpt.load_checkpoint(os.path.join(run_dir, "step-000008"), model, None, mesh)
    except ckpt.CheckpointError as e:
        assert "not a complete checkpoint" in str(e)
    else:
        raise AssertionError("loaded a checkpoint without COMPLETE")
    ckpt.save_checkpoint(run_dir, 2, model, None, mesh, keep=None)
    return [os.path.basename(latest), sorted(os.listdir(run_dir))]


def test_crash_leftovers_are_ignored_then_cleaned(tmp_path):
    latest, names = harness.run(2, _crash_leftovers, str(tmp_path))[0]
    assert latest == "step-000001"
    assert names == ["step-000001", "step-000002", "step-000008"]  # the temp dir is gone


def _keep(ctx, run_dir: str) -> list:
    mesh = comm.ParallelDims(tp=2).build(ctx)
    model, _ = sharded_model(mesh, seed=1)
    for step in (10, 20, 30, 40, 50):
        ckpt.save_checkpoint(run_dir, step, model, None, mesh, keep=2)
    ckpt.save_checkpoint(run_dir, 50, model, None, mesh, keep=2)  # the same step again replaces it
    kept = [[s for s, _ in ckpt.list_checkpoints(run_dir)]]
    ckpt.save_checkpoint(run_dir, 15, model, None, mesh, keep=2)  # a branch from an earlier step: kept
    kept.append([s for s, _ in ckpt.list_checkpoints(run_dir)])
    return kept


def test_keep_last_n(tmp_path):
    assert harness.run(2, _keep, str(tmp_path)) == [[[40, 50], [15, 40, 50]]] * 2
    assert sorted(os.listdir(tmp_path)) == ["step-000015", "step-000040", "step-000050"]


def _export(ctx, path: str, dims: dict, dtype) -> list:
    mesh = comm.ParallelDims(**dims).build(ctx)
    model, _ = sharded_model(mesh, seed=1)
    return export_safetensors(model, mesh, path, dtype=dtype)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_export_safetensors_full_tensors(tmp_path, dtype):
    path = str(tmp_path / "model.safetensors")
    assert harness.run(4, _export, path, {"dp": 2, "tp": 2}, dtype)[0] == [path]
    tensors, meta = read_safetensors(path)
    full = dict(Model(1).named_parameters())
    assert sorted(tensors) == sorted(full) and meta["format"] == "pt"  # the package writer reorders
    for name, p in full.items():
        want = p.detach().to(dtype) if dtype is not None else p.detach()
        assert tensors[name].dtype == want.dtype and torch.equal(tensors[name], want), name


def test_export_pipeline_stages_with_index(tmp_path):
    path = str(tmp_path / "model.safetensors")
    files = harness.run(4, _export, path, {"pp": 2, "tp": 2}, None)[0]
    index = json.load(open(files[-1]))
    full = {n: p.detach() for n, p in Model(1).named_parameters()}
    got = {}
    for f in files[:-1]:
        tensors, _ = read_safetensors(f)
        assert all(index["weight_map"][n] == os.path.basename(f) for n in tensors)
        got.update(tensors)
    assert got.keys() == full.keys() and all(torch.equal(got[n], full[n]) for n in full)


def test_safetensors_files_follow_the_format(tmp_path):
    """Written by the `safetensors` package; checked here against the format's definition."""
    tensors = {
        "f32": torch.randn(3, 4),
        "bf16": torch.randn(2, 5).bfloat16(),
        "f16": torch.randn(7).half(),
        "i64": torch.arange(6).reshape(2, 3),
        "u8": torch.arange(5, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
    }
    path = str(tmp_path / "t.safetensors")
    write_safetensors(path, tensors, {"k": "v"})
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    assert (8 + n) % 8 == 0 and header.pop("__metadata__") == {"k": "v"}
    codes = {
        "f32": "F32",
        "bf16": "BF16",
        "f16": "F16",
        "i64": "I64",
        "u8": "U8",
        "bool": "BOOL",
        "scalar": "F32",
        "empty": "F32",
    }
    data = raw[8 + n :]
    for name, t in tensors.items():
        info = header[name]
        assert info["dtype"] == codes[name] and info["shape"] == list(t.shape)
        b, e = info["data_offsets"]
        assert (
            data[b:e] == t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b == e
        )
    assert max(v["data_offsets"][1] for v in header.values()) == len(data)
    back, meta = read_safetensors(path)
    assert meta == {"k": "v"} and sorted(back) == sorted(tensors)  # the package orders by dtype, then name
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape and torch.equal(back[name], t), (
            name
        )


@pytest.fixture(scope="module")
def solo():
    return comm.ParallelDims().build(comm.init())


def test_errors_are_one_line_and_name_the_problem(tmp_path, solo):
    model = Model(1)
    with pytest.raises(ckpt.CheckpointError, match="no complete checkpoint in"):
        ckpt.load_checkpoint(str(tmp_path), model, None, solo)
    with pytest.raises(ckpt.CheckpointError, match="does not exist"):
        ckpt.load_checkpoint(str(tmp_path / "nope"), model, None, solo)
    assert ckpt.latest_checkpoint(str(tmp_path / "nope")) is None
    path = ckpt.save_checkpoint(str(tmp_path), 4, model, None, solo)
    other = Model(1)
    other.odd2 = nn.Parameter(torch.zeros(3, 8))
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.load_checkpoint(path, other, None, solo)
    assert "odd2" in str(e.value) and "[3, 7]" in str(e.value) and "[3, 8]" in str(e.value)
    assert "\n" not in str(e.value)
    with pytest.raises(ckpt.CheckpointError, match="no optimizer state"):
        ckpt.load_checkpoint(path, model, StandInOptimizer(model, solo), solo)
    with pytest.raises(comm.ConfigError, match=r"extra\['fn'\] is a builtin"):
        ckpt.save_checkpoint(str(tmp_path), 5, model, None, solo, extra={"fn": len})
    assert ckpt.latest_checkpoint(str(tmp_path)) == path


def test_single_process_round_trip(tmp_path, solo):
    model, opt = Model(1), None
    opt = StandInOptimizer(model, solo)
    ckpt.save_checkpoint(str(tmp_path), 9, model, opt, solo)
    model2 = Model(2)
    opt2 = StandInOptimizer(model2, solo, fill=False)
    assert ckpt.load_checkpoint(str(tmp_path), model2, opt2, solo)["step"] == 9
    _check_layout(solo, model2, opt2, expect_seed=1)
