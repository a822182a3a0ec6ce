"""Where training tokens come from: the built-in corpus, text files, or pre-tokenized files.

* **Built-in corpus** (`data.path` empty): the Python standard library's own `.py` sources, found
  through `sysconfig` and so present on every machine that runs meshspeed. Files are taken in
  sorted relative-path order (POSIX separators) up to `max_mb` (the last file that does not fit is
  cut to fill the cap). Skipped: `site-packages`/`dist-packages`, `__pycache__`, and the test
  directories (`test`, `tests`, `idle_test`): they hold deliberately malformed sources and large
  data blobs, and would double the size for little variety.
* **Text** (`data.path` a file or directory): every regular, non-hidden file, in sorted order;
  files containing a NUL byte are treated as binary and skipped. No size cap.
* **Token files** (`data.format` uint16 / uint32): a flat array of little-endian token ids,
  memory-mapped (paged in on demand, never copied), vocabulary decided by whoever wrote it.

Text corpora are byte-tokenized (see `tokenizer.py`), each file followed by a NUL separator.
**Split**: by file: in the order of a hash of their relative paths (a fixed shuffle, the same
on every machine), files go to validation until it holds `val_fraction` of the bytes. A lone
file, and token files, give their last `val_fraction` of tokens to validation instead.

**Cache**: the encoded splits are written once to `$MESHSPEED_CACHE_DIR` (default
`~/.cache/meshspeed`)`/corpus/<name>-<key>.{train,val}.bin`, the key hashing the Python version,
the file list (path, size, mtime, bytes taken) and the settings, and are memory-mapped on every
later start. Writes go through a temporary file and a rename, so ranks building at the same
moment never see a half-written file; an unwritable cache falls back to building in memory.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import sys
import sysconfig
from dataclasses import dataclass

import torch

from meshspeed.comm.errors import ConfigError

FORMATS = ("text", "uint16", "uint32")
TOKEN_DTYPES = {"uint16": torch.uint16, "uint32": torch.uint32}
DEFAULT_MAX_MB = 8.0
DEFAULT_VAL_FRACTION = 0.02
STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})
_CACHE_VERSION = 1
_SEP = b"\0"


class DataError(ConfigError):
    """A data setting cannot work; the message names the setting, the value and what would."""


@dataclass(frozen=True)
class Corpus:
    """Train and validation token streams (1-D, uint8/uint16/uint32, possibly memory-mapped)."""

    train: torch.Tensor
    val: torch.Tensor
    vocab_size: int | None
    """256 for byte-tokenized text; None for token files (the model config decides)."""
    source: str
    train_files: tuple[str, ...] = ()
    val_files: tuple[str, ...] = ()
    cache_path: str | None = None
    """The cached train split's .bin file; None when not cached (token files, unwritable cache)."""

    def describe(self) -> str:
        files = f", {len(self.train_files)}+{len(self.val_files)} files" if self.train_files else ""
        return (
            f"{self.source}: {self.train.numel():,} train + {self.val.numel():,} validation tokens "
            f"({str(self.train.dtype).replace('torch.', '')}{files})"
        )


def default_cache_dir() -> str:
    root = os.environ.get("MESHSPEED_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "meshspeed"
    )
    return os.path.join(root, "corpus")


def load_corpus(
    path: str | None = "",
    format: str = "text",
    *,
    max_mb: float = DEFAULT_MAX_MB,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    cache_dir: str | None = None,
    use_cache: bool = True,
) -> Corpus:
    """The corpus for `data.path` / `data.format`. Empty path (or None, or "stdlib") = the
    standard library's sources capped at `max_mb` megabytes (10^6 bytes; 0 = no cap)."""
    if format not in FORMATS:
        raise DataError(f"data.format={format!r} is not a known format; choose one of {', '.join(FORMATS)}")
    if not 0 <= val_fraction < 1:
        raise DataError(f"val_fraction={val_fraction} must be in [0, 1), e.g. {DEFAULT_VAL_FRACTION}")
    if not max_mb >= 0:
        raise DataError(f"data.max_mb={max_mb} must be ≥ 0 (0 = no cap), e.g. {DEFAULT_MAX_MB}")
    cache = (cache_dir or default_cache_dir()) if use_cache else None
    if not path or path == "stdlib":
        if format != "text":
            raise DataError(
                f"data.format={format!r} needs data.path to name a token file; "
                "the built-in corpus (empty data.path) is text"
            )
        root, files = stdlib_files(max_mb)
        name = f"stdlib-py{sys.version_info.major}.{sys.version_info.minor}"
        return _text_corpus(root, files, name, f"python {sys.version.split()[0]} stdlib", val_fraction, cache)
    if not os.path.exists(path):
        raise DataError(
            f"data.path={path!r} does not exist; give a text file, a directory of text files, "
            "a token file with data.format uint16/uint32, or leave it empty for the built-in corpus"
        )
    if format in TOKEN_DTYPES:
        return token_file_corpus(path, format, val_fraction)
    if os.path.isfile(path) and path.endswith(".bin"):
        raise DataError(
            f"data.path={path!r} looks like a token file but data.format=text; "
            "set data.format uint16 or uint32 (or rename the file to read it as text)"
        )
    root, files = text_files(path)
    name = os.path.basename(os.path.normpath(os.path.abspath(path))) or "root"
    return _text_corpus(root, files, name, path, val_fraction, cache)


# --------------------------------------------------------------------------- file lists
def stdlib_files(max_mb: float = DEFAULT_MAX_MB) -> tuple[str, list[tuple[str, int, int, int]]]:
    """(stdlib root, [(relative path, size, mtime_ns, bytes to take)]) in sorted order, capped."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in STDLIB_SKIP_DIRS]
        files += [os.path.join(dirpath, n) for n in names if n.endswith(".py")]
    listed = _stat(root, files)
    if not listed:
        raise DataError(
            f"data.path is empty (built-in corpus) but this Python has no .py sources under {root}; "
            "set data.path to a text file or directory"
        )
    cap = int(max_mb * 1e6)
    if cap <= 0:
        return root, listed
    out, total = [], 0
    for rel, size, mtime, take in listed:
        take = min(take, cap - total)
        out.append((rel, size, mtime, take))
        total += take
        if total >= cap:
            break
    return root, out


def text_files(path: str) -> tuple[str, list[tuple[str, int, int, int]]]:
    """(root, files) for a text file or a directory walked recursively, hidden entries skipped."""
    path = os.path.abspath(path)
    if os.path.isfile(path):
        return os.path.dirname(path), _stat(os.path.dirname(path), [path])
    files = []
    for dirpath, dirs, names in os.walk(path):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        files += [os.path.join(dirpath, n) for n in names if not n.startswith(".")]
    listed = _stat(path, files)
    if not listed:
        raise DataError(f"data.path={path!r} contains no non-empty files; point it at text files")
    return path, listed


def _stat(root: str, paths: list[str]) -> list[tuple[str, int, int, int]]:
    out = []
    for p in paths:
        try:
            st = os.stat(p)
        except OSError:  # a dangling link
            continue
        if st.st_size and os.path.isfile(p):
            out.append(
                (os.path.relpath(p, root).replace(os.sep, "/"), st.st_size, st.st_mtime_ns, st.st_size)
            )
    return sorted(out)


def _path_hash(rel: str) -> float:
    """A stable number in [0, 1) per relative path (the same on every machine and Python)."""
    return int.from_bytes(hashlib.blake2b(rel.encode(), digest_size=8).digest(), "big") / 2.0**64


def split_files(files: list[tuple[str, int]], val_fraction: float) -> set[str]:
    """Validation files from [(relative path, bytes)]: in order of path hash, files go to
    validation until they hold ≥ val_fraction of the bytes (at least one file, never all)."""
    if val_fraction <= 0 or len(files) < 2:
        return set()
    total, val, got = sum(n for _, n in files), set(), 0
    for rel, n in sorted(files, key=lambda f: _path_hash(f[0]))[:-1]:
        if got >= val_fraction * total:
            break
        val.add(rel)
        got += n
    return val


# --------------------------------------------------------------------------- text → bytes, cached
def _text_corpus(root, files, name, source, val_fraction, cache_dir) -> Corpus:
    key = hashlib.sha256(
        json.dumps([_CACHE_VERSION, sys.version, root, val_fraction, files]).encode()
    ).hexdigest()
    base = os.path.join(cache_dir, f"{name}-{key[:20]}") if cache_dir else None
    if base is not None:
        hit = _read_cache(base, source)
        if hit is not None:
            return hit
        try:
            os.makedirs(cache_dir, exist_ok=True)
            tmp = f".{os.getpid()}.tmp"
            with open(base + ".train.bin" + tmp, "wb") as ftr, open(base + ".val.bin" + tmp, "wb") as fva:
                meta = _encode(root, files, val_fraction, ftr, fva)
            for split in ("train", "val"):
                os.replace(f"{base}.{split}.bin{tmp}", f"{base}.{split}.bin")
            with open(base + ".json" + tmp, "w") as f:
                json.dump(meta, f)
            os.replace(base + ".json" + tmp, base + ".json")  # last: its presence marks a complete entry
        except OSError:
            base = None  # unwritable cache: build in memory below
        else:
            hit = _read_cache(base, source)
            if hit is not None:
                return hit
    ftr, fva = io.BytesIO(), io.BytesIO()
    meta = _encode(root, files, val_fraction, ftr, fva)
    return Corpus(
        _bytes_tensor(ftr.getvalue()),
        _bytes_tensor(fva.getvalue()),
        256,
        source,
        tuple(meta["train_files"]),
        tuple(meta["val_files"]),
    )


def _encode(root, files, val_fraction, ftr, fva) -> dict:
    """Write each file's bytes + separator to the train or validation stream; returns the metadata."""
    val = split_files([(f[0], f[3]) for f in files], val_fraction)
    meta = {"train_files": [], "val_files": [], "skipped_binary": [], "train_tokens": 0, "val_tokens": 0}
    for rel, _size, _mtime, take in files:
        with open(os.path.join(root, rel), "rb") as f:
            data = f.read(take)
        if _SEP in data:
            meta["skipped_binary"].append(rel)
            continue
        if len(files) == 1 and val_fraction > 0:  # a lone file: its tail is the validation split
            n_val = max(1, math.ceil(len(data) * val_fraction))
            parts = [(ftr, "train", data[:-n_val]), (fva, "val", data[-n_val:])]
        else:
            parts = [(fva, "val", data) if rel in val else (ftr, "train", data)]
        for out, split, chunk in parts:
            out.write(chunk + _SEP)
            meta[f"{split}_files"].append(rel)
            meta[f"{split}_tokens"] += len(chunk) + 1
    return meta


def _read_cache(base: str, source: str) -> Corpus | None:
    try:
        with open(base + ".json") as f:
            meta = json.load(f)
        splits = {}
        for split in ("train", "val"):
            n, p = meta[f"{split}_tokens"], f"{base}.{split}.bin"
            if os.path.getsize(p) != n:
                return None
            splits[split] = (
                torch.from_file(p, shared=False, size=n, dtype=torch.uint8)
                if n
                else torch.empty(0, dtype=torch.uint8)
            )
    except (OSError, ValueError, KeyError):
        return None
    return Corpus(
        splits["train"],
        splits["val"],
        256,
        source,
        tuple(meta["train_files"]),
        tuple(meta["val_files"]),
        base + ".train.bin",
    )


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


# --------------------------------------------------------------------------- token files
def token_file_corpus(path: str, format: str, val_fraction: float = DEFAULT_VAL_FRACTION) -> Corpus:
    """Memory-map a flat uint16/uint32 token file; its last val_fraction of tokens validate."""
    dtype = TOKEN_DTYPES[format]
    if not os.path.isfile(path):
        raise DataError(
            f"data.path={path!r} is a directory, but data.format={format} needs one token file; "
            "use data.format text to read a directory of text files"
        )
    itemsize = torch.empty(0, dtype=dtype).element_size()
    size = os.path.getsize(path)
    if size == 0 or size % itemsize:
        raise DataError(
            f"data.path={path!r} has {size} bytes, not a whole, non-zero number of {format} tokens "
            f"({itemsize} bytes each); check data.format (text, uint16 or uint32)"
        )
    n = size // itemsize
    tokens = torch.from_file(path, shared=False, size=n, dtype=dtype)
    # `meshspeed data prepare` wrote whole documents last for validation and says how many tokens
    side = read_sidecar(path)
    n_val = ((side or {}).get("validation") or {}).get("tokens") or 0
    if not 0 < n_val < n or (side or {}).get("count") != n:
        n_val = min(n - 1, math.ceil(n * val_fraction)) if val_fraction > 0 else 0
    return Corpus(tokens[: n - n_val], tokens[n - n_val :], None, path)


# The sidecar's keys, each with its type and what is valid ("tokenizer_sha256" is None for bytes).
_SIDECAR = {
    "tokenizer": (str, "a tokenizer spec"),
    "format": (str, f"one of {', '.join(TOKEN_DTYPES)}"),
    "count": (int, "a token count ≥ 0"),
    "max_id": (int, "a token id ≥ 0"),
    "vocab_size": (int, "a vocabulary size ≥ 1"),
}
_SIDECAR_OPTIONAL = {
    "tokenizer_sha256": ((str, type(None)), "64 hex digits or null"),
    "bytes": (int, "the token file's size in bytes"),
    "sha256": (str, "the token file's SHA-256, 64 hex digits"),
    "validation": (dict, 'an object with "tokens" ≥ 0'),
}


def read_sidecar(path: str) -> dict | None:
    """The JSON `meshspeed data prepare` wrote beside token file `path` (None when there is
    none), every key checked for its type and range: a sidecar is read, not believed. A wrong
    one is one DataError line naming the file, the key, the value and what is valid."""
    side_path = path + ".json"
    try:
        with open(side_path) as f:
            side = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as e:
        raise DataError(
            f"data.path={path!r}: its sidecar {side_path} is unreadable ({type(e).__name__}); re-run "
            "`meshspeed data prepare` or remove the sidecar"
        ) from None
    if not isinstance(side, dict):
        raise DataError(
            f"data.path={path!r}: its sidecar {side_path} holds a JSON {type(side).__name__}, not an object; "
            "re-run `meshspeed data prepare` or remove the sidecar"
        )
    for key, (kind, valid) in {**_SIDECAR, **_SIDECAR_OPTIONAL}.items():
        if key not in side and key in _SIDECAR_OPTIONAL:
            continue
        v = side.get(key)
        ok = isinstance(v, kind) and not isinstance(v, bool)
        if ok and isinstance(v, int):
            ok = v >= (1 if key == "vocab_size" else 0)
        if ok and key == "format":
            ok = v in TOKEN_DTYPES
        if ok and key in ("sha256", "tokenizer_sha256") and v is not None:
            ok = len(v) == 64 and all(c in "0123456789abcdef" for c in v)
        if ok and key == "validation":
            t = v.get("tokens", 0)
            ok = isinstance(t, int) and not isinstance(t, bool) and t >= 0
        if not ok:
            raise DataError(
                f"data.path={path!r}: its sidecar {side_path} has {key}={v!r}; expected {valid} "
                "(re-run `meshspeed data prepare`, or remove the sidecar)"
            )
    return side
