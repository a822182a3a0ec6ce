"""No file is trusted (issue 31, items 4 and 6): crafted and damaged files, each refused in one
line naming the file (and the key and value where there is one), never a traceback, never read
from outside the directory it belongs to. Real files written and altered on disk; the loader
and readers are the ones the commands use, in this process.
"""

from __future__ import annotations

import json
import os
import pickle
import struct

import pytest
import torch
from torch import nn

from meshspeed import comm
from meshspeed.checkpoint import dcp as ckpt
from meshspeed.checkpoint import manifest
from meshspeed.checkpoint.dirs import CheckpointError, fsync_write, torch_save
from meshspeed.checkpoint.safetensors_io import SafetensorsError, read_safetensors, read_safetensors_header
from meshspeed.comm import checkpoint_io
from meshspeed.comm.outputs import OutputError
from meshspeed.interop.hf_config import HFConfigError, read_config_json, read_index


@pytest.fixture(scope="module")
def solo():
    return comm.ParallelDims().build(comm.init())


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


def _one_line(err) -> str:
    msg = str(err.value)
    assert "\n" not in msg and "Traceback" not in msg, msg
    return msg


# -- manifests and DCP metadata -------------------------------------------------------------
def _write_manifest(path, files: dict) -> None:
    with open(os.path.join(path, manifest.MANIFEST), "w") as f:
        json.dump({"format": manifest.FORMAT, "step": 1, "files": files}, f)


def test_an_empty_manifest_does_not_vouch_for_a_damaged_shard(tmp_path, solo):
    path = ckpt.save_checkpoint(str(tmp_path), 1, _model(), None, solo)
    shard = os.path.join(path, "__0_0.distcp")
    data = bytearray(open(shard, "rb").read())
    data[len(data) // 2] ^= 1
    open(shard, "wb").write(bytes(data))
    _write_manifest(path, {})
    assert "lists no files" in manifest.verify(path)
    with pytest.raises(CheckpointError) as e:
        ckpt.load_checkpoint(path, _model(), None, solo)
    assert "lists no files" in _one_line(e)


def test_a_manifest_missing_a_file_loading_reads_does_not_verify(tmp_path, solo):
    path = ckpt.save_checkpoint(str(tmp_path), 1, _model(), None, solo)
    files = manifest.read_manifest(path)
    del files["__0_0.distcp"]  # then damage the shard it no longer lists
    _write_manifest(path, files)
    with open(os.path.join(path, "__0_0.distcp"), "r+b") as f:
        f.write(b"\0" * 16)
    assert "does not list __0_0.distcp, which loading reads" in manifest.verify(path)


def _repoint(path, target: str) -> None:
    """Point every tensor's data in `.metadata` at `target` and re-list the manifest."""
    md = checkpoint_io.read_metadata(path)
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    md.storage_data = {k: _StorageInfo(target, v.offset, v.length) for k, v in md.storage_data.items()}
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    os.remove(os.path.join(path, manifest.MANIFEST))
    manifest.write_manifest(path, 1)


@pytest.mark.parametrize("where", ["../outside.distcp", "ABSOLUTE", "link.distcp"])
def test_dcp_metadata_pointing_outside_the_checkpoint_is_refused_verified_or_not(tmp_path, solo, where):
    path = ckpt.save_checkpoint(str(tmp_path / "run"), 1, _model(), None, solo)
    outside = tmp_path / "outside.distcp"
    outside.write_bytes(open(os.path.join(path, "__0_0.distcp"), "rb").read())  # readable, unverified
    if where == "ABSOLUTE":
        where = str(outside)
    elif where == "link.distcp":
        os.symlink(outside, os.path.join(path, where))
    _repoint(path, where)
    assert "outside the checkpoint" in manifest.verify(path)
    for verify in (True, False):
        with pytest.raises(CheckpointError) as e:
            ckpt.load_checkpoint(path, _model(), None, solo, verify=verify)
        assert "outside" in _one_line(e)


def _manifest(files: dict) -> str:
    return json.dumps({"format": "meshspeed-manifest/1", "files": files})


@pytest.mark.parametrize(
    "body, needle",
    [
        ("[1, 2]", "holds a JSON list"),
        ('"text"', "holds a JSON str"),
        (_manifest({"a": {"size": "12", "sha256": "x"}}), "expected"),
        (_manifest({"a": {"size": -1, "sha256": "0" * 64}}), "size"),
        ("[" * 100_000, "unreadable"),
    ],
)
def test_a_manifest_of_the_wrong_shape_is_one_line(tmp_path, solo, body, needle):
    path = ckpt.save_checkpoint(str(tmp_path), 1, _model(), None, solo)
    open(os.path.join(path, manifest.MANIFEST), "w").write(body)
    with pytest.raises(CheckpointError) as e:
        ckpt.load_checkpoint(path, _model(), None, solo)
    assert needle in _one_line(e) and "MANIFEST.json" in str(e.value)


@pytest.mark.parametrize(
    "meta, needle",
    [([1, 2], "holds a JSON list"), ({"step": "1", "world_size": 1, "optimizer": False}, "key 'step' is '1'"),
     ({"step": 1, "world_size": 0, "optimizer": False}, "key 'world_size' is 0")],
)  # fmt: skip
def test_meta_json_of_the_wrong_type_is_one_line_naming_the_key(tmp_path, solo, meta, needle):
    path = ckpt.save_checkpoint(str(tmp_path), 1, _model(), None, solo)
    open(os.path.join(path, "meta.json"), "w").write(json.dumps(meta))
    with pytest.raises(CheckpointError) as e:
        ckpt.load_checkpoint(path, _model(), None, solo, verify=False)
    assert needle in _one_line(e) and "meta.json" in str(e.value)


def test_a_truncated_state_pt_is_one_line_naming_it(tmp_path, solo):
    path = ckpt.save_checkpoint(str(tmp_path), 1, _model(), None, solo)
    state = os.path.join(path, "state.pt")
    open(state, "r+b").truncate(os.path.getsize(state) // 2)
    with pytest.raises(CheckpointError) as e:
        ckpt.load_checkpoint(path, _model(), None, solo, verify=False)
    assert "state.pt is damaged or truncated" in _one_line(e)


# -- full disks -----------------------------------------------------------------------------
@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux): an always-full device")
def test_a_full_disk_is_reported_as_such():
    full = "/dev/full"
    for write in (lambda: torch_save({"x": torch.ones(999)}, full), lambda: fsync_write(full, b"x")):
        with pytest.raises(CheckpointError) as e:
            write()
        msg = _one_line(e)
        assert "no space left on the device writing /dev/full" in msg and "unexpected pos" not in msg


# -- safetensors ----------------------------------------------------------------------------
def _safetensors(path, header: dict, data: bytes = b"", n: int | None = None) -> str:
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw) if n is None else n) + raw + data)
    return str(path)


@pytest.mark.parametrize(
    "header, data, n, needle",
    [
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, None, "offsets [0, 8]"),
        ({"w": {"dtype": "F99", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, None, "dtype 'F99'"),
        ({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8, None, "shape [-2]"),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}, "v": {"dtype": "F32", "shape": [2],
          "data_offsets": [0, 8]}}, b"\0" * 12, None, "overlap"),
        ({"w": 1}, b"", None, "dtype 1"),
        ({}, b"", 1 << 62, "header declared"),
        ([1, 2], b"", None, "JSON list"),
    ],
)  # fmt: skip
def test_damaged_safetensors_are_one_line_naming_the_file(tmp_path, header, data, n, needle):
    path = _safetensors(tmp_path / "m.safetensors", header, data, n)
    with pytest.raises(SafetensorsError) as e:
        read_safetensors(path)
    assert needle in _one_line(e) and "m.safetensors" in str(e.value)


def test_a_header_that_is_not_json_is_one_line(tmp_path):
    path = tmp_path / "m.safetensors"
    path.write_bytes(struct.pack("<Q", 6) + b"\xff\xfe{{{{")
    with pytest.raises(SafetensorsError, match="header is not JSON"):
        read_safetensors_header(str(path))


# -- Hugging Face config.json and index -----------------------------------------------------
BASE = {"model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 80,
        "num_hidden_layers": 2, "num_attention_heads": 4}  # fmt: skip


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings='false' is not valid; expected true or"),
        ({"num_attention_heads": 0}, "num_attention_heads=0"),
        ({"hidden_size": 64.0}, "hidden_size=64.0"),
        ({"vocab_size": "96"}, "vocab_size='96'"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps=nan"),
        ({"rope_theta": -1}, "rope_theta=-1"),
        ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads=3"),
        ({"hidden_size": 100_000, "intermediate_size": 1_000_000, "num_hidden_layers": 4000}, "parameters"),
        ({"rope_scaling": "linear"}, "rope_scaling='linear'"),
    ],
)
def test_config_json_values_are_typed_and_plausible(tmp_path, change, needle):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **change}))
    with pytest.raises(HFConfigError) as e:
        read_config_json(str(tmp_path / "config.json"))
    assert needle in _one_line(e) and "config.json" in str(e.value)


def test_index_weight_map_stays_inside_the_model_directory(tmp_path):
    (tmp_path / "m").mkdir()
    os.symlink("/etc", tmp_path / "m" / "etc")
    (tmp_path / "outside.safetensors").write_bytes(b"")
    # a plain name in the directory that is a link to a file outside it
    os.symlink(tmp_path / "outside.safetensors", tmp_path / "m" / "linked.safetensors")
    for target in ("../outside.safetensors", "/etc/passwd", "etc/passwd", "..", 7, "linked.safetensors"):
        (tmp_path / "m" / "index.json").write_text(json.dumps({"weight_map": {"w": target}}))
        with pytest.raises(HFConfigError) as e:
            read_index(str(tmp_path / "m" / "index.json"), str(tmp_path / "m"))
        assert "weight_map['w']" in _one_line(e)
    (tmp_path / "m" / "index.json").write_text(json.dumps({"weight_map": ["w"]}))
    with pytest.raises(HFConfigError, match="weight_map"):
        read_index(str(tmp_path / "m" / "index.json"), str(tmp_path / "m"))


def test_output_manifest_is_read_strictly(tmp_path):
    from meshspeed.comm.outputs import read_output_manifest

    body = {"format": "meshspeed-output/1", "files": {"../x": {}}}
    (tmp_path / ".meshspeed-output.json").write_text(json.dumps(body))
    with pytest.raises(OutputError, match="not a file of that directory"):
        read_output_manifest(str(tmp_path))


def test_a_checkpoint_caught_between_two_renames_is_put_back(tmp_path, solo, capsys):
    """publish() moves step-N aside, then renames the new save in; a crash between the two left
    only `step-N.old-*`, which the next save used to delete: the checkpoint was lost."""
    from meshspeed.checkpoint.dirs import clean_stale

    path = ckpt.save_checkpoint(str(tmp_path), 1, _model(), None, solo)
    aside = f"{path}.old-0123456789ab"
    os.rename(path, aside)
    os.makedirs(f"{path}.tmp-0123456789ab")  # the half-written save beside it
    clean_stale(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["step-000001"]
    assert manifest.verify(path) is None
    assert "put back checkpoint" in capsys.readouterr().err


def test_absurd_model_sizes_are_refused_before_anything_is_planned():
    """`meshspeed train --dry-run --model.dim 1000000000` printed a plan for 3e18 parameters per
    rank and exited 0; the sizes are now refused where the model config is made."""
    from meshspeed.interop.model_source import preset_config

    with pytest.raises(comm.ConfigError) as e:
        preset_config("tiny", {"dim": 1_000_000_000}, 32)
    assert "past the 1e+13" in _one_line(e) and "model.dim=1000000000" in str(e.value)
