"""Typed training configuration: dataclass sections, TOML presets, `--section.key value` overrides.

Precedence: dataclass defaults (the `tiny` preset: trains in minutes on a 2-core laptop) <
the TOML file given with --config < command-line overrides. Every field has a help text (shown
by `meshspeed train --help`), and a bad value fails at start-up with one line naming the key,
the value and what would be valid.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import fields
from typing import Any, get_type_hints

from meshspeed.comm.errors import ConfigError
from meshspeed.plan.sections import (  # noqa: F401  (re-exported: callers use config.X)
    CheckpointSection,
    Config,
    DataSection,
    MemorySection,
    ModelSection,
    MoeSection,
    ParallelSection,
    RunSection,
    SparsitySection,
    TrainSection,
    opt,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


SECTIONS = {name: typ for name, typ in get_type_hints(Config).items() if name != "nproc"}


def _section_types(cls) -> dict[str, type]:
    return get_type_hints(cls)


def _coerce(key: str, raw: Any, typ: type, choices: tuple | None):
    """Turn a TOML or command-line value into the field's type, or fail with one line."""
    try:
        if typ is bool:
            if isinstance(raw, bool):
                value = raw
            elif str(raw).lower() in ("1", "true", "yes", "on"):
                value = True
            elif str(raw).lower() in ("0", "false", "no", "off"):
                value = False
            else:
                raise ValueError
        elif typ is int:
            if isinstance(raw, float) and not raw.is_integer():
                raise ValueError
            value = int(raw) if not isinstance(raw, str) else int(raw, 10)
        elif typ is float:
            value = float(raw)
        else:
            value = str(raw)
    except (TypeError, ValueError):
        kind = {bool: "true or false", int: "an integer", float: "a number"}.get(typ, "a string")
        raise ConfigError(f"{key}={raw!r} is not {kind}") from None
    if choices and value not in choices:
        raise ConfigError(f"{key}={raw!r} is not valid; choose one of {', '.join(map(str, choices))}")
    return value


def _set(cfg: Config, key: str, raw: Any) -> None:
    section, _, name = key.partition(".")
    if section == "modules":  # modules.encoder.ranks (Megatron's per-module spelling) = encoder_ranks
        name = name.replace(".", "_")
    if not name:
        if section != "nproc":
            raise ConfigError(f"unknown setting {key!r}; settings look like section.key, e.g. train.steps")
        cfg.nproc = _coerce("nproc", raw, int, None)
        return
    if section not in SECTIONS:
        raise ConfigError(f"unknown section {section!r} in {key!r}; valid sections: {', '.join(SECTIONS)}")
    sec = getattr(cfg, section)
    hints = _section_types(type(sec))
    if name not in hints:
        raise ConfigError(f"unknown setting {key!r}; valid in [{section}]: {', '.join(hints)}")
    meta = {f.name: f.metadata for f in fields(sec)}[name]
    setattr(sec, name, _coerce(key, raw, hints[name], meta.get("choices")))


# A settings file or a planner's layout file is kilobytes; a link to /dev/zero must not fill memory.
MAX_FILE_BYTES = 8 << 20
# How long a named pipe may stay silent (no writer yet, or one that sends nothing) before it is
# refused; an anonymous pipe (`<(meshspeed plan --json)`) has a writer from the start, which may
# take a while (planning) and is waited on for PIPE_WAIT_S instead.
FIFO_WAIT_S = 5.0
PIPE_WAIT_S = 300.0


def read_input(path: str, what: str, limit: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of a settings file named on the command line (`what`: the flag and path, for
    the error): a regular file of at most `limit` bytes, or a pipe (`<(cat plan.json)`, a named
    pipe with a writer) read until its end with a bound on the bytes and on each wait. Anything
    else (a device, a directory, a socket) and every bound passed is one ConfigError line."""
    import select
    import stat
    import time

    try:
        st = os.stat(path)
    except OSError as err:
        raise ConfigError(f"{what}: cannot read it ({err.strerror})") from None
    if stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{what} is a directory; give the file")
    fifo = stat.S_ISFIFO(st.st_mode)
    if not (fifo or stat.S_ISREG(st.st_mode)):
        raise ConfigError(f"{what} is not a regular file or a pipe (a device or socket); give the file")
    if st.st_size > limit:
        raise ConfigError(
            f"{what} holds {st.st_size:,} bytes, more than such a file has ({limit:,}); check the path"
        )
    try:
        # non-blocking: open() of a named pipe with no writer would wait forever
        fd = os.open(path, os.O_RDONLY | (os.O_NONBLOCK if fifo else 0))
    except OSError as err:
        raise ConfigError(f"{what}: cannot read it ({err.strerror})") from None
    anonymous = fifo and os.path.realpath(path).rpartition("/")[2].startswith("pipe:")
    wait = PIPE_WAIT_S if anonymous else FIFO_WAIT_S
    chunks, size = [], 0
    try:
        while size <= limit:
            if fifo:
                deadline = time.monotonic() + wait
                while not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                    if time.monotonic() >= deadline:
                        raise ConfigError(
                            f"{what} is a pipe nothing was written to in {wait:g} s (no writer?); give "
                            f"the file, or a pipe with a writer: <(cat plan.json)"
                        )
            try:
                chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            except BlockingIOError:  # woken with nothing to read yet
                continue
            except OSError as err:
                raise ConfigError(f"{what}: cannot read it ({err.strerror})") from None
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if size > limit:
        raise ConfigError(
            f"{what} holds more than {limit:,} bytes, more than such a file has; check the path"
        )
    return b"".join(chunks)


def load(path: str | None = None, overrides: list[tuple[str, str]] | None = None) -> Config:
    """Defaults < TOML file < overrides [(\"train.steps\", \"100\"), ...]; then validate."""
    cfg = Config()
    if path:
        if not os.path.exists(path):
            raise ConfigError(f"--config {path!r} does not exist")
        try:
            data = tomllib.loads(read_input(path, f"--config {path}").decode("utf-8"))
        except UnicodeDecodeError as err:
            raise ConfigError(f"--config {path}: not valid TOML (not UTF-8 text: {err.reason})") from None
        except RecursionError:
            raise ConfigError(f"--config {path}: not valid TOML (nested too deeply)") from None
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"--config {path}: not valid TOML ({err})") from None
        for key, value in data.items():
            if isinstance(value, dict):
                for name, v in value.items():
                    # [modules.encoder] tables: one level deeper, flattened to encoder_<key>
                    for sub, w in v.items() if isinstance(v, dict) else [("", v)]:
                        _set(cfg, f"{key}.{name}" + (f".{sub}" if sub else ""), w)
            else:
                _set(cfg, key, value)
    for key, raw in overrides or []:
        _set(cfg, key, raw)
    validate(cfg)
    return cfg


def _check_finite(cfg: Config) -> None:
    """No setting takes NaN or infinity (`train.lr inf` would train on NaN weights)."""
    for section in SECTIONS:
        sec = getattr(cfg, section)
        for f in fields(sec):
            v = getattr(sec, f.name)
            if isinstance(v, float) and not math.isfinite(v):
                raise ConfigError(f"{section}.{f.name}={v} is not a finite number; default {f.default}")


def validate(cfg: Config) -> None:
    """Checks of the settings alone; the run plan (plan/run_plan.py) checks them against the world
    size, the model and the data."""
    _check_finite(cfg)
    t, p, c = cfg.train, cfg.parallel, cfg.checkpoint
    positive = [
        ("train.steps", t.steps),
        ("train.global_batch_size", t.global_batch_size),
        ("train.micro_batch_size", t.micro_batch_size),
        ("train.seq_len", t.seq_len),
        ("parallel.tp", p.tp),
        ("parallel.pp", p.pp),
        ("parallel.vpp", p.vpp),
        ("parallel.cp", p.cp),
        ("parallel.cp_ulysses", p.cp_ulysses),
        ("nproc", cfg.nproc),
    ]
    for key, value in positive:
        if value < 1:
            raise ConfigError(f"{key}={value} must be ≥ 1")
    for key, value in [
        ("parallel.dp", p.dp),
        ("train.warmup_steps", t.warmup_steps),
        ("train.exit_interval", t.exit_interval),
        ("checkpoint.interval", c.interval),
        ("train.eval_interval", t.eval_interval),
        ("run.timeout", cfg.run.timeout),
        ("train.weight_decay", t.weight_decay),
        ("memory.recompute_layers", cfg.memory.recompute_layers),
        ("memory.swap_layers", cfg.memory.swap_layers),
    ]:
        if not value >= 0:
            raise ConfigError(f"{key}={value} must be ≥ 0")
    if t.grad_clip < 0:
        raise ConfigError(
            f"train.grad_clip={t.grad_clip} must be ≥ 0 (a gradient-norm bound; 0 = no clipping)"
        )
    for key, value in (("train.beta1", t.beta1), ("train.beta2", t.beta2)):
        if not 0 <= value < 1:
            raise ConfigError(f"{key}={value} must be in [0, 1), e.g. 0.9 for beta1 and 0.95 for beta2")
    for key, value in (
        ("train.eval_batches", t.eval_batches),
        ("run.log_interval", cfg.run.log_interval),
    ):
        if value < 1:
            raise ConfigError(f"{key}={value} must be ≥ 1")
    for key, value, unit in (
        ("data.max_mb", cfg.data.max_mb, "megabytes of text to read, e.g. 8"),
        ("parallel.bucket_mb", p.bucket_mb, "megabytes per gradient bucket, e.g. 25"),
    ):
        if not value > 0:
            raise ConfigError(f"{key}={value} must be > 0: {unit}")
    if t.max_bad_steps < 1:
        raise ConfigError(
            f"train.max_bad_steps={t.max_bad_steps} must be ≥ 1 (the run stops after this "
            f"many non-finite steps in a row)"
        )
    if cfg.run.overwrite and c.resume:
        raise ConfigError(
            f"run.overwrite=true deletes what checkpoint.resume={c.resume!r} would load; choose one of them"
        )
    if not t.lr > 0:
        raise ConfigError(f"train.lr={t.lr} must be > 0")
    if not 0 <= t.min_lr_ratio <= 1:
        raise ConfigError(f"train.min_lr_ratio={t.min_lr_ratio} must be between 0 and 1")
    if c.keep < 1:
        raise ConfigError(f"checkpoint.keep={c.keep} must be ≥ 1")
    if p.tp_overlap and not p.sequence_parallel:
        raise ConfigError(
            "parallel.tp_overlap=true overlaps the sequence-parallel collectives; set "
            "parallel.sequence_parallel=true or tp_overlap=false"
        )
    if p.tp_overlap_chunks < 0:
        raise ConfigError(
            f"parallel.tp_overlap_chunks={p.tp_overlap_chunks} must be ≥ 1, or 0 for the cost model's choice"
        )
    if t.compile and cfg.sparsity.pattern != "none":
        raise ConfigError(
            f"train.compile=true with sparsity.pattern={cfg.sparsity.pattern!r} is not supported: the "
            "masks and sparse kernels change between steps under the compiled blocks; turn one off"
        )
    if t.peak_tflops < 0:
        raise ConfigError(
            f"train.peak_tflops={t.peak_tflops} must be > 0 (TFLOP/s of one device), "
            "or 0 for the device table"
        )
    _check_objective(cfg)
    from meshspeed.plan.sparsity import sparsity_config

    # one-line ConfigError if invalid (also step-2 settings without a pattern)
    sparsity_config(cfg.sparsity, total_steps=t.steps, seed=t.seed)


def _check_objective(cfg: Config) -> None:
    d, t = cfg.dpo, cfg.train
    if not d.beta > 0:
        raise ConfigError(f"dpo.beta={d.beta} must be > 0 (0.1 is the DPO paper's)")
    if not 0 <= d.label_smoothing < 0.5:
        raise ConfigError(f"dpo.label_smoothing={d.label_smoothing} must be in [0, 0.5)")
    if d.label_smoothing and d.loss != "robust":  # TRL 1.x: the other losses ignore it
        raise ConfigError(
            f"dpo.label_smoothing={d.label_smoothing} acts only with dpo.loss=robust (not {d.loss!r}); "
            "set dpo.loss=robust or dpo.label_smoothing=0"
        )
    if d.sft_weight < 0:
        raise ConfigError(f"dpo.sft_weight={d.sft_weight} must be ≥ 0")
    if t.objective != "lm" and cfg.data.format != "text":
        raise ConfigError(
            f"train.objective={t.objective} reads conversations or pairs (JSONL or a prepared record "
            f"file in data.path), not data.format={cfg.data.format!r} token files; use data.format=text"
        )
    if t.objective == "dpo" and cfg.data.packing:
        raise ConfigError(
            "data.packing=true with train.objective=dpo: pairs are not packed; use packing=false"
        )


def add_arguments(parser) -> None:
    """One `--section.key` option per field, with its help text, for argparse."""
    parser.add_argument(
        "--nproc",
        dest="nproc",
        default=None,
        help="local worker processes to spawn when not launched by torchrun (default 4)",
    )
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(f"[{section}]")
        hints = _section_types(cls)
        for f in fields(cls):
            choices = f.metadata.get("choices")
            extra = f" ({'|'.join(map(str, choices))})" if choices else ""
            # [modules]: --modules.encoder.ranks spelled as Megatron/MindSpeed users would, too
            alias = [f"--{section}.{f.name.replace('_', '.', 1)}"] if section == "modules" else []
            group.add_argument(
                f"--{section}.{f.name}",
                *alias,
                dest=f"{section}.{f.name}",
                default=None,
                metavar=hints[f.name].__name__.upper(),
                help=f"{f.metadata.get('help', '')}{extra} [default: {f.default}]",
            )


def overrides_from_args(args) -> list[tuple[str, str]]:
    out = []
    for key, value in vars(args).items():
        if value is not None and (key == "nproc" or "." in key):
            out.append((key, value))
    return out
