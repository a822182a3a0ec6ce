"""`meshspeed convert`: Hugging Face model directories in and out."""

from __future__ import annotations

import argparse
import sys

DESCRIPTION = """\
Import: --from-hf DIR --out RUN_DIR reads a Hugging Face model directory (config.json +
model.safetensors or a sharded index) of the Llama, Mistral, Mixtral or Qwen2 families and writes
the meshspeed checkpoint RUN_DIR/step-000000 (train from it with --model.init_from RUN_DIR, or
skip this step and point --model.init_from at the Hugging Face directory itself).
Export: --checkpoint DIR --to-hf OUT writes OUT with config.json, safetensors shards + index
and, when the run used a Hugging Face tokenizer, its files: what
transformers.AutoModelForCausalLM.from_pretrained(OUT) loads. Sparse weights are exported masked.
Query/key rows are permuted between Hugging Face's rotate-half RoPE layout and meshspeed's
interleaved one (exact; see meshspeed/models/hf.py).
Diffusion transformers: --from-hf also takes a diffusers DiTTransformer2DModel directory
(config.json + diffusion_pytorch_model.safetensors), and --to-hf on a dit checkpoint writes one
that diffusers' DiTTransformer2DModel.from_pretrained loads: the EMA of the weights when the
checkpoint holds it (what meshspeed sample uses), the trained weights with --no-ema."""

EXAMPLES = """examples:
  meshspeed convert --from-hf ~/models/Llama-3.1-8B --out runs/llama31
  meshspeed train --model.init_from ~/models/Llama-3.1-8B --data.tokenizer ~/models/Llama-3.1-8B ...
  meshspeed convert --checkpoint runs/llama31 --to-hf exported/ --dtype bfloat16
  meshspeed convert --checkpoint runs/dit-tiny --to-hf exported-dit/      # diffusers, EMA weights
"""

DTYPES = ("float32", "bfloat16", "float16")
MAX_SHARD_MB = 2**24  # 16 TiB: past any file system's file size; a larger value is a typo


def register(sub) -> None:
    p = sub.add_parser(
        "convert",
        help="import / export Hugging Face checkpoints",
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--from-hf", metavar="DIR", default="", help="a Hugging Face model directory to import")
    p.add_argument("--out", metavar="RUN_DIR", default="", help="with --from-hf: where the checkpoint goes")
    p.add_argument(
        "--checkpoint",
        metavar="DIR",
        default="",
        help="a meshspeed checkpoint (or run directory: its latest) to export",
    )
    p.add_argument(
        "--to-hf", metavar="DIR", default="", help="with --checkpoint: the Hugging Face directory to write"
    )
    p.add_argument(
        "--dtype",
        default="",
        metavar="{" + ",".join(DTYPES) + "}",
        help="weight dtype (default: float32 on import, as stored on export)",
    )
    p.add_argument(
        "--tokenizer",
        default="",
        metavar="T",
        help="with --to-hf: copy this Hugging Face tokenizer "
        "(default: the run's data.tokenizer when it was one)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="--to-hf: write into a directory holding files meshspeed did not write (they are kept; "
        "only files meshspeed's own manifest there lists are replaced); --from-hf: replace the "
        "checkpoint already in --out",
    )
    p.add_argument(
        "--max-shard-mb",
        type=float,
        default=2048.0,
        metavar="MB",
        help="with --to-hf: largest safetensors shard (default 2048)",
    )
    p.add_argument(
        "--no-ema",
        action="store_true",
        help="with --to-hf on a dit checkpoint: export the trained weights, not their EMA",
    )
    p.set_defaults(func=run)


def _fail(msg: str) -> int:
    print(f"meshspeed convert: {msg}", file=sys.stderr)
    return 2


def run(args) -> int:
    import torch

    from meshspeed.checkpoint.dirs import CheckpointError
    from meshspeed.comm.errors import ConfigError
    from meshspeed.comm.outputs import disk_error

    importing, exporting = bool(args.from_hf or args.out), bool(args.checkpoint or args.to_hf)
    if (
        importing == exporting
        or (importing and not (args.from_hf and args.out))
        or (exporting and not (args.checkpoint and args.to_hf))
    ):
        return _fail(
            "give either --from-hf DIR --out RUN_DIR (import) or --checkpoint DIR --to-hf DIR (export)"
        )
    if args.dtype and args.dtype not in DTYPES:
        return _fail(f"--dtype {args.dtype!r} is not valid; choose one of {', '.join(DTYPES)}")
    if not 0 < args.max_shard_mb <= MAX_SHARD_MB:  # also NaN and inf
        return _fail(f"--max-shard-mb {args.max_shard_mb} must be in (0, {MAX_SHARD_MB}] MB, e.g. 2048")
    dtype = getattr(torch, args.dtype) if args.dtype else None
    try:
        if importing:
            from meshspeed.interop.hf_import import convert_from_hf

            path = convert_from_hf(args.from_hf, args.out, dtype or torch.float32, overwrite=args.overwrite)
            print(f"wrote meshspeed checkpoint {path}\ntrain from it with: --model.init_from {args.out}")
        elif _family(args.checkpoint) == "dit":
            return _export_dit(args, dtype)
        elif _family(args.checkpoint) == "vlm":  # a transformers Qwen2-VL directory
            from meshspeed.interop.hf_vlm_io import export_vlm_checkpoint

            files = export_vlm_checkpoint(args.checkpoint, args.to_hf, dtype, overwrite=args.overwrite)
            print(f"wrote {len(files)} files to {args.to_hf} (transformers' Qwen2VLForConditionalGeneration)")
        else:
            if args.no_ema:
                return _fail("--no-ema applies to a dit checkpoint (the EMA of a flow run); drop it")
            from meshspeed.interop.hf_export import export_checkpoint

            files = export_checkpoint(
                args.checkpoint,
                args.to_hf,
                dtype=dtype,
                tokenizer=args.tokenizer,
                max_shard_bytes=int(args.max_shard_mb * 2**20),
                overwrite=args.overwrite,
            )
            print(
                f"wrote {args.to_hf}: {len(files)} files (config.json, "
                f"{sum(f.endswith('.safetensors') for f in files)} safetensors shards)"
            )
    except (ConfigError, CheckpointError, ImportError) as err:
        return _fail(str(err))
    except OSError as err:  # a full disk, a permission: one line naming the file, not a traceback
        return _fail(str(disk_error(err, err.filename or "the output") or f"{err.strerror}: {err.filename}"))
    return 0


def _family(path: str) -> str:
    from meshspeed.interop.model_source import checkpoint_model_config

    return checkpoint_model_config(path).family


def _export_dit(args, dtype) -> int:
    """A dit checkpoint out as a diffusers DiTTransformer2DModel directory."""
    from meshspeed.interop.diffusers_io import export_diffusers, weights_note

    if args.tokenizer:
        return _fail(f"--tokenizer {args.tokenizer!r}: a diffusers DiT has no tokenizer; drop it")
    export_diffusers(args.checkpoint, args.to_hf, dtype=dtype, ema=not args.no_ema, overwrite=args.overwrite)
    note = weights_note(args.checkpoint, not args.no_ema)
    print(f"wrote {args.to_hf}: diffusers DiTTransformer2DModel, {note}")
    return 0
