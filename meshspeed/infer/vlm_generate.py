"""`meshspeed generate --image FILE [--prompt TEXT]...`: a vision-language model (family 'vlm')
captions or answers about one image, greedily, on one process or under tp / dp.

The launcher side (resolve) reads the checkpoint's config, the image (Pillow: RGB, resized to
the model's image_size, scaled to [-1, 1] as the training records are) and the prompts, and
checks the layout, so bad input costs one line; each prompt becomes the image's placeholders
followed by its bytes (the training records' layout: placeholders first). The workers build the
model in the layout (tp: sharded as in training), load the weights and decode
(infer/captions.greedy); dp replicas take contiguous shares of the prompts and the ids are
gathered back in prompt order, so every layout prints the same text.
"""

from __future__ import annotations

import json

from meshspeed import comm
from meshspeed.comm import ConfigError


def load_image(path: str, size: int):
    """[3, size, size] float32 in [-1, 1] from an image file, as the training records read it."""
    import torch

    from meshspeed.data.image_captions import read_rgb

    return torch.from_numpy(read_rgb(path, size, "--image").copy())


def resolve(opts: dict) -> dict:
    """Checked, plain-data job from generate's options (commands/generate.py) with --image."""
    from meshspeed.interop.model_source import checkpoint_model_config
    from meshspeed.models import recipe_for
    from meshspeed.models.vlm_config import image_tokens
    from meshspeed.parallel.tensor import check_tp

    if not opts.get("checkpoint"):
        raise ConfigError("--image needs --checkpoint DIR: a vlm run directory or checkpoint")
    for flag, on in (("--chat", opts.get("chat")), ("--prompts", opts.get("prompts"))):
        if on:
            raise ConfigError(f"{flag} with --image is not built; give the question as --prompt TEXT")
    if opts["temperature"] != 0.0 or opts["pp"] != 1:
        raise ConfigError(
            f"--image decodes greedily under tp and dp: --temperature={opts['temperature']} and "
            f"--parallel.pp={opts['pp']} are not built for it; use --temperature 0 and pp 1"
        )
    config = checkpoint_model_config(opts["checkpoint"], "--checkpoint")
    if config.family != "vlm":
        raise ConfigError(
            f"--image with a {config.family!r} model: --checkpoint must hold a vlm (e.g. a run of "
            "configs/vlm-tiny.toml)"
        )
    tp, dp, nproc = opts["tp"], opts["dp"], opts["nproc"]
    if tp * dp != nproc:
        raise ConfigError(f"--parallel.tp={tp} × --parallel.dp={dp} = {tp * dp} must equal --nproc={nproc}")
    check_tp(tp, recipe_for(config))
    texts = list(opts.get("prompt") or [""])  # no prompt: a caption
    n_img = image_tokens(config)
    ids = [[config.image_token_id] * n_img + list(t.encode("utf-8")) for t in texts]
    longest = max(len(i) for i in ids) + opts["max_new_tokens"]
    if longest > config.max_seq_len:
        raise ConfigError(
            f"--max-new-tokens={opts['max_new_tokens']}: the {n_img} image tokens, the longest prompt and "
            f"it make {longest} tokens, over the model's max_seq_len {config.max_seq_len}; use ≤ "
            f"{config.max_seq_len - longest + opts['max_new_tokens']}"
        )
    image = load_image(opts["image"], config.image_size)
    return {**opts, "texts": texts, "ids": ids, "pixels": image.tolist(), "device": "cpu"}


def decode(model, config, job: dict, rows: range) -> list[list[int]]:
    """Greedy continuations of job's prompts `rows` (one at a time: prompts differ in length)."""
    import torch

    from meshspeed.infer.captions import greedy

    image = torch.tensor(job["pixels"])[None]
    return [
        greedy(model, config, torch.tensor([job["ids"][r]]), image, job["max_new_tokens"])[0] for r in rows
    ]


def gather_rows(local: list[list[int]], offs: list[int], group) -> list[list[int]]:
    """Every replica's id lists (replica r holds rows offs[r]..offs[r+1]) in row order, on
    every rank: one all-gather of [rows, longest] padded with -1 (the ids are never negative)."""
    import torch

    width = max([len(x) for x in local] + [1])
    width = int(comm.all_reduce(torch.tensor([width], device=group.ctx.device), group, "max")[0])
    pad = torch.full((offs[-1], width), -1, dtype=torch.long, device=group.ctx.device)
    mine = pad[: len(local)].clone()
    for i, ids in enumerate(local):
        mine[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    sizes = [offs[r + 1] - offs[r] for r in range(group.size)]
    rows = comm.all_gather(mine, group, sizes=sizes).tolist()
    return [[t for t in row if t >= 0] for row in rows]


def answer(job: dict, ctx) -> list[dict] | None:
    """On every rank of `ctx`: build the model in job's layout, load the weights, decode this
    rank's share; the rows {"prompt", "token_ids", "text"} in prompt order on rank 0, else None."""
    from meshspeed.comm.algorithms import bounds
    from meshspeed.infer.captions import load_run_model, text_of

    mesh = comm.ParallelDims(tp=job["tp"], dp=job["dp"]).build(ctx)
    model, config, _ = load_run_model(job["checkpoint"], mesh, "--checkpoint")
    n = len(job["ids"])
    if job["dp"] > 1:  # replica r: prompts bounds(n, dp)[r]..[r+1], gathered back in order
        dp = mesh.group("dp")
        offs = bounds(n, dp.size)
        out = gather_rows(decode(model, config, job, range(offs[dp.rank], offs[dp.rank + 1])), offs, dp)
    else:
        out = decode(model, config, job, range(n))
    if ctx.rank != 0:
        return None
    return [{"prompt": p, "token_ids": o, "text": text_of(o)} for p, o in zip(job["texts"], out, strict=True)]


def worker(job: dict) -> None:
    """Every rank: answer(); rank 0 prints each prompt with its answer (and writes --json)."""
    ctx = comm.init(device=job["device"])
    try:
        rows = answer(job, ctx)
        if rows is not None:
            for r in rows:
                print(f"{job['image']}: {r['prompt']}{r['text']}", flush=True)
            if job.get("json"):
                with open(job["json"], "w") as f:
                    json.dump({"image": job["image"], "outputs": rows}, f, indent=1)
    finally:
        ctx.close()
