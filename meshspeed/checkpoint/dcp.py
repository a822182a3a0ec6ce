"""Checkpoints: atomic, resharding, resumable (directories in dirs.py, the tensor mapping in
tensors.py, safetensors export in export.py).

A checkpoint is a directory `run_dir/step-000100/`:

    .metadata, __*_0.distcp   DCP: model params and persistent buffers ("model.<fqn>"; e.g.
                              sparsity masks) and optimizer state per param ("optim.<fqn>.<name>",
                              contract 2), each rank writing its shards
    rng/rank-00003.pt         each rank's torch CPU/CUDA and Python RNG states
    state.pt                  step, scheduler state, extra, config, optimizer scalars (rank 0)
    meta.json                 readable summary: step, layout, world size, versions, config
    COMPLETE                  a `step-N` directory without it is not a checkpoint
    MANIFEST.json             written last: every other file with its size and SHA-256 (manifest.py)

Atomicity: everything is written under `step-000100.tmp-<nonce>`; only after every rank has
reported success (an all-gather of ok flags, so a failure on one rank fails the save on all
without a hang) does rank 0 write COMPLETE and the manifest and rename the directory into
place. A crash leaves a `.tmp-` directory that `latest_checkpoint` ignores and the next save
deletes. A state holding a NaN or inf is never saved.

Trust: loading verifies every file against the manifest first, and never unpickles without
restriction: state and RNG files load with torch.load(weights_only=True), DCP's `.metadata`
through an allow-listed unpickler (comm.checkpoint_io), so a planted pickle payload is refused,
not run.

Resharding: tensors are saved as DTensors of the layout that wrote them and loaded into DTensors
built for the current one (`meshspeed.comm.checkpoint_io`), so tp, dp and ZeRO may all change.
Files are on a filesystem every rank sees (DCP's FileSystemWriter/Reader need that).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import random
import shutil
import time
import warnings

import torch

from meshspeed import comm
from meshspeed.checkpoint import manifest
from meshspeed.checkpoint.dirs import (
    COMPLETE,
    CheckpointError,
    agree,
    clean_stale,
    fsync_dir,
    fsync_write,
    latest_checkpoint,
    list_checkpoints,
    prune,
    publish,
    resolve,
    shared_nonce,
    torch_save,
)
from meshspeed.checkpoint.safetensors_io import read_safetensors, write_safetensors
from meshspeed.checkpoint.tensors import (
    buffer_specs,
    check_buffers,
    check_params,
    optimizer_buffers,
    optimizer_tensors,
    param_specs,
)
from meshspeed.comm import ConfigError
from meshspeed.comm import checkpoint_io as io
from meshspeed.comm.errors import echo

FORMAT = "meshspeed-checkpoint/1"
META, STATE, RNG_DIR = "meta.json", "state.pt", "rng"

__all__ = [
    "CheckpointError",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "read_safetensors",
    "save_checkpoint",
    "write_safetensors",
]


_PLAIN = (type(None), bool, int, float, str, bytes, torch.Tensor, torch.dtype, torch.Size)


def _plain(obj, where: str):
    """Check `obj` is plain data (loadable with torch.load(weights_only=True)); dataclasses become dicts."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = dataclasses.asdict(obj)
    if isinstance(obj, dict):
        return {k: _plain(v, f"{where}[{k!r}]") for k, v in obj.items()}
    if type(obj) in (list, tuple):  # not a namedtuple: weights_only loading refuses those
        return type(obj)(_plain(v, f"{where}[{i}]") for i, v in enumerate(obj))
    if not isinstance(obj, _PLAIN):
        raise ConfigError(
            f"{where} is a {type(obj).__name__}; checkpoints hold plain data (dict, list, tuple, str, "
            f"number, bool, None, tensor) so they load without unpickling code"
        )
    return obj


def _first_nonfinite(tensors: dict[str, torch.Tensor]) -> str | None:
    """The name of the first floating tensor holding a NaN or inf, or None."""
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t.detach()).all()):
            return name
    return None


def _rng_state() -> dict:
    cuda = (
        torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    )
    return {"cpu": torch.get_rng_state(), "cuda": cuda, "python": random.getstate()}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    random.setstate(state["python"])
    if (
        state.get("cuda") is not None
        and torch.cuda.is_available()
        and len(state["cuda"]) == torch.cuda.device_count()
    ):
        torch.cuda.set_rng_state_all(state["cuda"])


def _save_rng(directory: str, rank: int) -> None:
    os.makedirs(os.path.join(directory, RNG_DIR), exist_ok=True)
    torch_save(_rng_state(), os.path.join(directory, RNG_DIR, f"rank-{rank:05d}.pt"))


# -- save -----------------------------------------------------------------------------------
def save_checkpoint(
    run_dir: str,
    step: int,
    model,
    optimizer,
    mesh,
    *,
    scheduler_state=None,
    extra=None,
    config=None,
    keep: int | None = 3,
) -> str:
    """Collective over the world: save `run_dir/step-NNNNNN` atomically and return its path.

    `optimizer` (or None) follows contract 2. `scheduler_state`, `extra` and `config` are plain
    data (a dataclass config is stored as a dict). `keep`: complete checkpoints kept (None: all).
    """
    if step < 0:
        raise ConfigError(f"checkpoint step={step} must be ≥ 0")
    if keep is not None and keep < 1:
        raise ConfigError(f"checkpoint keep={keep} must be ≥ 1 (or None to keep every checkpoint)")
    if config is not None and hasattr(config, "to_dict"):
        config = config.to_dict()
    state = {
        "step": int(step),
        "scheduler_state": _plain(scheduler_state, "scheduler_state"),
        "extra": _plain(extra, "extra"),
        "config": _plain(config, "config"),
    }
    ctx = mesh.ctx
    lead = ctx.rank == 0
    params, specs = param_specs(model, mesh)
    buffers, bspecs = buffer_specs(model)
    tensors = {f"model.{k}": p for k, p in {**params, **buffers}.items()}
    tspecs = {f"model.{k}": s for k, s in {**specs, **bspecs}.items()}
    state["optimizer"] = None
    if optimizer is not None:
        per = optimizer.state_dict_per_param()  # collective over dp (ZeRO gathers)
        t2, s2, scalars = optimizer_tensors(per, params, specs)
        state["optimizer"] = _plain(scalars, "optimizer scalars")
        tensors.update(t2)
        tspecs.update(s2)
    # A NaN that reached the weights or the optimizer must not become the newest checkpoint
    # (and, through pruning, the only one): refuse, on every rank.
    bad = _first_nonfinite(tensors)
    refusal = (
        CheckpointError(
            f"refusing to save checkpoint step {step}: {bad} holds non-finite values (NaN "
            f"or inf); the newest checkpoint is still the last good one"
        )
        if bad
        else None
    )
    agree(mesh, refusal, f"saving checkpoint step {step}")
    # The tensor index is DCP's .metadata (the union of every rank's writes, pipeline stages
    # included); meta.json is for people and tools.
    meta = {
        "format": FORMAT,
        "step": int(step),
        "time": time.time(),
        "world_size": ctx.world_size,
        "layout": dataclasses.asdict(mesh.dims),
        "torch": torch.__version__,
        "optimizer": optimizer is not None,
        "config": state["config"],
    }
    nonce = shared_nonce(mesh)
    final = os.path.join(run_dir, f"step-{step:06d}")
    tmp = f"{final}.tmp-{nonce}"
    what = f"saving checkpoint step {step} to {final}"

    err = None
    if lead:
        try:
            os.makedirs(run_dir, exist_ok=True)
            clean_stale(run_dir)  # left by a crashed save
            os.makedirs(tmp)
        except Exception as e:  # noqa: BLE001 - reported on every rank by agree
            err = e
    agree(mesh, err, what)
    try:
        try:
            io.save(tmp, tensors, tspecs, mesh)
        except io.CheckpointIOError as e:  # raised on every rank alike: no agreement needed
            raise CheckpointError(f"{what} failed: {e}") from None
        try:
            _save_rng(tmp, ctx.rank)
            manifest.write_part(tmp, ctx.rank)  # hashes of what this rank wrote, while it is cached
        except Exception as e:  # noqa: BLE001
            err = e
        agree(mesh, err, what)
        if lead:
            try:
                torch_save(state, os.path.join(tmp, STATE))
                fsync_write(os.path.join(tmp, META), json.dumps(meta, indent=1, default=str).encode())
                fsync_write(os.path.join(tmp, COMPLETE), f"{step}\n".encode())
                manifest.write_manifest(tmp, step)  # the last file: lists every other one
                fsync_dir(tmp)
                publish(tmp, final, nonce)
            except Exception as e:  # noqa: BLE001
                err = e
            if err is None and keep is not None:
                try:
                    prune(run_dir, keep, final)
                except OSError as e:  # the checkpoint itself is safe; do not fail the step for this
                    warnings.warn(f"could not delete old checkpoints in {run_dir}: {e}", stacklevel=2)
        agree(mesh, err, what)
    except BaseException:
        if lead:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


# -- load -----------------------------------------------------------------------------------
def load_plain(path: str):
    """torch.load of plain data only (weights_only): a pickle that names code is refused, never
    run; a truncated or damaged file is one line naming it."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise CheckpointError(
            f"{path} holds pickled objects a checkpoint never needs (code, or classes "
            f"beyond plain data and tensors); refused without running them (was the "
            f"file altered?)"
        ) from None
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing; the checkpoint is incomplete") from None
    except Exception as e:  # RuntimeError/EOFError/...: torch's words for a truncated zip
        why = (str(e).splitlines() or [type(e).__name__])[0][:120]
        raise CheckpointError(f"{path} is damaged or truncated ({type(e).__name__}: {why})") from None


def load_state(path: str) -> dict:
    """A checkpoint's state.pt, checked for the shape save_checkpoint gives it."""
    state = load_plain(path)
    if not isinstance(state, dict) or type(state.get("step")) is not int or state["step"] < 0:
        got = state.get("step") if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(f"{path}: key 'step' is {got!r}; expected a step number ≥ 0 (was it altered?)")
    for key in ("extra", "config"):  # read by key when resuming and converting
        if state.get(key) is not None and not isinstance(state[key], dict):
            kind = type(state[key]).__name__
            raise CheckpointError(f"{path}: key {key!r} is a {kind}; expected a dict or None (altered?)")
    return state


def read_meta(path: str) -> dict:
    """A checkpoint's meta.json, each key loading uses checked: one line naming the file, the
    key, the value and what is valid."""
    try:
        with open(path, "rb") as f:
            meta = json.loads(f.read())
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{path} is unreadable ({type(e).__name__}): a damaged checkpoint") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path} holds a JSON {type(meta).__name__}; expected an object")
    for key, ok, valid in (
        ("step", lambda v: type(v) is int and v >= 0, "a step number ≥ 0"),
        ("world_size", lambda v: type(v) is int and v >= 1, "a world size ≥ 1"),
        ("optimizer", lambda v: isinstance(v, bool), "true or false"),
    ):
        if not ok(meta.get(key)):
            raise CheckpointError(f"{path}: key {key!r} is {meta.get(key)!r}; expected {valid}")
    return meta


def load_checkpoint(
    path: str, model, optimizer, mesh, *, strict: bool = True, restore_rng: bool = True, verify: bool = True
) -> dict:
    """Collective over the world: restore model, optimizer, RNG from `path` (a checkpoint, or a
    run directory meaning its latest complete one), whatever layout saved it.

    `verify`: check every file against the checkpoint's manifest first (sizes and SHA-256, each
    rank hashing a share); a mismatch is an error naming the file. Nothing is unpickled without
    restriction either way. Returns {"path", "step", "scheduler_state", "extra", "config",
    "rng_restored"}. RNG states come back only when the world size is unchanged (each rank
    takes its own stream back).
    """
    ctx = mesh.ctx
    resolved, meta, err = None, None, None
    try:
        resolved = resolve(path)
    except Exception as e:  # noqa: BLE001
        err = e
    agree(mesh, err, f"loading checkpoint {path}")
    if verify:
        reason = manifest.verify(resolved, mesh)
        if reason:  # the same on every rank: rank 0 reports it
            raise echo(CheckpointError(f"checkpoint {resolved} does not verify: {reason}"), ctx.rank != 0)
    try:
        meta = read_meta(os.path.join(resolved, META))
        # Verified or not, tensor data is read only from inside the checkpoint.
        outside = [r for r in manifest.referenced(resolved) if not manifest.inside(resolved, r)]
        if outside:
            raise CheckpointError(
                f"checkpoint {resolved}: its .metadata points tensor data at {outside[0]!r}, outside "
                f"the checkpoint; refused (a crafted file?)"
            )
    except Exception as e:  # reported on every rank by agree
        err = e
    agree(mesh, err, f"loading checkpoint {path}")
    step = torch.tensor([int(meta["step"])], dtype=torch.int64, device=ctx.device)
    steps = comm.all_gather(step, mesh["world"]).tolist()
    if len(set(steps)) > 1:
        raise CheckpointError(
            f"ranks resolved {path} to different checkpoints (steps {steps}); "
            f"is the run directory on a filesystem every rank sees?"
        )

    params, specs = param_specs(model, mesh)
    buffers, bspecs = buffer_specs(model)
    tensors = {f"model.{k}": p.detach() for k, p in params.items()}
    tspecs = {f"model.{k}": s for k, s in specs.items()}
    try:
        saved = io.saved_tensors(resolved)
        check_params(saved, params, specs, resolved, strict, mesh.dims.pp, buffers)
        for fqn, b in check_buffers(saved, buffers, bspecs, resolved, strict).items():
            tensors[f"model.{fqn}"] = b
            if fqn in bspecs:
                tspecs[f"model.{fqn}"] = bspecs[fqn]
        if optimizer is not None:
            if not meta.get("optimizer"):
                raise CheckpointError(
                    f"checkpoint {resolved} has no optimizer state; pass optimizer=None to load weights only"
                )
            buffers, bspecs, where = optimizer_buffers(saved, params, specs, resolved)
            tensors.update(buffers)
            tspecs.update(bspecs)
        state = load_state(os.path.join(resolved, STATE))
    except Exception as e:  # noqa: BLE001
        err = e
    agree(mesh, err, f"loading checkpoint {resolved}")

    try:
        with torch.no_grad():
            io.load(resolved, tensors, tspecs, mesh)
    except io.CheckpointIOError as e:
        why = str(e).splitlines()[0]
        if "Weights only load failed" in str(e):  # torch.load(weights_only=True) met pickled code
            why = (
                "a tensor file holds pickled objects a checkpoint never needs (code, or classes beyond "
                "tensors); refused without running them (was the file altered?)"
            )
        raise CheckpointError(f"loading checkpoint {resolved} failed: {why}") from None
    if optimizer is not None:
        per: dict = dict(state["optimizer"])
        for key, t in buffers.items():
            fqn, name = where[key]
            per.setdefault(fqn, {})[name] = t
        optimizer.load_state_dict_per_param(per)  # collective over dp (each ZeRO rank keeps its slice)

    rng_ok = restore_rng and meta["world_size"] == ctx.world_size
    if rng_ok:
        _set_rng_state(load_plain(os.path.join(resolved, RNG_DIR, f"rank-{ctx.rank:05d}.pt")))
    return {
        "path": resolved,
        "step": state["step"],
        "scheduler_state": state["scheduler_state"],
        "extra": state["extra"],
        "config": state["config"],
        "rng_restored": rng_ok,
    }


# -- export ---------------------------------------------------------------------------------
