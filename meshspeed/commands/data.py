"""`meshspeed data prepare`: tokenize text into a token file for `--data.format uint32`."""

from __future__ import annotations

import argparse
import sys

DESCRIPTION = """\
Tokenize text into a flat little-endian token file that `meshspeed train` memory-maps
(--data.path FILE --data.format uint32), and write FILE.json beside it (tokenizer, vocab_size,
eot, format, count). The text is read as the trainer reads a text corpus: each non-hidden file,
binary files (holding a NUL byte) skipped, each file one document followed by the tokenizer's
end-of-document token (NUL for the byte tokenizer). The tokens equal what the trainer would
make of the same text with the same --data.tokenizer; a token file is tokenized once, not at
every start and on every rank."""

EXAMPLES = """examples:
  meshspeed data prepare --out data/tokens.bin --format uint32        # the stdlib sources, 8 MB
  meshspeed data prepare --out data/tokens.bin --format uint32 --max-mb 0   # all of them
  meshspeed data prepare --out data/mine.bin --format uint32 --input ~/texts/
  meshspeed data prepare --out data/qwen.bin --format uint32 --input ~/texts/ --tokenizer ~/Qwen2-7B/
  torchrun --nproc-per-node 8 -m meshspeed train --config configs/llama3-8b.toml   # reads data/tokens.bin
"""


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
    # Values are checked by meshspeed.train.prepare, so a bad one is one line naming the flag.
    p.add_argument(
        "--out",
        default="",
        metavar="PATH",
        help="required: the token file to write (e.g. data/tokens.bin); its sidecar is PATH.json",
    )
    p.add_argument(
        "--format",
        default="uint32",
        metavar="{uint32,uint16}",
        help="token width (default uint32, what configs/llama3-8b.toml reads)",
    )
    p.add_argument(
        "--input",
        default="",
        metavar="PATH_OR_DIR",
        help="a text file or a directory of text "
        "files (default: the Python standard library's .py sources, the trainer's default corpus)",
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
        help="read at most N MB (10^6 bytes) of text; "
        "0 = no cap (default: 8 for the standard library, as the trainer; no cap for --input)",
    )
    p.set_defaults(func=run_prepare)
    parser.set_defaults(func=lambda args: (parser.print_help(), 0)[1])


def run_prepare(args) -> int:
    from meshspeed.train.prepare import DataError, prepare_tokens, sidecar_path

    try:
        meta = prepare_tokens(args.out, args.format, args.input, args.max_mb, args.tokenizer)
    except DataError as err:
        print(f"meshspeed data prepare: {err}", file=sys.stderr)
        return 2
    print(
        f"wrote {args.out}: {meta['count']:,} {meta['format']} tokens ({meta['tokenizer']} tokenizer, "
        f"vocabulary {meta['vocab_size']}) from {meta['files']} files of {meta['source']}"
        + (f", {meta['skipped_binary']} binary files skipped" if meta["skipped_binary"] else "")
    )
    print(f"      {sidecar_path(args.out)}")
    tok = "" if meta["tokenizer"] == "bytes" else f" --data.tokenizer {meta['tokenizer']}"
    print(f"train on it with: --data.path {args.out} --data.format {meta['format']}{tok}")
    return 0
