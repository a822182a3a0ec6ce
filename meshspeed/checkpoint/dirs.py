"""Checkpoint directories: naming, atomic publish, removal, pruning, cross-rank agreement.

The file-system half of meshspeed.checkpoint.dcp (which decides what goes in): a checkpoint
is `run_dir/step-NNNNNN/`, complete only once it holds COMPLETE (and MANIFEST.json, see
manifest.py); saves go to `.tmp-<nonce>` and are renamed into place, so a crash never leaves a
half-written "latest". A checkpoint is removed (pruning, a replaced step, run.overwrite) by the
files its manifest lists, never by deleting the directory whole. The run directory around the
checkpoints is run_dir.py's.
"""

from __future__ import annotations

import os
import re
import secrets
import sys

import torch

from meshspeed import comm
from meshspeed.checkpoint.manifest import listed_files, quick_check, verify
from meshspeed.comm import ConfigError
from meshspeed.comm.errors import echo
from meshspeed.comm.outputs import disk_error, fsync_dir, say

COMPLETE = "COMPLETE"  # a step-N directory without it is not a checkpoint
STEP_RE = re.compile(r"^step-(\d+)$")
STALE_RE = re.compile(r"^step-\d+\.(tmp|old)-[0-9a-f]+$")
# What a save writes besides the files its manifest lists (written before or after it).
_OWN = (COMPLETE, "MANIFEST.json", "manifest-parts")
# A checkpoint's files by name, for one saved before manifests existed (nothing else is removed).
_LEGACY_RE = re.compile(r"^(\.metadata|__\d+_\d+\.distcp|state\.pt|meta\.json|rng/rank-\d{5}\.pt)$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message says which and why."""

    one_line = True  # a diagnosis for the launcher to print, not a bug's traceback


# -- directories ----------------------------------------------------------------------------
def list_checkpoints(run_dir: str) -> list[tuple[int, str]]:
    """Complete checkpoints in `run_dir` as (step, path), oldest first."""
    if not os.path.isdir(run_dir):
        return []
    out = []
    for name in os.listdir(run_dir):
        m = STEP_RE.match(name)
        if m and os.path.isfile(os.path.join(run_dir, name, COMPLETE)):
            out.append((int(m.group(1)), os.path.join(run_dir, name)))
    return sorted(out)


def latest_checkpoint(run_dir: str) -> str | None:
    """The complete checkpoint with the highest step in `run_dir`, or None."""
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def resolve(path: str) -> str:
    """A checkpoint directory, or a run directory meaning its latest checkpoint."""
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint path {path} does not exist")
    if os.path.isfile(os.path.join(path, COMPLETE)):
        return path
    if STEP_RE.match(os.path.basename(os.path.normpath(path))) or os.path.isfile(
        os.path.join(path, ".metadata")
    ):
        raise CheckpointError(
            f"{path} is not a complete checkpoint (no {COMPLETE} marker: its save did not "
            f"finish); load an earlier step or the run directory for the latest complete one"
        )
    latest = latest_checkpoint(path)
    if latest is None:
        raise CheckpointError(
            f"no complete checkpoint in {path} to resume from (looked for step-NNNNNN/{COMPLETE}); "
            f"start without resuming or pass a checkpoint directory"
        )
    return latest


def fsync_write(path: str, data: bytes) -> None:
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        full = disk_error(e, path)
        if full is None:
            raise
        raise CheckpointError(str(full)) from None


def torch_save(obj, path: str) -> None:
    try:
        with open(path, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    except (OSError, RuntimeError) as e:  # torch says "unexpected pos 704 vs 598" for a full disk
        full = disk_error(e, path)
        if full is None:
            raise
        raise CheckpointError(str(full)) from None


def step_dirs(run_dir: str) -> list[str]:
    """Names of the step-N directories in `run_dir` (complete or not), sorted."""
    if not os.path.isdir(run_dir):
        return []
    return sorted(n for n in os.listdir(run_dir) if STEP_RE.match(n))


def remove_checkpoint(path: str) -> list[str]:
    """Delete a checkpoint directory meshspeed wrote: unmarked first (a crash mid-delete must not
    leave a half-deleted "complete" checkpoint), then the files its manifest lists (by name, for
    one older than manifests), then the directory if nothing is left. Returns what stayed:
    files meshspeed did not write are never removed."""
    if not os.path.isdir(path) or os.path.islink(path):
        return [os.path.basename(path)]
    try:
        os.remove(os.path.join(path, COMPLETE))
    except FileNotFoundError:
        pass
    names = listed_files(path)
    for d, _, files in os.walk(path):
        for n in files:
            rel = os.path.relpath(os.path.join(d, n), path).replace(os.sep, "/")
            ours = rel in names if names is not None else bool(_LEGACY_RE.match(rel))
            if ours or rel in _OWN or rel.startswith("manifest-parts/"):
                os.remove(os.path.join(d, n))
    left = []
    for d, dirs, files in os.walk(path, topdown=False):
        left += [os.path.relpath(os.path.join(d, n), path) for n in files]
        if not os.listdir(d):
            os.rmdir(d)
    return sorted(left)


def clean_stale(run_dir: str) -> None:
    """Remove the partial saves a crash left (`step-N.tmp-*`), or put back a checkpoint a crash
    caught between publish's two renames (`step-N.old-*` with no `step-N`), saying so."""
    for name in sorted(os.listdir(run_dir)):
        if not STALE_RE.match(name):
            continue
        path, final = os.path.join(run_dir, name), os.path.join(run_dir, name.split(".")[0])
        if ".old-" in name and not os.path.exists(final):
            os.rename(path, final)
            say(f"put back checkpoint {final}, which an interrupted save had moved aside")
            continue
        left = remove_checkpoint(path)
        kept = f" (kept {left[0]}: not a checkpoint file)" if left else ""
        say(f"removed {path}, left by an interrupted save{kept}")


def publish(tmp: str, final: str, nonce: str) -> None:
    """Rename `tmp` to `final`; an existing `final` (the same step saved again) is moved aside first."""
    old = None
    if os.path.exists(final):
        old = f"{final}.old-{nonce}"
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(os.path.dirname(final) or ".")
    if old:
        remove_checkpoint(old)


def prune(run_dir: str, keep: int, just_saved: str) -> None:
    """Delete all but the `keep` highest steps, never the one just saved (a run resumed from an
    earlier step may save below checkpoints of the run it branched from), and never the newest
    checkpoint whose manifest and file sizes check out: whatever happened to the others, a good
    one survives."""
    found = list_checkpoints(run_dir)
    good = next((path for _, path in reversed(found) if quick_check(path) is None), None)
    for _, path in found[:-keep]:
        if path in (just_saved, good):
            continue
        remove_checkpoint(path)


# -- agreement across ranks -----------------------------------------------------------------
def agree(mesh, err: BaseException | None, what: str) -> None:
    """Collective over the world: raise on every rank if `err` is set on any of them.

    A rank that had the error raises it (or a CheckpointError naming it); the others raise a
    CheckpointError pointing at that rank, marked as an echo so that only the rank that knows
    the cause reports it."""
    ctx = mesh.ctx
    flag = torch.tensor([0 if err is None else 1], dtype=torch.int32, device=ctx.device)
    flags = comm.all_gather(flag, mesh["world"]).tolist()
    failed = [r for r, f in enumerate(flags) if f]
    if isinstance(err, (CheckpointError, ConfigError)):
        raise err  # already a one-line diagnosis
    if failed:
        why = f": {type(err).__name__}: {err}" if err is not None else f"; see rank {failed[0]}'s error"
        raise echo(
            CheckpointError(
                f"{what} failed on rank{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))}{why}"
            ),
            err is None,
        ) from err


def shared_nonce(mesh) -> str:
    t = torch.tensor(
        [secrets.randbits(48) if mesh.ctx.rank == 0 else 0], dtype=torch.int64, device=mesh.ctx.device
    )
    comm.broadcast(t, mesh["world"], src=0)
    return f"{int(t.item()):012x}"


def newest_verified(run_dir: str, mesh) -> tuple[str | None, list[tuple[str, str]]]:
    """Collective over the world: the newest complete checkpoint in `run_dir` that verifies
    against its manifest (or None), and (path, reason) for each newer one that did not."""
    skipped = []
    for _, path in reversed(list_checkpoints(run_dir)):
        reason = verify(path, mesh)
        if reason is None:
            return path, skipped
        skipped.append((path, reason))
    return None, skipped


def resume_path(which: str, run_dir: str, mesh, lead: bool) -> tuple[str | None, bool]:
    """(checkpoint to load, whether it was verified already) for `checkpoint.resume=which`:
    'latest' and 'auto' take the newest checkpoint that verifies against its manifest, saying
    in one line (on the lead rank) each one they skip; 'auto' with none yields (None, False),
    start at step 0. A path is returned as given (the load verifies it)."""
    if which not in ("latest", "auto"):
        return which, False
    quiet = not lead
    path, skipped = newest_verified(run_dir, mesh)
    if lead:
        for bad, why in skipped:
            instead = f"resuming from {path} instead" if path else "no earlier checkpoint verifies"
            print(
                f"meshspeed: checkpoint {bad} does not verify ({why}); {instead}", file=sys.stderr, flush=True
            )
    if path is None and skipped:
        raise echo(
            CheckpointError(
                f"checkpoint.resume={which}: none of the {len(skipped)} checkpoints in {run_dir} verifies "
                f"(newest: {skipped[0][0]}: {skipped[0][1]}); restore one from a copy, or start over "
                f"with --run.overwrite true"
            ),
            quiet,
        )
    if path is None and which == "auto":
        if lead:
            print(
                f"meshspeed: checkpoint.resume=auto: no checkpoint in {run_dir}, starting at step 0",
                flush=True,
            )
        return None, False
    if path is None:
        raise echo(
            ConfigError(
                f"checkpoint.resume=latest but {run_dir} holds no complete checkpoint; drop "
                f"--checkpoint.resume or point --run.dir at the earlier run"
            ),
            quiet,
        )
    return path, True
