"""Checkpoint directories: naming, atomic publish, pruning, and cross-rank agreement.

The file-system half of meshspeed.train.checkpoint (which decides what goes in): a checkpoint
is `run_dir/step-NNNNNN/`, complete only once it holds COMPLETE; saves go to `.tmp-<nonce>`
and are renamed into place, so a crash never leaves a half-written "latest".
"""

from __future__ import annotations

import os
import re
import secrets
import shutil

import torch

from meshspeed import comm
from meshspeed.comm import ConfigError

COMPLETE = "COMPLETE"  # written last: a step-N directory without it is not a checkpoint
_STEP_RE = re.compile(r"^step-(\d+)$")
_STALE_RE = re.compile(r"^step-\d+\.(tmp|old)-[0-9a-f]+$")

class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message says which and why."""


# -- directories ----------------------------------------------------------------------------
def list_checkpoints(run_dir: str) -> list[tuple[int, str]]:
    """Complete checkpoints in `run_dir` as (step, path), oldest first."""
    if not os.path.isdir(run_dir):
        return []
    out = []
    for name in os.listdir(run_dir):
        m = _STEP_RE.match(name)
        if m and os.path.isfile(os.path.join(run_dir, name, COMPLETE)):
            out.append((int(m.group(1)), os.path.join(run_dir, name)))
    return sorted(out)


def latest_checkpoint(run_dir: str) -> str | None:
    """The complete checkpoint with the highest step in `run_dir`, or None."""
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def _resolve(path: str) -> str:
    """A checkpoint directory, or a run directory meaning its latest checkpoint."""
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint path {path} does not exist")
    if os.path.isfile(os.path.join(path, COMPLETE)):
        return path
    if _STEP_RE.match(os.path.basename(os.path.normpath(path))) or os.path.isfile(os.path.join(path, ".metadata")):
        raise CheckpointError(f"{path} is not a complete checkpoint (no {COMPLETE} marker: its save did not "
                              f"finish); load an earlier step or the run directory for the latest complete one")
    latest = latest_checkpoint(path)
    if latest is None:
        raise CheckpointError(f"no complete checkpoint in {path} to resume from (looked for step-NNNNNN/{COMPLETE}); "
                              f"start without resuming or pass a checkpoint directory")
    return latest


def _fsync_write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some platforms cannot open directories; the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _torch_save(obj, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _clean_stale(run_dir: str) -> None:
    for name in os.listdir(run_dir):
        if _STALE_RE.match(name):
            shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)


def _publish(tmp: str, final: str, nonce: str) -> None:
    """Rename `tmp` to `final`; an existing `final` (the same step saved again) is moved aside first."""
    old = None
    if os.path.exists(final):
        old = f"{final}.old-{nonce}"
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(os.path.dirname(final) or ".")
    if old:
        shutil.rmtree(old, ignore_errors=True)


def _prune(run_dir: str, keep: int, just_saved: str) -> None:
    """Delete all but the `keep` highest steps, never the one just saved (a run resumed from an
    earlier step may save below checkpoints of the run it branched from)."""
    for _, path in list_checkpoints(run_dir)[:-keep]:
        if path == just_saved:
            continue
        # Unmark first: a crash mid-delete must not leave a half-deleted "complete" checkpoint.
        os.remove(os.path.join(path, COMPLETE))
        shutil.rmtree(path, ignore_errors=True)


# -- agreement across ranks -----------------------------------------------------------------
def _agree(mesh, err: BaseException | None, what: str) -> None:
    """Collective over the world: raise on every rank if `err` is set on any of them."""
    ctx = mesh.ctx
    flag = torch.tensor([0 if err is None else 1], dtype=torch.int32, device=ctx.device)
    flags = comm.all_gather(flag, mesh["world"]).tolist()
    failed = [r for r, f in enumerate(flags) if f]
    if isinstance(err, (CheckpointError, ConfigError)):
        raise err  # already a one-line diagnosis
    if failed:
        why = f": {type(err).__name__}: {err}" if err is not None else f"; see rank {failed[0]}'s error"
        raise CheckpointError(f"{what} failed on rank{'s' if len(failed) > 1 else ''} "
                              f"{', '.join(map(str, failed))}{why}") from err


def _shared_nonce(mesh) -> str:
    t = torch.tensor([secrets.randbits(48) if mesh.ctx.rank == 0 else 0], dtype=torch.int64, device=mesh.ctx.device)
    comm.broadcast(t, mesh["world"], src=0)
    return f"{int(t.item()):012x}"
