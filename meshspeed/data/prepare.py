"""`meshspeed data prepare`: text → a flat token file the trainer memory-maps (`data.format`
uint16/uint32), plus a JSON sidecar saying how it was made.

**Inputs** (`--input`, repeatable): text files, directories (walked as the trainer walks a text
corpus: non-hidden files, sorted; files holding a NUL byte are binary and skipped) and JSON-lines
files (`.jsonl` / `.ndjson`: one document per record, its text under `--text-key`). No input:
the Python standard library's `.py` sources capped at `max_mb`, the trainer's built-in corpus.

**Tokens** come from `data.tokenizer`'s tokenizer: the byte tokenizer (token = byte, NUL after
each document: exactly the trainer's text corpus) or a Hugging Face tokenizer (each document
encoded, its end-of-document token after it, as the trainer's `retokenize` does). The width is
uint16 when the vocabulary fits (≤ 65,536 ids), else uint32; an explicit `--format` too narrow
for the vocabulary is refused.

**Workers** tokenize units (a text file, or a ~16 MB line-aligned slice of a JSON-lines file) in
parallel; results are written in input order, so the bytes do not depend on the worker count.

**Validation split**, as Megatron's `--split`: whole documents, never a cut through one. The
files the trainer's text corpus would hold out (corpus.split_files: a fixed shuffle by path hash)
are written last, and the last ⌈val_fraction × documents⌉ documents of the file validate
(at least one, never all; a single document cannot be split and leaves the trainer's token tail
rule in force). The sidecar records it (`validation.tokens`) and the trainer's loader uses it.

Tokens are little-endian. Output goes to a temporary name and is renamed when complete, the
sidecar (`<out>.json`) last.
"""

from __future__ import annotations

import hashlib
import json
import math
import multiprocessing
import os
import sys
from array import array

from meshspeed.comm import outputs
from meshspeed.comm.errors import ConfigError
from meshspeed.data.corpus import (
    DEFAULT_MAX_MB,
    DEFAULT_VAL_FRACTION,
    DataError,
    read_sidecar,
    split_files,
    stdlib_files,
)
from meshspeed.data.corpus import text_files as _text_files
from meshspeed.data.loader import remember_scan
from meshspeed.data.tokenizer import ByteTokenizer, load_tokenizer, tokenizer_digest

FORMATS = {"uint16": 2, "uint32": 4}  # bytes per token
ARRAY_CODES = {2: "H", 4: "I"}  # array typecodes of those widths
JSONL_SUFFIXES = (".jsonl", ".ndjson")
UNIT_BYTES = 16 * 2**20  # a JSON-lines file is tokenized in slices of about this size
_TOK = None  # this process's tokenizer (set once per worker by _init_worker)


def sidecar_path(out: str) -> str:
    return out + ".json"


def _number(flag: str, value, hint: str) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        x = float("nan")
    if not 0 <= x < math.inf:  # also NaN
        raise DataError(f"{flag}={value!r} is not a number ≥ 0; {hint}")
    return x


def _cap(files: list[tuple[str, int, int, int]], max_mb: float) -> list[tuple[str, int, int, int]]:
    """The first files up to max_mb (10^6 bytes), the last one cut to fit (as corpus.stdlib_files)."""
    cap = int(max_mb * 1e6)
    if cap <= 0:
        return files
    out, total = [], 0
    for rel, size, mtime, take in files:
        take = min(take, cap - total)
        out.append((rel, size, mtime, take))
        total += take
        if total >= cap:
            break
    return out


def _units(inputs: list[str], max_mb, out: str) -> tuple[list[tuple[str, str, int]], str]:
    """[(name, path, bytes to take)] of the files to read, in input order, and a description."""
    hint = f"give megabytes of text to read, e.g. {DEFAULT_MAX_MB:g} (0 = no cap)"
    if not inputs:
        cap = DEFAULT_MAX_MB if max_mb is None else _number("--max-mb", max_mb, hint)
        root, files = stdlib_files(cap)
        listed, source = [(rel, os.path.join(root, rel), take) for rel, _s, _m, take in files], None
    else:
        cap = 0.0 if max_mb is None else _number("--max-mb", max_mb, hint)
        skip = {os.path.abspath(out), os.path.abspath(sidecar_path(out))}  # never read our own output
        listed = []
        for i, inp in enumerate(inputs):
            if not os.path.exists(inp):
                raise DataError(
                    f"--input={inp!r} does not exist; give text files, directories or .jsonl files, "
                    "or leave --input out for the Python standard library's sources"
                )
            try:
                root, files = _text_files(inp)
            except DataError:
                raise DataError(f"--input={inp!r} holds no non-empty files; point it at text files") from None
            files = [f for f in files if os.path.abspath(os.path.join(root, f[0])) not in skip]
            if not files:
                raise DataError(f"--input={inp!r} holds nothing but --out's own files; point it at text")
            prefix = f"{i}:" if len(inputs) > 1 else ""  # one input: the trainer's names, its split
            listed += [
                (prefix + rel, os.path.join(root, rel), take) for rel, _s, _m, take in _cap(files, cap)
            ]
        source = ", ".join(inputs)
    return listed, source or "the Python standard library's sources"


def _slices(name: str, path: str, take: int) -> list[tuple]:
    """A file as work units: whole for text, line-aligned slices of ~UNIT_BYTES for JSON lines."""
    if not path.endswith(JSONL_SUFFIXES):
        return [(name, path, 0, take, False)]
    out, start = [], 0
    with open(path, "rb") as f:
        while start < take:
            f.seek(min(start + UNIT_BYTES, take))
            if f.tell() < take:
                f.readline()  # finish the line the slice boundary fell in
            end = min(f.tell(), take)
            out.append((name, path, start, end, True))
            start = end
    return out


def _init_worker(spec: str) -> None:
    global _TOK
    _TOK = load_tokenizer(spec)


def _encode_docs(docs: list[bytes], itemsize: int) -> tuple[bytes, list[int], int]:
    """Documents → (little-endian uintN tokens with an end-of-document token after each, token
    count per document, the largest id)."""
    tok, ids, lengths = _TOK, array(ARRAY_CODES[itemsize]), []
    if isinstance(tok, ByteTokenizer):
        for d in docs:
            ids.frombytes(bytes(len(d) * itemsize))  # placeholder zeros, bytes written below
            lengths.append(len(d) + 1)
            ids.append(tok.eot)
        raw = bytearray(ids.tobytes())
        pos = 0
        for d, n in zip(docs, lengths):  # a byte token is its byte followed by N-1 zero bytes
            raw[pos : pos + len(d) * itemsize : itemsize] = d
            pos += n * itemsize
        top = max((max(d) for d in docs if d), default=0)
        return bytes(raw), lengths, max(top, tok.eot)
    encoded = tok.encode_batch([d.decode("utf-8", errors="replace") for d in docs])
    for e in encoded:
        ids.extend(e)
        if tok.eot is not None:
            ids.append(tok.eot)
        lengths.append(len(e) + (tok.eot is not None))
    top = max(ids) if ids else 0
    if sys.byteorder == "big":  # pragma: no cover
        ids.byteswap()
    return ids.tobytes(), lengths, top


def _tokenize(unit: tuple, itemsize: int, text_key: str) -> tuple[bytes, list[int], int, bool, int]:
    """One work unit → (tokens, per-document lengths, largest id, skipped as binary, bytes read)."""
    name, path, start, end, is_jsonl = unit
    try:
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read(end - start)
    except OSError as e:
        raise DataError(
            f"--input: cannot read {path} ({e.strerror or e}); give readable text files"
        ) from None
    if not is_jsonl:
        if b"\0" in data:  # binary (or a token file): the trainer's text reader skips these too
            return b"", [], 0, True, len(data)
        return (*_encode_docs([data], itemsize), False, len(data))
    docs = []
    for k, line in enumerate(data.splitlines()):
        if not line.strip():
            continue
        try:
            text = json.loads(line)[text_key]
            if not isinstance(text, str):
                raise TypeError
        except (ValueError, KeyError, TypeError, IndexError, RecursionError):  # deep nesting too
            at = f"{path} (line {k + 1} of the slice starting at byte {start})"
            raise DataError(
                f"--text-key={text_key!r}: a record of {at} is not a JSON object with a string "
                f"{text_key!r}; name the key holding the text with --text-key"
            ) from None
        docs.append(text.encode("utf-8"))
    if not docs:
        return b"", [], 0, False, len(data)
    return (*_encode_docs(docs, itemsize), False, len(data))


def _work(args):
    return _tokenize(*args)


def _format(format: str, tok) -> str:
    if format == "auto":
        return "uint16" if tok.vocab_size <= 256**2 else "uint32"
    if format not in FORMATS:
        raise DataError(
            f"--format={format!r} is not a token file format; use auto (uint16 when the vocabulary "
            "fits, else uint32), uint16 or uint32"
        )
    if tok.vocab_size > 256 ** FORMATS[format]:
        raise DataError(
            f"--format={format} holds token ids below {256 ** FORMATS[format]:,} but --tokenizer has "
            f"{tok.vocab_size:,}; use --format uint32 (or auto)"
        )
    return format


def prepare_tokens(
    out: str,
    format: str = "auto",
    input: str | list[str] | None = None,
    max_mb: float | str | None = None,
    tokenizer: str = "bytes",
    *,
    text_key: str = "text",
    workers: int | None = None,
    val_fraction: float | str = DEFAULT_VAL_FRACTION,
    progress=None,
    overwrite: bool = False,
) -> dict:
    """Tokenize `input` (a path, a list of paths, or empty for the built-in corpus) into token file
    `out` and its sidecar; returns the sidecar's content. `format` 'auto' picks uint16 when the
    vocabulary fits. `max_mb` caps the text read per input (None: 8 MB for the built-in corpus,
    no cap for inputs; 0 = no cap). `workers` None = min(cpu count, work units). `progress`, if
    given, is called as progress(bytes read, bytes total, tokens written) after each unit. Bad
    values raise DataError naming the flag. The file and its sidecar are written under
    temporary names and renamed into place when complete; an existing `out` that `meshspeed data
    prepare` did not write (no sidecar describing it) is replaced only with `overwrite`."""
    inputs = [input] if isinstance(input, str) else list(input or [])
    inputs = [i for i in inputs if i and i != "stdlib"]
    if not out:
        raise DataError("--out is missing; name the token file to write, e.g. --out data/tokens.bin")
    if os.path.isdir(out) or out.endswith(("/", os.sep)):
        raise DataError(f"--out={out!r} must name a file to write, e.g. data/tokens.bin")
    _check_out(out, overwrite)
    vf = _number(
        "--val-fraction", val_fraction, f"give a fraction of documents in [0, 1), e.g. {DEFAULT_VAL_FRACTION}"
    )
    if vf >= 1:
        raise DataError(f"--val-fraction={val_fraction!r} must be < 1; e.g. {DEFAULT_VAL_FRACTION}")
    if workers is not None and (not isinstance(workers, int) or workers < 1):
        raise DataError(f"--workers={workers!r} must be a positive integer, e.g. {os.cpu_count() or 1}")
    try:
        tok = load_tokenizer(tokenizer)
    except ConfigError as e:  # its messages name the config key; this command's flag is --tokenizer
        raise DataError(str(e).replace("data.tokenizer=", "--tokenizer=", 1)) from None
    format = _format(format, tok)
    itemsize = FORMATS[format]
    files, source = _units(inputs, max_mb, out)
    val = split_files([(name, take) for name, _p, take in files], vf)
    ordered = [f for f in files if f[0] not in val] + [f for f in files if f[0] in val]
    units = [u for name, path, take in ordered for u in _slices(name, path, take)]
    total = sum(u[3] - u[2] for u in units)
    n_workers = min(workers or os.cpu_count() or 1, len(units))

    lengths, top, done, used, skipped, count = array("Q"), 0, 0, set(), set(), 0
    digest = hashlib.sha256()
    jobs = [(u, itemsize, text_key) for u in units]
    tmp, side_tmp = None, None
    try:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        for target in (out, sidecar_path(out)):
            outputs.clean_orphans(target)
        tmp, side_tmp = outputs.sibling(out), outputs.sibling(sidecar_path(out))
        with open(tmp, "wb") as f:
            if n_workers > 1:
                # fork where there is one (no re-import of torch per worker); the parent has not
                # encoded anything, so the tokenizers library's thread pool is not forked mid-use
                methods = multiprocessing.get_all_start_methods()
                ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
                pool = ctx.Pool(n_workers, initializer=_init_worker, initargs=(tokenizer,))
                results = pool.imap(_work, jobs, chunksize=1)  # in input order, whatever finishes first
            else:
                _init_worker(tokenizer)
                pool, results = None, map(_work, jobs)
            try:
                for (name, *_), (buf, docs, hi, binary, nbytes) in zip(units, results):
                    f.write(buf)
                    digest.update(buf)
                    lengths.extend(docs)
                    count += len(buf) // itemsize
                    top, done = max(top, hi), done + nbytes
                    (skipped if binary else used).add(name)
                    if progress is not None:
                        progress(done, total, count)
            finally:
                if pool is not None:
                    pool.terminate()
            f.flush()
            os.fsync(f.fileno())
        if count == 0:
            raise DataError(
                f"--input={' '.join(inputs) or 'stdlib'!r}: no text found (files hold NUL bytes, i.e. binary "
                "or already tokenized, or JSON lines hold no records); point it at text files"
            )
        n_val = min(len(lengths) - 1, math.ceil(len(lengths) * vf)) if vf > 0 else 0
        meta = {
            "tokenizer": getattr(tok, "path", "bytes"),
            "tokenizer_sha256": tokenizer_digest(tok),
            "vocab_size": tok.vocab_size,
            "eot": tok.eot,
            "format": format,
            "count": count,
            "documents": len(lengths),
            "max_id": top,
            "bytes": count * itemsize,
            "sha256": digest.hexdigest(),
            "validation": {
                "fraction": vf,
                "documents": n_val,
                "tokens": int(sum(lengths[len(lengths) - n_val :])) if n_val else 0,
            },
            "source": source,
            "files": len(used),
            "validation_files": len(val & used),
            "skipped_binary": len(skipped),
        }
        with open(side_tmp, "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        # Tokens first, sidecar last: between the two renames the old sidecar describes the new
        # file wrongly (size, digest), which training refuses, so no mix is ever trained on.
        outputs.commit_file(tmp, out)
        outputs.commit_file(side_tmp, sidecar_path(out))
        remember_scan(out, format, top, meta["sha256"])  # training's first check need not scan
    except outputs.OutputError as e:
        raise DataError(str(e)) from None
    except OSError as e:
        full = outputs.disk_error(e, out)
        raise DataError(
            str(full) if full else f"--out={out!r} cannot be written ({e.strerror or e}); choose a "
            "writable path, e.g. data/tokens.bin"
        ) from None
    finally:
        for t in (tmp, side_tmp):
            if t and os.path.exists(t):
                os.remove(t)
    return meta


def _check_out(out: str, overwrite: bool) -> None:
    """Refuse to replace a file `data prepare` did not write: one whose sidecar (strictly read)
    does not describe it by size. With `overwrite` the user asked for it."""
    if overwrite or not (os.path.lexists(out) or os.path.lexists(sidecar_path(out))):
        return
    why = None
    try:
        side = read_sidecar(out)
        if side is None:
            why = f"it has no sidecar {sidecar_path(out)}"
        elif not os.path.isfile(out) or os.path.getsize(out) != side["count"] * FORMATS[side["format"]]:
            why = f"its sidecar {sidecar_path(out)} does not describe it"
    except DataError as e:
        why = str(e).split(": ", 1)[-1]
    if why:
        raise DataError(
            f"--out={out!r} exists and was not written by `meshspeed data prepare` ({why}); add "
            "--overwrite to replace it, or choose another --out"
        )
