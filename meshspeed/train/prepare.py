"""`meshspeed data prepare`: text → a flat token file the trainer memory-maps (`data.format`
uint16/uint32), plus a JSON sidecar saying how it was made.

The text is read exactly as the trainer reads a text corpus (corpus.py): by default the Python
standard library's `.py` sources capped at `max_mb`, else every non-hidden file under `input`;
files holding a NUL byte are binary and skipped.
Tokens come from the tokenizer `data.tokenizer` names: the byte tokenizer (token = byte,
vocabulary 256, NUL after each file: exactly the trainer's text corpus) by default, or a Hugging
Face tokenizer (each file encoded as one document, its end-of-document token after it, as the
trainer's `retokenize` does).

File order: the files the text corpus would put in validation (corpus.split_files, a fixed
shuffle by path hash) are written last. The trainer validates on a token file's last
`DEFAULT_VAL_FRACTION` of tokens, so its validation tokens come from validation files only.

Tokens are little-endian (what `torch.from_file` reads on every machine meshspeed runs on).
Output goes to a temporary name and is renamed when complete, the sidecar
(`<out>.json`: tokenizer, vocab_size, eot, format, count, ...) last.
"""

from __future__ import annotations

import json
import math
import os
import sys
from array import array

from meshspeed.comm.errors import ConfigError
from meshspeed.train.corpus import (
    DEFAULT_MAX_MB,
    DEFAULT_VAL_FRACTION,
    DataError,
    split_files,
    stdlib_files,
    text_files,
)
from meshspeed.train.tokenizer import ByteTokenizer, load_tokenizer

FORMATS = {"uint16": 2, "uint32": 4}  # bytes per token
ARRAY_CODES = {2: "H", 4: "I"}  # array typecodes of those widths


def sidecar_path(out: str) -> str:
    return out + ".json"


def _number(flag: str, value) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        x = float("nan")
    if not 0 <= x < math.inf:  # also NaN
        raise DataError(
            f"{flag}={value!r} is not a number ≥ 0; give megabytes of text to read, e.g. "
            f"{DEFAULT_MAX_MB:g} (0 = no cap)"
        )
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


def _sources(input: str, max_mb, out: str) -> tuple[str, list, str]:
    """(root, [(relative path, size, mtime, bytes to take)], description) of the text to tokenize."""
    if not input or input == "stdlib":
        cap = DEFAULT_MAX_MB if max_mb is None else _number("--max-mb", max_mb)
        root, files = stdlib_files(cap)
        return root, files, "the Python standard library's sources"
    cap = 0.0 if max_mb is None else _number("--max-mb", max_mb)
    if not os.path.exists(input):
        raise DataError(
            f"--input={input!r} does not exist; give a text file or a directory of text files, "
            "or leave --input out for the Python standard library's sources"
        )
    try:
        root, files = text_files(input)
    except DataError:
        raise DataError(f"--input={input!r} holds no non-empty files; point it at text files") from None
    # never read our own output (a re-run with --input data --out data/tokens.bin)
    skip = {os.path.abspath(out), os.path.abspath(sidecar_path(out))}
    files = [f for f in files if os.path.abspath(os.path.join(root, f[0])) not in skip]
    if not files:
        raise DataError(f"--input={input!r} holds nothing but --out's own files; point it at text files")
    return root, _cap(files, cap), input


def _read(root: str, rel: str, take: int, input: str) -> bytes:
    try:
        with open(os.path.join(root, rel), "rb") as src:
            return src.read(take)
    except OSError as e:  # not --out's fault: name the input file
        raise DataError(
            f"--input={input or 'stdlib'!r}: cannot read {rel} ({e.strerror or e}); "
            "point --input at readable text files"
        ) from None


def _tokenizer(spec: str):
    try:
        return load_tokenizer(spec)
    except ConfigError as e:  # its messages name the config key; this command's flag is --tokenizer
        raise DataError(str(e).replace("data.tokenizer=", "--tokenizer=", 1)) from None


def _encode(data: bytes, tok, itemsize: int) -> bytes:
    """One document's tokens, then the end-of-document token, as little-endian uintN bytes."""
    if isinstance(tok, ByteTokenizer):
        data += bytes([tok.eot])
        buf = bytearray(len(data) * itemsize)  # a byte token is its byte followed by N-1 zero bytes
        buf[0::itemsize] = data
        return bytes(buf)
    ids = array(ARRAY_CODES[itemsize], tok.encode(data.decode("utf-8", errors="replace")))
    if tok.eot is not None:
        ids.append(tok.eot)
    if sys.byteorder == "big":  # pragma: no cover
        ids.byteswap()
    return ids.tobytes()


def prepare_tokens(
    out: str,
    format: str = "uint32",
    input: str = "",
    max_mb: float | str | None = None,
    tokenizer: str = "bytes",
) -> dict:
    """Tokenize `input` (empty: the built-in corpus) into token file `out` and its sidecar.
    `max_mb` caps the text read (None: 8 MB for the built-in corpus, no cap for `input`; 0 = no
    cap). `tokenizer` is what `data.tokenizer` takes: 'bytes' or a Hugging Face tokenizer
    directory / tokenizer.json. Returns the sidecar's content. Bad values raise DataError naming
    the flag."""
    if format not in FORMATS:
        raise DataError(
            f"--format={format!r} is not a token file format; use uint32 (or uint16: 2 bytes per "
            "token, for vocabularies under 65,536)"
        )
    if not out:
        raise DataError("--out is missing; name the token file to write, e.g. --out data/tokens.bin")
    if os.path.isdir(out) or out.endswith(("/", os.sep)):
        raise DataError(f"--out={out!r} must name a file to write, e.g. data/tokens.bin")
    tok, itemsize = _tokenizer(tokenizer), FORMATS[format]
    if tok.vocab_size > 256**itemsize:
        raise DataError(
            f"--format={format} holds token ids below {256**itemsize:,} but --tokenizer has "
            f"{tok.vocab_size:,}; use --format uint32"
        )
    root, files, source = _sources(input, max_mb, out)

    val = split_files([(f[0], f[3]) for f in files], DEFAULT_VAL_FRACTION)
    ordered = [f for f in files if f[0] not in val] + [f for f in files if f[0] in val]
    count, used, skipped = 0, 0, []
    tmp = f"{out}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(tmp, "wb") as f:
            for rel, _size, _mtime, take in ordered:
                data = _read(root, rel, take, input)
                if b"\0" in data:  # binary (or a token file): the trainer's text reader skips these too
                    skipped.append(rel)
                    continue
                buf = _encode(data, tok, itemsize)
                f.write(buf)
                count += len(buf) // itemsize
                used += 1
        if count == 0:
            what = "the file holds" if len(files) == 1 else f"all {len(files)} files hold"
            raise DataError(
                f"--input={input!r}: {what} NUL bytes (binary or already tokenized); point it at text files"
            )
        meta = {
            "tokenizer": getattr(tok, "path", "bytes"),
            "vocab_size": tok.vocab_size,
            "eot": tok.eot,
            "format": format,
            "count": count,
            "source": source,
            "files": used,
            "validation_files": len(val - set(skipped)),
            "skipped_binary": len(skipped),
        }
        os.replace(tmp, out)
        with open(sidecar_path(out) + ".tmp", "w") as f:
            json.dump(meta, f, indent=1)
        os.replace(sidecar_path(out) + ".tmp", sidecar_path(out))
    except OSError as e:
        raise DataError(
            f"--out={out!r} cannot be written ({e.strerror or e}); choose a writable path, "
            "e.g. data/tokens.bin"
        ) from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return meta
