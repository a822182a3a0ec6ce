"""Run directories: what a run wrote there, so that starting over deletes only that.

    run_dir/.meshspeed-run.json   {"format": "meshspeed-run/1", "files": ["metrics.jsonl", "tb", ...]}
    run_dir/.meshspeed.lock       the owner's lock (lock.py)
    run_dir/step-000100/          checkpoints, each listing its own files in MANIFEST.json

A name is meshspeed's when the run manifest lists it (a run claims the names it will write
before it starts), or, for a checkpoint, when its MANIFEST.json lists the file. `run.overwrite`
deletes exactly those, never by name alone: the Hugging Face weights of a `model.init_from`
directory that is also the run directory stay. A run whose outputs would replace a file
meshspeed did not write is refused before it starts.
"""

from __future__ import annotations

import json
import os
import re
import shutil

from meshspeed.checkpoint.dirs import STALE_RE, STEP_RE, remove_checkpoint, resolve
from meshspeed.checkpoint.safetensors_io import read_safetensors_metadata
from meshspeed.comm import outputs
from meshspeed.comm.errors import ConfigError

RUN_MANIFEST = ".meshspeed-run.json"
FORMAT = "meshspeed-run/1"
# What every run writes beside its checkpoints (when the tools for them are installed).
LOGS = ("metrics.jsonl", "loss.png", "tb", "pp_trace.json", "pp_trace.png", "pp_trace_sim.png")
_SHARD_RE = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?$")


def export_names(safetensors: bool, hf: bool, pp: int = 1) -> tuple[str, ...]:
    """The names `checkpoint.export_safetensors` / `export_hf` write in the run directory."""
    out = []
    if safetensors:
        if pp == 1:
            out.append("model.safetensors")
        else:
            out += [f"model-{s:05d}-of-{pp:05d}.safetensors" for s in range(1, pp + 1)]
            out.append("model.safetensors.index.json")
    return tuple(out + (["hf"] if hf else []))


def read_run_manifest(run_dir: str) -> list[str] | None:
    """The names the run manifest lists, or None when there is none; a damaged one is one line."""
    path = os.path.join(run_dir, RUN_MANIFEST)
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is unreadable ({type(e).__name__}); delete it to start over") from None
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(files, list):
        raise ConfigError(f"{path} is not a {FORMAT} manifest (keys 'format' and 'files', a list)")
    bad = [n for n in files if not isinstance(n, str) or not outputs.inside(n) or "/" in n]
    if bad:
        raise ConfigError(f"{path}: key 'files' holds {bad[0]!r}; expected names of files in run.dir")
    return files


def _write_run_manifest(run_dir: str, names) -> None:
    body = json.dumps({"format": FORMAT, "files": sorted(set(names))}, indent=1).encode()
    tmp = os.path.join(run_dir, f"{RUN_MANIFEST}.{os.getpid()}.part")
    with open(tmp, "wb") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(run_dir, RUN_MANIFEST))


def _is_checkpoint(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, n)) for n in ("MANIFEST.json", "meta.json", "COMPLETE"))


def _listed(run_dir: str) -> set[str]:
    """Names meshspeed wrote here: the manifest's, or for a run directory written before there
    was one (it holds meshspeed checkpoints), the run logs it holds."""
    names = read_run_manifest(run_dir)
    if names is not None:
        return set(names)
    steps = [n for n in os.listdir(run_dir) if STEP_RE.match(n)]
    if not any(_is_checkpoint(os.path.join(run_dir, n)) for n in steps):
        return set()
    logs = {n for n in LOGS if os.path.lexists(os.path.join(run_dir, n))}
    exported = {n for n in os.listdir(run_dir) if _SHARD_RE.match(n) and _exported(os.path.join(run_dir, n))}
    return logs | exported


def _exported(path: str) -> bool:
    """A safetensors file meshspeed's export wrote (it records the layout in its metadata)."""
    if path.endswith(".json"):
        return False
    try:
        return "meshspeed_layout" in read_safetensors_metadata(path)
    except (OSError, ValueError):
        return False


def run_outputs(run_dir: str) -> list[str]:
    """Names in `run_dir` an earlier run wrote: checkpoints, interrupted saves, listed outputs."""
    if not os.path.isdir(run_dir):
        return []
    listed = _listed(run_dir)
    return sorted(
        n for n in os.listdir(run_dir) if STEP_RE.match(n) or STALE_RE.match(n) or (n in listed)
    )


def check_fresh(run_dir: str) -> None:
    """A new run (no checkpoint.resume) must not mix its outputs with an earlier run's."""
    found = [n for n in run_outputs(run_dir) if STEP_RE.match(n) or n == "metrics.jsonl"]
    if found:
        shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise ConfigError(
            f"run.dir={run_dir} already holds {shown} from an earlier run; continue it with "
            f"--checkpoint.resume latest (or auto), start over with --run.overwrite true, "
            f"or choose another --run.dir"
        )


def _remove(run_dir: str, name: str) -> bool:
    """Delete one output meshspeed wrote; False when something not meshspeed's stays there."""
    path = os.path.join(run_dir, name)
    if STEP_RE.match(name) or STALE_RE.match(name):
        return not remove_checkpoint(path)
    if os.path.islink(path) or not os.path.isdir(path):
        os.remove(path)
        return True
    if os.path.isfile(os.path.join(path, outputs.OUTPUT_MANIFEST)):  # an export: its own list
        return not outputs.remove_listed(path)
    shutil.rmtree(path)  # a directory only a run writes into (tb/)
    return True


def clear_run_dir(run_dir: str) -> list[str]:
    """Delete what earlier runs wrote in `run_dir` (what the manifests list); returns the names.
    A checkpoint directory that also holds files meshspeed did not write keeps them."""
    names = run_outputs(run_dir)
    gone = [n for n in names if _remove(run_dir, n)]
    listed = read_run_manifest(run_dir)
    if listed is not None:
        _write_run_manifest(run_dir, [n for n in listed if os.path.lexists(os.path.join(run_dir, n))])
    return gone


def claim_run_dir(run_dir: str, *, resume: bool, overwrite: bool, exports=(), lead: bool = True) -> list[str]:
    """Apply the run-directory policy for a run about to write LOGS + `exports` in `run_dir`:
    refuse names it would replace that meshspeed did not write; with `overwrite` delete what
    earlier runs wrote (returned); without `resume` refuse a directory an earlier run used.
    Then (`lead` only) record the names this run will write. Call under the run's lock."""
    if os.path.lexists(run_dir) and not os.path.isdir(run_dir):
        raise ConfigError(f"run.dir={run_dir} is a file; name a directory for the run's outputs")
    writes = tuple(LOGS) + tuple(exports)
    removed: list[str] = []
    if os.path.isdir(run_dir):
        listed = _listed(run_dir)
        theirs = [n for n in writes if os.path.lexists(os.path.join(run_dir, n)) and n not in listed]
        if theirs:
            raise ConfigError(
                f"run.dir={run_dir} holds {theirs[0]}, which meshspeed did not write and this run would "
                f"replace; move it away or choose another --run.dir (--run.overwrite deletes only what "
                f"meshspeed wrote)"
            )
        if overwrite and lead:
            removed = clear_run_dir(run_dir)
        elif not resume and not overwrite:
            check_fresh(run_dir)
    if lead:
        os.makedirs(run_dir, exist_ok=True)
        kept = read_run_manifest(run_dir) or (_listed(run_dir) if os.path.isdir(run_dir) else set())
        _write_run_manifest(run_dir, set(kept) | set(writes))
    return removed


# The settings that decide which tokens a run trains on; a resume must keep them.
DATA_KEYS = ("path", "format", "tokenizer", "max_mb")


def check_resume_data(checkpoint: str, recorded: dict | None, config: dict, vocab_size: int) -> None:
    """Refuse, in one line, to resume `checkpoint` on other data than it was trained on: another
    data.path, format, tokenizer or corpus size, or a model vocabulary of another size (its
    token ids would mean other tokens). `recorded` is the checkpoint's state (`extra` holds the
    run's config and model config); `config` this run's settings as a dict."""
    extra = (recorded or {}).get("extra") or {}
    was = (extra.get("config") or {}).get("data")
    now = config.get("data") or {}
    if isinstance(was, dict):
        for key in DATA_KEYS:
            if key == "max_mb" and now.get("path") not in ("", None, "stdlib"):
                continue  # the cap applies to the built-in corpus only
            if key in was and key in now and was[key] != now[key]:
                raise ConfigError(
                    f"checkpoint {checkpoint} was trained with data.{key}={was[key]!r} but this run has "
                    f"data.{key}={now[key]!r}; resume with the same data, or add "
                    f"--checkpoint.allow_data_change true to continue on other data on purpose"
                )
    vocab = (extra.get("model_config") or {}).get("vocab_size")
    if type(vocab) is int and vocab != vocab_size:
        raise ConfigError(
            f"checkpoint {checkpoint} was trained with a {vocab:,}-token vocabulary but this run's model "
            f"has {vocab_size:,}; resume with the same model and tokenizer"
        )


def check_resume(path: str, config: dict, vocab_size: int) -> None:
    """check_resume_data for a checkpoint (or run directory) path: its state.pt read as plain data."""
    from meshspeed.checkpoint.dcp import STATE, load_state  # dcp's protocol, beside this file

    resolved = resolve(path)
    check_resume_data(resolved, load_state(os.path.join(resolved, STATE)), config, vocab_size)
