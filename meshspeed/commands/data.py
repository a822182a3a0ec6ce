"""`meshspeed data prepare`: tokenize text into a token file for `--data.format uint16/uint32`."""

from __future__ import annotations

import argparse
import sys

# corpus.DEFAULT_VAL_FRACTION, written out: importing it (and torch) would slow every --help
DEFAULT_VAL_FRACTION = 0.02

DESCRIPTION = """\
Tokenize text into a flat little-endian token file that `meshspeed train` memory-maps
(--data.path FILE --data.format uint16|uint32), and write FILE.json beside it (tokenizer,
vocab_size, eot, format, documents, count, largest id, validation split), which training reads to
check its settings. Inputs are text files, directories of them (non-hidden files; binary ones,
holding a NUL byte, skipped) and JSON-lines files (.jsonl/.ndjson, one document per record).
Each document is followed by the tokenizer's end-of-document token (NUL for the byte tokenizer);
for the same text and --data.tokenizer the tokens equal what the trainer makes of it. Worker
processes tokenize in parallel; the file is the same byte for byte whatever --workers is."""

EXAMPLES = """examples:
  meshspeed data prepare --out data/tokens.bin                  # the stdlib sources, 8 MB, uint16
  meshspeed data prepare --out data/mine.bin --input ~/texts/ --input ~/more.jsonl --workers 8
  meshspeed data prepare --out data/tokens.bin --input ~/corpus/ --tokenizer ~/Meta-Llama-3-8B/   # uint32
  torchrun --nproc-per-node 8 -m meshspeed train --config configs/llama3-8b.toml \\
      --data.tokenizer ~/Meta-Llama-3-8B/                          # reads data/tokens.bin

images (--images): a diffusion run's images and labels, a vlm run's captions (docs/vlm.md):
  meshspeed data prepare --images digits --out data/digits.safetensors
  meshspeed data prepare --images data/shapes --out data/shapes.safetensors   # DIR/captions.jsonl

post-training records (--kind; not --format, which already names the token width):
  meshspeed data prepare --kind arith --out data/arith --count 4000 --seed 0   # synthetic task's JSON lines
  meshspeed data prepare --kind chat --input data/arith/sft.train.jsonl --seq-len 64 \\
      --out data/sft.safetensors
  meshspeed data prepare --kind pairs --input data/arith/pairs.train.jsonl --seq-len 64 \\
      --out data/pairs.safetensors --tokenizer ~/Qwen2.5-0.5B-Instruct/   # its chat template

  chat: JSON lines of {"messages": [{"role", "content"}...]} or {"prompt", "completion"}; pairs:
  {"prompt", "chosen", "rejected"} (TRL's formats; strings or message lists). Rendered through the
  tokenizer's chat template (the byte tokenizer's built-in one: <|user|>\\n..\\n<|assistant|>\\n..NUL,
  end-of-turn = byte 0); labels only on assistant tokens; rows of --seq-len (longer ones keep
  their start, as TRL); the last --val-fraction of records held out. Written as int64 tensors in
  one safetensors file (meshspeed.data.record_file.load_records reads it).
  arith: "What is 17+25?" -> "42" (rejected: a near miss), deterministic from --seed; writes
  sft.{train,val}.jsonl and pairs.{train,val}.jsonl, held out by question (--val-fraction, default 0.1).
"""

PROGRESS_MIN_BYTES = 32 * 2**20  # inputs at least this large get a progress line on stderr


def register(sub) -> None:
    parser = sub.add_parser("data", help="prepare training data (token files)")
    actions = parser.add_subparsers(dest="data_command", metavar="ACTION")
    p = actions.add_parser(
        "prepare",
        help="tokenize text into a uint16/uint32 token file + JSON sidecar",
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # Values are checked by meshspeed.data.prepare, so a bad one is one line naming the flag.
    p.add_argument(
        "--out",
        default="",
        metavar="PATH",
        help="required: the token file to write (e.g. data/tokens.bin); its sidecar is PATH.json",
    )
    p.add_argument(
        "--format",
        default="auto",
        metavar="{auto,uint16,uint32}",
        help="token width (default auto: uint16 when the tokenizer's vocabulary fits in 65,536 ids, "
        "else uint32); a width too narrow for the vocabulary is refused",
    )
    p.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="PATH",
        help="a text file, a directory of text files, or a JSON-lines file (.jsonl/.ndjson); repeat "
        "for several (default: the Python standard library's .py sources, the trainer's default corpus)",
    )
    p.add_argument(
        "--images",
        default="",
        metavar="SOURCE",
        help="prepare images instead of text: 'digits' (scikit-learn's 8×8 digits), a directory of "
        "class folders (DIR/<label>/*.png|jpg) or with captions.jsonl, or an .npz with 'images' "
        "(and 'labels'); writes [-1, 1] float32 images, labels (and captions) and a fixed held-out "
        "split to --out (safetensors), which --data.path reads: a diffusion run's images and labels, "
        "a vlm run's captions (class labels captioned with their names)",
    )
    p.add_argument(
        "--kind",
        default="tokens",
        metavar="{tokens,chat,pairs,arith}",
        help="what to prepare: tokens (default: a token file for pretraining), chat (conversations -> "
        "SFT records), pairs (preference pairs -> DPO records), arith (the synthetic arithmetic task's "
        "JSON lines, into the directory --out); see below",
    )
    p.add_argument("--seq-len", default=None, metavar="N", help="chat/pairs: the length of each record row")
    p.add_argument(
        "--packing",
        action="store_true",
        help="chat: pack several conversations into each row (doc_ids keep their attention apart)",
    )
    p.add_argument("--count", default="4000", metavar="N", help="arith: distinct questions (default 4000)")
    p.add_argument(
        "--seed", default="0", metavar="N", help="arith: the seed that fixes the files (default 0)"
    )
    p.add_argument(
        "--text-key",
        default="text",
        metavar="KEY",
        help="the field of each JSON-lines record that holds its text (default: text)",
    )
    p.add_argument(
        "--tokenizer",
        default="bytes",
        metavar="SPEC",
        help="what --data.tokenizer takes: "
        "'bytes' (default: token = byte, vocabulary 256) or a Hugging Face tokenizer directory "
        "or its tokenizer.json",
    )
    p.add_argument(
        "--max-mb",
        default=None,
        metavar="N",
        help="read at most N MB (10^6 bytes) of text per input; "
        "0 = no cap (default: 8 for the standard library, as the trainer; no cap for --input)",
    )
    p.add_argument(
        "--val-fraction",
        default=DEFAULT_VAL_FRACTION,
        metavar="F",
        help=f"fraction of documents (whole documents, the last ones of the file) that training "
        f"validates on (default {DEFAULT_VAL_FRACTION}; 0 = training uses the file's last "
        f"{DEFAULT_VAL_FRACTION} of tokens); chat/pairs: the last records; arith: questions, default 0.1",
    )
    p.add_argument(
        "--workers",
        default=None,
        metavar="N",
        help="processes tokenizing in parallel (default: min(CPU count, files and JSON-lines slices))",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace --out even when `meshspeed data prepare` did not write it (without this, a "
        "file there without its sidecar is refused)",
    )
    p.set_defaults(func=run_prepare)
    parser.set_defaults(func=lambda args: (parser.print_help(), 0)[1])


class _Progress:
    """`\r`-updated line on stderr for large inputs, rewritten at most once per percent."""

    def __init__(self):
        self.shown = -1

    def __call__(self, done: int, total: int, tokens: int) -> None:
        pct = 100 * done // max(total, 1)
        if total < PROGRESS_MIN_BYTES or pct == self.shown:
            return
        self.shown = pct
        line = f"\r{pct:3d}%  {done / 2**20:,.0f}/{total / 2**20:,.0f} MiB read, {tokens:,} tokens"
        print(line, end="\n" if done >= total else "", file=sys.stderr, flush=True)


def run_prepare_images(args) -> int:
    from meshspeed.data.images import VAL_FRACTION, prepare_images
    from meshspeed.data.prepare import DataError

    try:
        if args.input:  # text and images are different files; one command writes one
            raise DataError("--images and --input cannot be combined; prepare text and images separately")
        val = VAL_FRACTION if args.val_fraction == DEFAULT_VAL_FRACTION else args.val_fraction
        try:
            val = float(val)
            if not 0 <= val < 1:  # also NaN
                raise ValueError
        except ValueError:
            raise DataError(f"--val-fraction={val!r} must be a number in [0, 1), e.g. 0.1") from None
        info = prepare_images(args.images, args.out, val, overwrite=args.overwrite)
    except DataError as err:
        print(f"meshspeed data prepare: {err}", file=sys.stderr)
        return 2
    kind = (
        "captioned" if info["captions"] else f"{info['classes']} classes" if info["classes"] else "unlabelled"
    )
    print(
        f"wrote {args.out}: {info['images']:,} images {info['channels']}×{info['height']}×{info['width']} "
        f"({kind}) from {args.images}; validation = {info['val']:,} images held out"
    )
    return 0


def run_prepare_records(args) -> int:
    """--kind chat|pairs|arith (meshspeed.data.record_file, meshspeed.data.arith)."""
    from meshspeed.comm.errors import ConfigError
    from meshspeed.data.corpus import DataError

    try:
        if args.kind not in ("chat", "pairs", "arith"):
            raise DataError(f"--kind={args.kind!r} is not known; choose one of tokens, chat, pairs, arith")
        if args.kind == "arith":
            return _run_arith(args)
        from meshspeed.data.record_file import prepare_records

        meta = prepare_records(
            args.kind,
            args.input,
            args.out,
            args.tokenizer,
            args.seq_len,
            packing=args.packing,
            val_fraction=args.val_fraction,
            overwrite=args.overwrite,
        )
    except ConfigError as err:  # DataError, and OutputError for a target it must not replace
        print(f"meshspeed data prepare: {err}", file=sys.stderr)
        return 2
    rows = meta["rows"]
    cut = f", {meta['truncated']:,} sequences cut to --seq-len" if meta["truncated"] else ""
    drop = f", {meta['dropped']:,} dropped (no answer token within --seq-len)" if meta["dropped"] else ""
    print(
        f"wrote {args.out}: {meta['records']:,} {args.kind} records{cut}{drop} -> {rows['train']:,} train + "
        f"{rows['val']:,} validation rows of {meta['seq_len']} ({meta['tokenizer']} tokenizer, pad id "
        f"{meta['pad_id']}, end-of-turn id {meta['end_of_turn_id']})"
    )
    return 0


def _run_arith(args) -> int:
    from meshspeed.data.arith import DEFAULT_VAL_FRACTION as ARITH_VAL
    from meshspeed.data.arith import write_arith
    from meshspeed.data.corpus import DataError

    numbers = {}
    for flag, value in (("--count", args.count), ("--seed", args.seed)):
        try:
            numbers[flag] = int(value)
        except ValueError:
            raise DataError(f"{flag}={value!r} must be an integer, e.g. 4000 (--count), 0 (--seed)") from None
    try:
        # the flag's default is the token files' 0.02; arith's own default holds out more questions
        val = ARITH_VAL if args.val_fraction == DEFAULT_VAL_FRACTION else float(args.val_fraction)
    except ValueError:
        raise DataError(
            f"--val-fraction={args.val_fraction!r} must be a number in (0, 1), e.g. 0.1"
        ) from None
    counts = write_arith(args.out, numbers["--count"], numbers["--seed"], val, overwrite=args.overwrite)
    print(f"wrote {args.out}/: " + ", ".join(f"{name} ({n:,} records)" for name, n in counts.items()))
    print(f"next: meshspeed data prepare --kind chat --input {args.out}/sft.train.jsonl --seq-len 64 --out F")
    return 0


def run_prepare(args) -> int:
    from meshspeed.data.prepare import DataError, prepare_tokens, sidecar_path

    if args.images and args.kind != "tokens":
        print(f"meshspeed data prepare: --images and --kind {args.kind} cannot be combined; "
              "prepare images and records separately", file=sys.stderr)  # fmt: skip
        return 2
    if args.images:
        return run_prepare_images(args)
    if args.kind != "tokens":
        return run_prepare_records(args)

    try:
        workers = args.workers
        if workers is not None:
            try:
                workers = int(workers)
            except ValueError:
                raise DataError(f"--workers={workers!r} must be a positive integer, e.g. 4") from None
        meta = prepare_tokens(
            args.out,
            args.format,
            args.input,
            args.max_mb,
            args.tokenizer,
            text_key=args.text_key,
            workers=workers,
            val_fraction=args.val_fraction,
            progress=_Progress(),
            overwrite=args.overwrite,
        )
    except DataError as err:
        print(f"meshspeed data prepare: {err}", file=sys.stderr)
        return 2
    val = meta["validation"]
    print(
        f"wrote {args.out}: {meta['count']:,} {meta['format']} tokens in {meta['documents']:,} documents "
        f"({meta['tokenizer']} tokenizer, vocabulary {meta['vocab_size']}, largest id {meta['max_id']}) "
        f"from {meta['files']} files of {meta['source']}"
        + (f", {meta['skipped_binary']} binary files skipped" if meta["skipped_binary"] else "")
    )
    print(
        f"      {sidecar_path(args.out)}: validation = the last {val['documents']:,} documents "
        f"({val['tokens']:,} tokens)"
    )
    tok = "" if meta["tokenizer"] == "bytes" else f" --data.tokenizer {meta['tokenizer']}"
    print(f"train on it with: --data.path {args.out} --data.format {meta['format']}{tok}")
    return 0
