"""`meshspeed generate`: text from a meshspeed checkpoint or a Hugging Face directory, with a
key/value cache, greedy or sampled, on one process or under tensor / data parallelism."""

from __future__ import annotations

import os
import sys


def register(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text from a checkpoint or Hugging Face model (tp, dp)",
        description=(
            "Generate from one or many prompts with a key/value cache (prefill, then one token per "
            "step). Prompts of different lengths are batched with left padding. The same --seed gives "
            "the same tokens whatever --parallel.tp / --parallel.dp. Prints prefill and decode tokens/s."
        ),
    )
    src = p.add_argument_group("model")
    src.add_argument(
        "--checkpoint", help="meshspeed checkpoint, or run directory (its newest verified checkpoint)"
    )
    src.add_argument("--hf", help="Hugging Face model directory (config.json + safetensors)")
    src.add_argument("--tokenizer", help="'bytes' or a Hugging Face tokenizer directory (default: the --hf "
                     "directory when it has tokenizer.json, else bytes)")  # fmt: skip
    p.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    p.add_argument(
        "--image",
        metavar="FILE",
        help="a vision-language model (family vlm, --checkpoint) captions this image (PNG/JPEG, "
        "resized to the model's image_size), or answers each --prompt about it (--chat: as a user "
        "turn, <image> marking where the image goes); KV cache, sampling, tp/dp/pp as for text",
    )
    p.add_argument("--prompts", metavar="FILE", help="text file, one prompt per line")
    p.add_argument(
        "--chat",
        action="store_true",
        help="each prompt is a user message: rendered with the tokenizer's chat template and its "
        "generation prompt (the byte tokenizer's built-in one; see docs/post-training.md), as the "
        "SFT/DPO records were; generation stops at the template's end-of-turn token",
    )
    p.add_argument(
        "--max-new-tokens", type=int, default=32, help="tokens to generate per prompt (default 32)"
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; > 0: sample")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    p.add_argument(
        "--top-p", type=float, default=1.0, help="sample from the smallest set reaching p (1: all)"
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed; the same seed, the same tokens")
    p.add_argument("--json", metavar="FILE", help='write {"outputs": [{"prompt", "token_ids", "text"}]}')
    p.add_argument("--nproc", type=int, default=1, help="local worker processes (= tp × dp × pp)")
    p.add_argument("--parallel.tp", dest="tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument(
        "--parallel.dp", dest="dp", type=int, default=1, help="data-parallel replicas (prompts split)"
    )
    p.add_argument(
        "--parallel.pp",
        dest="pp",
        type=int,
        default=1,
        help="pipeline stages: each rank holds its stage of the layers (the training split) and their "
        "KV cache; the prompts flow through in micro-batches",
    )
    p.add_argument(
        "--run.device",
        dest="device",
        default="auto",
        metavar="{auto,cpu,cuda}",
        help="auto (default): CUDA when every rank gets a GPU of its own, else the CPU with one line "
        "saying what to type; cpu; cuda (refused before any worker starts when the GPUs are too few)",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    from meshspeed.comm import ConfigError, launch
    from meshspeed.infer.generate import SamplingConfig
    from meshspeed.infer.runner import resolve, worker

    opts = {k: v for k, v in vars(args).items() if k != "func"}
    try:
        if args.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens={args.max_new_tokens} must be ≥ 1")
        if args.json and os.path.isdir(args.json):  # found now, not after the model has loaded
            raise ConfigError(f"--json={args.json!r} is a directory; name a file to write")
        try:
            SamplingConfig(args.temperature, args.top_k, args.top_p, args.seed)
        except ValueError as e:
            raise ConfigError(f"--{e}") from None
        if args.image:  # a vlm: the image's placeholders and each prompt (infer/vlm_generate.py)
            from meshspeed.infer.vlm_generate import resolve, worker
        job = resolve(opts)
    except (ConfigError, ValueError) as err:
        print(f"meshspeed generate: {err}", file=sys.stderr)
        return 2
    if job.get("device_notice"):
        print(f"meshspeed generate: warning: {job['device_notice']}", file=sys.stderr, flush=True)
    if args.nproc == 1:
        return launch.run_worker(worker, (job,))
    preload = ("meshspeed.checkpoint.dcp", "meshspeed.infer.parallel", "meshspeed.interop.hf_import")
    return launch.spawn(worker, args.nproc, (job,), fork_ok=job["device"] == "cpu", preload=preload)
