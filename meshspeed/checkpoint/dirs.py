"""Checkpoint directories: naming, atomic publish, pruning, cross-rank agreement, run directories.

The file-system half of meshspeed.checkpoint.dcp (which decides what goes in): a checkpoint
is `run_dir/step-NNNNNN/`, complete only once it holds COMPLETE (and MANIFEST.json, see
manifest.py); saves go to `.tmp-<nonce>` and are renamed into place, so a crash never leaves a
half-written "latest".
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import sys

import torch

from meshspeed import comm
from meshspeed.checkpoint.manifest import quick_check, verify
from meshspeed.comm import ConfigError
from meshspeed.comm.errors import echo

COMPLETE = "COMPLETE"  # a step-N directory without it is not a checkpoint
_STEP_RE = re.compile(r"^step-(\d+)$")
_STALE_RE = re.compile(r"^step-\d+\.(tmp|old)-[0-9a-f]+$")
# What a run writes into run.dir besides checkpoints: what `run.overwrite` deletes.
RUN_OUTPUTS = (
    "metrics.jsonl",
    "loss.png",
    "tb",
    "model.safetensors",
    "model.safetensors.index.json",
    "pp_trace.json",
    "pp_trace.png",
    "pp_trace_sim.png",
)
_RUN_OUTPUT_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


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
        m = _STEP_RE.match(name)
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
    if _STEP_RE.match(os.path.basename(os.path.normpath(path))) or os.path.isfile(
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
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: str) -> None:
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


def torch_save(obj, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def clean_stale(run_dir: str) -> None:
    for name in os.listdir(run_dir):
        if _STALE_RE.match(name):
            shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)


def publish(tmp: str, final: str, nonce: str) -> None:
    """Rename `tmp` to `final`; an existing `final` (the same step saved again) is moved aside first."""
    old = None
    if os.path.exists(final):
        old = f"{final}.old-{nonce}"
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(os.path.dirname(final) or ".")
    if old:
        shutil.rmtree(old, ignore_errors=True)


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
        # Unmark first: a crash mid-delete must not leave a half-deleted "complete" checkpoint.
        os.remove(os.path.join(path, COMPLETE))
        shutil.rmtree(path, ignore_errors=True)


# -- run directories ------------------------------------------------------------------------
def run_outputs(run_dir: str) -> list[str]:
    """Names in `run_dir` a previous run wrote (checkpoints, metrics, plots, exports)."""
    if not os.path.isdir(run_dir):
        return []
    return sorted(
        n
        for n in os.listdir(run_dir)
        if _STEP_RE.match(n) or _STALE_RE.match(n) or n in RUN_OUTPUTS or _RUN_OUTPUT_RE.match(n)
    )


def check_fresh(run_dir: str) -> None:
    """A new run (no checkpoint.resume) must not mix its outputs with an earlier run's."""
    found = [n for n in run_outputs(run_dir) if _STEP_RE.match(n) or n == "metrics.jsonl"]
    if found:
        shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise ConfigError(
            f"run.dir={run_dir} already holds {shown} from an earlier run; continue it with "
            f"--checkpoint.resume latest (or auto), start over with --run.overwrite true, "
            f"or choose another --run.dir"
        )


def clear_run_dir(run_dir: str) -> list[str]:
    """Delete what an earlier run wrote in `run_dir` (only meshspeed's own outputs); returns the names."""
    names = run_outputs(run_dir)
    for name in names:
        path = os.path.join(run_dir, name)
        if os.path.isdir(path) and not os.path.islink(path):
            if os.path.isfile(os.path.join(path, COMPLETE)):
                os.remove(os.path.join(path, COMPLETE))  # never a half-deleted "complete" checkpoint
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.remove(path)
    return names


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
