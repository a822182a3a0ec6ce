"""A checkpoint never reads a file through a symbolic link leading out of its directory.

`manifest.inside` follows links (realpath) after refusing `..` and absolute names: what it
guards is a name that looks inside the checkpoint but is a link to a file (or through a
directory) elsewhere. tests/checkpoint/test_hostile_files.py checks one such case, DCP's
.metadata pointing tensor data at a link; here the checkpoint's own files are the links, and the
manifest is rewritten to vouch for them (hashes of the outside bytes), so only the link check
can refuse them. Links that stay inside, and a checkpoint reached through a link, still load.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from torch import nn

from meshspeed import comm
from meshspeed.checkpoint import dcp as ckpt
from meshspeed.checkpoint import manifest
from meshspeed.checkpoint.dirs import CheckpointError


@pytest.fixture(scope="module")
def solo():
    return comm.ParallelDims().build(comm.init())


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


def test_inside_follows_links(tmp_path):
    root, out = tmp_path / "ckpt", tmp_path / "elsewhere"
    (root / "sub").mkdir(parents=True)
    out.mkdir()
    (root / "a.pt").write_bytes(b"a")
    (root / "sub" / "b.pt").write_bytes(b"b")
    (out / "c.pt").write_bytes(b"c")
    (tmp_path / "ckpt-sibling").mkdir()  # a prefix of the root's name is not the root
    (tmp_path / "ckpt-sibling" / "d.pt").write_bytes(b"d")
    os.symlink(root / "a.pt", root / "alias.pt")  # stays inside
    os.symlink("sub", root / "inner")  # a directory link that stays inside
    os.symlink(out / "c.pt", root / "file-out.pt")  # a file link leading out
    os.symlink(out, root / "dir-out")  # a directory link leading out
    os.symlink("../ckpt-sibling/d.pt", root / "sibling.pt")  # relative, out to a look-alike
    os.symlink(root, tmp_path / "latest")  # the checkpoint itself reached through a link
    for top in (str(root), str(tmp_path / "latest")):
        for rel in ("a.pt", "sub/b.pt", "alias.pt", "inner/b.pt"):
            assert manifest.inside(top, rel), (top, rel)
        for rel in ("file-out.pt", "dir-out/c.pt", "sibling.pt"):
            assert not manifest.inside(top, rel), (top, rel)


def _link_out(path: str, rel: str, outside: str) -> None:
    """Move the checkpoint's `rel` to `outside` (the same bytes), leave a link to it in its place,
    and rewrite the manifest, which hashes through the link: it vouches for the outside file."""
    shutil.move(os.path.join(path, rel), outside)
    os.symlink(outside, os.path.join(path, rel))
    os.remove(os.path.join(path, manifest.MANIFEST))
    manifest.write_manifest(path, 1)
    with open(os.path.join(path, manifest.MANIFEST)) as f:
        assert f'"{rel}"' in f.read()


@pytest.mark.parametrize("rel", ["state.pt", "__0_0.distcp"])
def test_a_checkpoint_file_linked_out_of_the_directory_is_refused(tmp_path, solo, rel):
    path = ckpt.save_checkpoint(str(tmp_path / "run"), 1, _model(), None, solo)
    ckpt.load_checkpoint(path, _model(), None, solo)  # loads as saved
    _link_out(path, rel, str(tmp_path / "outside.bin"))
    reason = manifest.verify(path)
    assert reason is not None and "outside the checkpoint" in reason and repr(rel) in reason, reason
    for verify in (True, False):  # the loader refuses it whether or not it verifies
        with pytest.raises(CheckpointError) as e:
            ckpt.load_checkpoint(path, _model(), None, solo, verify=verify)
        assert "outside" in str(e.value) and rel in str(e.value), str(e.value)


def test_a_directory_linked_out_of_the_checkpoint_is_refused(tmp_path, solo):
    path = ckpt.save_checkpoint(str(tmp_path / "run"), 1, _model(), None, solo)
    rng = os.path.join(path, "rng")
    assert os.path.isdir(rng), os.listdir(path)
    shutil.move(rng, tmp_path / "rng-outside")
    os.symlink(tmp_path / "rng-outside", rng)
    os.remove(os.path.join(path, manifest.MANIFEST))
    manifest.write_manifest(path, 1)
    reason = manifest.verify(path)
    assert reason is not None and "outside the checkpoint" in reason and "rng/" in reason, reason


def test_links_that_stay_inside_load(tmp_path, solo):
    path = ckpt.save_checkpoint(str(tmp_path / "run"), 1, _model(), None, solo)
    # the shard moved to a folder of the checkpoint, a link left at its name: still inside
    os.mkdir(os.path.join(path, "data"))
    shutil.move(os.path.join(path, "__0_0.distcp"), os.path.join(path, "data", "shard"))
    os.symlink(os.path.join("data", "shard"), os.path.join(path, "__0_0.distcp"))
    os.remove(os.path.join(path, manifest.MANIFEST))
    manifest.write_manifest(path, 1)
    os.symlink(path, tmp_path / "latest")  # and the checkpoint reached through a link
    for where in (path, str(tmp_path / "latest")):
        assert manifest.verify(where) is None, where
        model = _model()
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        ckpt.load_checkpoint(where, model, None, solo)
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), _model().parameters()))
