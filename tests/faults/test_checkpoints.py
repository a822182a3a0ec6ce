"""Checkpoint faults: damaged files, planted pickle payloads, non-finite training, occupied run dirs.

The CLI cases run real `meshspeed train` jobs on a copy of one earlier run's directory; the
planted payloads go through the library in this process (the loader is the same code, and a
payload that ran would create its marker file here, where the test looks).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from meshspeed import comm
from meshspeed.checkpoint import dcp as ckpt
from meshspeed.checkpoint import manifest
from meshspeed.checkpoint.dirs import prune
from meshspeed.comm import checkpoint_io
from meshspeed.plan import config
from meshspeed.train.job import prepare_run_dir
from tests import warm
from tests.faults.procs import FAST, env, metrics

RUN2 = FAST + ["--nproc", "2", "--parallel.tp", "2", "--checkpoint.interval", "2"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished 4-step run (tp 2) with checkpoints at steps 2 and 4."""
    run = tmp_path_factory.mktemp("trained") / "run"
    out = warm.run(
        [sys.executable, "-m", "meshspeed", "train", *RUN2, "--train.steps", "4", "--run.dir", str(run)],
        env=env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return run


def _copy(trained, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    return run


def _flip(path, offset=None) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if offset is None else offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_flipped_byte_in_newest_checkpoint_falls_back_to_previous(start, trained, tmp_path):
    run = _copy(trained, tmp_path)
    _flip(run / "step-000004" / "__1_0.distcp")
    job = start(RUN2 + ["--train.steps", "6", "--run.dir", str(run), "--checkpoint.resume", "latest"])
    assert job.finish(120) == 0, job.stderr[-3000:]
    err = job.stderr
    assert (
        f"checkpoint {run}/step-000004 does not verify (__1_0.distcp does not match its SHA-256 in "
        f"the manifest (a damaged or altered file)); resuming from {run}/step-000002 instead"
    ) in err, err[-2000:]
    assert f"resumed from step 2 ({run}/step-000002)" in job.stdout
    assert [r["step"] for r in metrics(run)] == list(range(6))


def test_truncated_shard_in_named_checkpoint_is_an_error_naming_the_file(start, trained, tmp_path):
    run = _copy(trained, tmp_path)
    shard = run / "step-000004" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    job = start(
        RUN2 + ["--train.steps", "6", "--run.dir", str(run), "--checkpoint.resume", str(run / "step-000004")]
    )
    assert job.finish(60) == 1
    line = job.last_line()
    want = f"rank 0 failed: checkpoint {run}/step-000004 does not verify: __0_0.distcp has 1000 bytes"
    assert want in line, line
    assert "Traceback" not in job.stderr


def test_resume_on_other_data_is_refused_in_one_line(start, trained, tmp_path):
    run = _copy(trained, tmp_path)
    resume = ["--checkpoint.resume", "latest", "--data.max_mb", "2"]
    job = start(RUN2 + ["--train.steps", "6", "--run.dir", str(run)] + resume)
    assert job.finish(600) == 1
    line = job.last_line()
    assert "was trained with data.max_mb=1.0 but this run has data.max_mb=2.0" in line, line
    assert "--checkpoint.allow_data_change true" in line and "Traceback" not in job.stderr
    assert [r["step"] for r in metrics(run)] == list(range(4))  # nothing trained on the other data


def test_new_run_in_used_run_dir_is_refused_with_one_line(trained, tmp_path):
    run = _copy(trained, tmp_path)
    out = warm.run(
        [sys.executable, "-m", "meshspeed", "train", *RUN2, "--run.dir", str(run)],
        env=env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "already holds metrics.jsonl, step-000002, step-000004" in lines[0], out.stderr
    assert "--checkpoint.resume latest" in lines[0] and "--run.overwrite true" in lines[0]


def test_overwrite_deletes_only_run_outputs(trained, tmp_path):
    run = _copy(trained, tmp_path)
    (run / "notes.txt").write_text("mine")
    cfg = config.load(None, [("run.dir", str(run)), ("run.overwrite", "true")])
    prepare_run_dir(cfg, lead=True)
    assert sorted(n for n in os.listdir(run) if not n.startswith(".meshspeed")) == ["notes.txt"]
    prepare_run_dir(config.load(None, [("run.dir", str(run))]), lead=True)  # now fresh: accepted


def test_restart_never_overwrites(trained, tmp_path, monkeypatch):
    run = _copy(trained, tmp_path)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    cfg = config.load(None, [("run.dir", str(run)), ("run.overwrite", "true")])
    prepare_run_dir(cfg, lead=True)
    assert cfg.checkpoint.resume == "auto" and (run / "step-000004").is_dir()


def _dcp_tensors(path) -> dict[str, torch.Tensor]:
    md = checkpoint_io.read_metadata(str(path))
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()}
    dcp.load(state, storage_reader=checkpoint_io.SafeReader(str(path)), no_dist=True)
    return state


def test_huge_learning_rate_stops_with_one_line_and_only_finite_checkpoints(start, tmp_path):
    run = tmp_path / "run"
    job = start(
        FAST
        + [
            "--nproc",
            "2",
            "--parallel.tp",
            "2",
            "--train.steps",
            "40",
            "--train.lr",
            "1e6",
            "--checkpoint.interval",
            "1",
            "--run.dir",
            str(run),
        ]
    )
    assert job.finish(120) == 1
    line = job.last_line()
    assert "not finite for 5 steps in a row (train.max_bad_steps=5), run stopped without saving" in line, line
    rows = metrics(run)
    bad = [r for r in rows if r.get("skipped")]
    assert len(bad) == 5 and line.startswith(f"meshspeed: rank 0 failed: step {bad[-1]['step']}:")
    assert all(r["grad_norm"] is None or r["loss"] is None for r in bad) and bad[-1]["skipped_steps"] == 5
    saved = ckpt.list_checkpoints(str(run))
    assert saved, "the run saved nothing before it went bad"
    for _, path in saved:
        assert manifest.verify(path) is None
        for name, t in _dcp_tensors(path).items():
            assert torch.isfinite(t).all(), f"{path}: {name} is not finite"


# -- library level: same loader, in this process -------------------------------------------
@pytest.fixture(scope="module")
def solo():
    return comm.ParallelDims().build(comm.init())


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))


def _rehash(path) -> None:
    """Rewrite the manifest so the planted file verifies: what is then tested is the loader."""
    os.remove(os.path.join(path, manifest.MANIFEST))
    manifest.write_manifest(path, 1)


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _bytes_entry_metadata(path, marker) -> None:
    """A `.metadata` that calls a real weight a bytes item stored in a planted file: DCP would
    torch.load those bytes with weights_only=False."""
    md = checkpoint_io.read_metadata(path)
    key = next(iter(md.state_dict_metadata))
    payload = pickle.dumps(_Payload(marker))
    with open(os.path.join(path, "__9_0.distcp"), "wb") as f:
        f.write(payload)
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    md.state_dict_metadata[key] = BytesStorageMetadata()
    md.storage_data = {k: v for k, v in md.storage_data.items() if k.fqn != key}
    md.storage_data[MetadataIndex(key)] = _StorageInfo("__9_0.distcp", 0, len(payload))
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)


def _tensor_item_payload(path, marker) -> None:
    """A tensor item of the shard repointed at a planted torch.save archive of a payload (DCP
    reads tensor items with torch.load(weights_only=True))."""
    md = checkpoint_io.read_metadata(path)
    shard = os.path.join(path, "__0_0.distcp")
    offset = os.path.getsize(shard)
    with open(shard, "ab") as f:
        torch.save(_Payload(marker), f)
    index = next(iter(md.storage_data))
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    md.storage_data[index] = _StorageInfo("__0_0.distcp", offset, os.path.getsize(shard) - offset)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)


@pytest.mark.parametrize(
    "where", [".metadata", "state.pt", "rng/rank-00000.pt", "__0_0.distcp", "bytes-entry", "tensor-item"]
)
@pytest.mark.parametrize("manifest_updated", [True, False])
def test_planted_pickle_payload_never_runs(tmp_path, solo, where, manifest_updated):
    marker = tmp_path / "payload-ran"
    path = ckpt.save_checkpoint(str(tmp_path / "run"), 1, _model(), None, solo)
    if where == "bytes-entry":
        _bytes_entry_metadata(path, marker)
    elif where == "tensor-item":
        _tensor_item_payload(path, marker)
    else:
        with open(os.path.join(path, where), "wb") as f:
            pickle.dump(_Payload(marker), f)
    if manifest_updated:
        _rehash(path)
    with pytest.raises((ckpt.CheckpointError, comm.CommError)) as e:
        ckpt.load_checkpoint(path, _model(), None, solo)
    assert not marker.exists(), f"the payload in {where} ran"
    msg = str(e.value)
    assert "\n" not in msg
    if manifest_updated and where == "__0_0.distcp":  # not even a readable shard: DCP says so
        assert "loading checkpoint" in msg and "failed" in msg, msg
    elif manifest_updated:  # the loader refused it, in a message naming the file or the item
        named = {"bytes-entry": ".metadata", "tensor-item": "tensor file"}.get(where, os.path.basename(where))
        assert "refused" in msg and named in msg, msg
    else:
        assert "does not verify" in msg and "SHA-256" in msg or "bytes where the manifest" in msg, msg


def test_control_the_stock_dcp_reader_would_run_the_payload(tmp_path, solo):
    """The planted `.metadata` is live: torch's own FileSystemReader runs it (in a child process
    here). What keeps meshspeed safe is its loader, not a harmless payload."""
    marker = tmp_path / "payload-ran"
    path = ckpt.save_checkpoint(str(tmp_path / "run"), 1, _model(), None, solo)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(_Payload(marker), f)
    code = (
        "from torch.distributed.checkpoint import FileSystemReader\n"
        f"FileSystemReader({path!r}).read_metadata()"
    )
    warm.run([sys.executable, "-c", code], env=env(), capture_output=True, timeout=60)
    assert marker.exists()


def test_missing_file_is_named(tmp_path, solo):
    path = ckpt.save_checkpoint(str(tmp_path / "run"), 1, _model(), None, solo)
    os.remove(os.path.join(path, "rng", "rank-00000.pt"))
    with pytest.raises(ckpt.CheckpointError, match=r"does not verify: rng/rank-00000.pt is missing"):
        ckpt.load_checkpoint(path, _model(), None, solo)


def test_manifest_lists_every_file_and_is_written_last(tmp_path, solo):
    path = ckpt.save_checkpoint(str(tmp_path / "run"), 3, _model(), None, solo)
    files = manifest.read_manifest(path)
    on_disk = {os.path.relpath(os.path.join(d, n), path) for d, _, ns in os.walk(path) for n in ns}
    assert set(files) == on_disk - {manifest.MANIFEST}
    newest = max(on_disk, key=lambda rel: os.stat(os.path.join(path, rel)).st_mtime_ns)
    assert newest == manifest.MANIFEST
    for rel, entry in files.items():
        assert entry["size"] == os.path.getsize(os.path.join(path, rel))
        assert entry["sha256"] == manifest.sha256_file(os.path.join(path, rel))


def test_nonfinite_state_is_never_saved(tmp_path, solo):
    model = _model()
    good = ckpt.save_checkpoint(str(tmp_path / "run"), 1, model, None, solo)
    with torch.no_grad():
        model[1].weight[0, 0] = float("nan")
    refused = r"refusing to save checkpoint step 2: model.1.weight holds non-finite"
    with pytest.raises(ckpt.CheckpointError, match=refused):
        ckpt.save_checkpoint(str(tmp_path / "run"), 2, model, None, solo)
    assert ckpt.latest_checkpoint(str(tmp_path / "run")) == good
    assert sorted(os.listdir(tmp_path / "run")) == ["step-000001"]


def test_pruning_keeps_the_newest_good_checkpoint(tmp_path, solo):
    run = str(tmp_path / "run")
    paths = [ckpt.save_checkpoint(run, s, _model(), None, solo, keep=None) for s in (1, 2, 3)]
    for p in paths[1:]:  # the two newest lose a shard: only step 1 still checks out
        os.remove(os.path.join(p, "__0_0.distcp"))
    prune(run, 1, paths[2])
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [1, 3]  # keep=1 would have deleted step 1


def test_latest_with_nothing_verifying_says_so(tmp_path, solo):
    run = str(tmp_path / "run")
    path = ckpt.save_checkpoint(run, 1, _model(), None, solo)
    _flip(__import__("pathlib").Path(path) / "state.pt", 0)
    from meshspeed.checkpoint.dirs import newest_verified

    found, skipped = newest_verified(run, solo)
    assert found is None and skipped[0][0] == path and "state.pt does not match its SHA-256" in skipped[0][1]
    json.loads(open(os.path.join(path, manifest.MANIFEST)).read())  # the manifest itself is intact
