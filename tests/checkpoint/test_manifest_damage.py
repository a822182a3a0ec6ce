"""Checkpoint verification finds one flipped byte wherever it lies in a multi-MiB file: in its
first 1 MiB block, a middle block and the last (partial) block, and every listed file's
manifest hash is SHA-256 of the whole file, computed here with hashlib in one read (a checksum
of part of a file, or one that stops a block early, fails at once). Under a world of 2, each
rank hashes its share of the files; whichever rank holds the damaged one, both ranks return
the same one line naming it, for every file of the checkpoint."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch
from torch import nn

from meshspeed import comm
from meshspeed.checkpoint import dcp as ckpt
from meshspeed.checkpoint.manifest import MANIFEST, verify
from tests import harness

BLOCK = 1 << 20  # the size manifest hashing reads at a time: damage must be found in any of them


class Big(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(1000, 900))  # 3.6 MB: a shard of 4 blocks, the last partial


def _save(run_dir: str, mesh) -> str:
    return ckpt.save_checkpoint(run_dir, 1, Big(), None, mesh)


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def _listed(root: str) -> dict:
    with open(os.path.join(root, MANIFEST)) as f:
        return json.load(f)["files"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    mesh = comm.ParallelDims().build(comm.init())
    return _save(str(tmp_path_factory.mktemp("ckpt")), mesh), mesh


def test_manifest_hashes_are_the_whole_files(saved):
    root, _ = saved
    for rel, entry in _listed(root).items():
        with open(os.path.join(root, rel), "rb") as f:
            data = f.read()
        assert entry["size"] == len(data) and entry["sha256"] == hashlib.sha256(data).hexdigest(), rel


def _shard(root: str) -> str:
    (rel,) = [r for r in _listed(root) if r.endswith(".distcp")]
    size = os.path.getsize(os.path.join(root, rel))
    assert size > 3 * BLOCK and size % BLOCK, f"{rel}: {size} B, the test wants 3+ blocks and a partial one"
    return rel


@pytest.mark.parametrize("where", ["first block", "middle block", "last block"])
def test_a_flipped_byte_in_any_block_is_found(saved, where):
    root, mesh = saved
    rel = _shard(root)
    size = os.path.getsize(os.path.join(root, rel))
    offset = {"first block": 0, "middle block": (size // BLOCK // 2) * BLOCK + 12345, "last block": size - 1}
    path = os.path.join(root, rel)
    assert verify(root) is None
    _flip(path, offset[where])
    try:
        assert verify(root) == f"{rel} does not match its SHA-256 in the manifest (a damaged or altered file)"
        if where == "middle block":  # and loading refuses it, naming the file
            with pytest.raises(ckpt.CheckpointError, match=rel):
                ckpt.load_checkpoint(root, Big(), None, mesh)
    finally:
        _flip(path, offset[where])  # restored: the next case starts from a good checkpoint
    assert verify(root) is None


def job_verify_each_file(ctx, run_dir: str) -> list:
    mesh = comm.ParallelDims(dp=ctx.world_size).build(ctx)
    root = _save(run_dir, mesh)
    out = []
    for rel in sorted(_listed(root)):
        path = os.path.join(root, rel)
        if not os.path.getsize(path):
            continue  # an empty marker (COMPLETE): nothing to flip, its size is checked
        offset = os.path.getsize(path) // 2
        comm.barrier(mesh["world"])
        if ctx.rank == 0:
            _flip(path, offset)
        comm.barrier(mesh["world"])
        out.append((rel, verify(root, mesh)))
        comm.barrier(mesh["world"])
        if ctx.rank == 0:
            _flip(path, offset)
    comm.barrier(mesh["world"])  # the last file restored before any rank hashes it again
    out.append(("intact", verify(root, mesh)))
    return out


def test_every_file_is_hashed_by_some_rank_and_all_ranks_agree(tmp_path):
    got = harness.run(2, job_verify_each_file, str(tmp_path))
    assert got[0] == got[1]
    *damaged, (_, intact) = got[0]
    assert intact is None and len(damaged) >= 5
    for rel, reason in damaged:
        assert reason is not None and rel in reason and "\n" not in reason, (rel, reason)
