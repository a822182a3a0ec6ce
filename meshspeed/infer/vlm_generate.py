"""`meshspeed generate --image FILE [--prompt TEXT]...`: a vision-language model (family 'vlm')
captions or answers about one image, with the text families' key/value cache and sampling, on
one process or under tp, dp and pp.

The launcher side (resolve) reads the checkpoint's config, the image (Pillow: RGB, resized to
the model's image_size, scaled to [-1, 1] as the training records are) and the prompts, and
checks the layout, so bad input costs one line. Each prompt becomes the image's placeholders
followed by its bytes (the caption and question records' layout), or with --chat the user turn
and generation prompt exactly as a training conversation renders them (data/image_chat.py).
The workers build the model in the layout (as in training; pp: the ViT and projector on stage
0), load the weights, run the ViT once and decode through the text path's generators
(infer/vlm_decode.py): the same ids as the uncached infer/captions.greedy, and with a --seed the
same sampled ids under every layout.
"""

from __future__ import annotations

import json
import os

from meshspeed import comm
from meshspeed.comm import ConfigError
from meshspeed.models.vlm_config import image_tokens


def load_image(path: str, size: int):
    """[3, size, size] float32 in [-1, 1] from an image file, as the training records read it."""
    import torch

    from meshspeed.data.image_captions import read_rgb

    return torch.from_numpy(read_rgb(path, size, "--image").copy())


def chat_prompt(text: str, config) -> list[int]:
    """A --chat prompt: the tokens a training conversation (data/image_chat.py) puts before its
    answer, i.e. the user turn (the image where `<image>` stands, else opening the turn) and the
    generation prompt. Cut from a rendered training conversation at its first label, so the two
    cannot drift apart."""
    from meshspeed.data.image_chat import conversation_sequence

    turns = [{"role": "user", "content": text}, {"role": "assistant", "content": "."}]
    ids, labels = conversation_sequence(turns, "--prompt", image_tokens(config), config.image_token_id)
    first = next(i for i, lab in enumerate(labels) if lab != -100)  # predicts the answer's first token
    return ids[: first + 1]


def _device(opts: dict, gpus: int | None):
    """--run.device for the --nproc local ranks, as the text path chooses it (comm.context)."""
    from meshspeed.comm.context import choose_device, local_gpus

    gpus = local_gpus() if gpus is None else gpus
    fix = f"give --nproc {gpus} and a --parallel.* layout of {gpus} ranks"
    return choose_device(opts.get("device") or "auto", opts["nproc"], gpus, key="--run.device", fix=fix)


def resolve(opts: dict, *, local_gpus: int | None = None) -> dict:
    """Checked, plain-data job from generate's options (commands/generate.py) with --image.
    `local_gpus`: the GPUs to place the ranks on (default: counted here)."""
    from meshspeed.data.chat_template import END_OF_TURN_ID
    from meshspeed.data.corpus import DataError
    from meshspeed.interop.model_source import checkpoint_model_config
    from meshspeed.models import recipe_for
    from meshspeed.parallel.tensor import check_tp

    if not opts.get("checkpoint"):
        raise ConfigError("--image needs --checkpoint DIR: a vlm run directory or checkpoint")
    config = checkpoint_model_config(opts["checkpoint"], "--checkpoint")
    if config.family != "vlm":
        raise ConfigError(
            f"--image with a {config.family!r} model: --checkpoint must hold a vlm (e.g. a run of "
            "configs/vlm-tiny.toml)"
        )
    tp, dp, pp, nproc = opts["tp"], opts["dp"], opts.get("pp", 1), opts["nproc"]
    if tp * dp * pp != nproc:
        raise ConfigError(
            f"--parallel.tp={tp} × --parallel.dp={dp} × --parallel.pp={pp} = {tp * dp * pp} must equal "
            f"--nproc={nproc}"
        )
    check_tp(tp, recipe_for(config))
    if pp > 1:  # the training split (the ViT and projector go with the embedding, on stage 0)
        from meshspeed.parallel.pipeline.stage import stage_layouts

        try:
            stage_layouts(recipe_for(config), pp)
        except ValueError as err:
            raise ConfigError(f"--parallel.pp={pp}: {err}") from None
    from meshspeed.infer.runner import prompt_texts

    texts = prompt_texts(opts) or [""]  # no prompt: a caption (--chat: a user turn holding the image alone)
    n_img = image_tokens(config)
    if opts.get("chat"):
        try:
            ids = [chat_prompt(t, config) for t in texts]
        except DataError as err:
            raise ConfigError(f"--chat: {err}") from None
    else:  # the caption and question records' layout: placeholders first, then the bytes
        ids = [[config.image_token_id] * n_img + list(t.encode("utf-8")) for t in texts]
    starts = sorted({i.index(config.image_token_id) for i in ids})
    if len(starts) > 1:  # one M-RoPE table serves every prompt (infer/vlm_decode.py)
        raise ConfigError(
            f"--chat: the prompts put <image> at different tokens ({', '.join(map(str, starts))}); "
            "one run decodes prompts whose image sits at the same place: run the others apart"
        )
    prompt = max(len(i) for i in ids)
    if prompt >= config.max_seq_len:  # no --max-new-tokens fits: the prompt is what must change
        raise ConfigError(
            f"the longest prompt with the {n_img} image tokens is {prompt} tokens, leaving no room under "
            f"the model's max_seq_len {config.max_seq_len}; shorten it by {prompt - config.max_seq_len + 1}"
        )
    longest = prompt + opts["max_new_tokens"]
    if longest > config.max_seq_len:
        raise ConfigError(
            f"--max-new-tokens={opts['max_new_tokens']}: the {n_img} image tokens, the longest prompt and "
            f"it make {longest} tokens, over the model's max_seq_len {config.max_seq_len}; use ≤ "
            f"{config.max_seq_len - longest + opts['max_new_tokens']}"
        )
    image = load_image(opts["image"], config.image_size)
    device = _device(opts, local_gpus)
    return {**opts, "pp": pp, "texts": texts, "ids": ids, "image_at": starts[0], "eos_id": END_OF_TURN_ID,
            "pixels": image.tolist(), "device": device.device, "device_notice": device.notice}  # fmt: skip


def load(job: dict, mesh):
    """(this rank's model, its PipelineStages or None, the ModelConfig) from job's checkpoint
    (a run directory: its newest checkpoint that verifies), in job's layout."""
    from meshspeed.checkpoint.dcp import load_checkpoint
    from meshspeed.checkpoint.dirs import COMPLETE, CheckpointError, newest_verified
    from meshspeed.infer.parallel import build_inference_model
    from meshspeed.interop.model_source import checkpoint_model_config
    from meshspeed.models import recipe_for

    path = job["checkpoint"]
    if not os.path.isfile(os.path.join(path, COMPLETE)):
        path, skipped = newest_verified(path, mesh)
        if path is None:
            raise CheckpointError(f"--checkpoint={job['checkpoint']!r}: no checkpoint verifies ({skipped})")
    config = checkpoint_model_config(path, "--checkpoint")
    model, stages = build_inference_model(recipe_for(config), mesh)
    load_checkpoint(path, model, None, mesh, restore_rng=False)
    return model.eval(), stages, config


def answer(job: dict, ctx, stats=None) -> list[dict] | None:
    """On every rank of `ctx`: build the model in job's layout, load the weights, decode with the
    key/value cache (infer/vlm_decode.py); the rows {"prompt", "token_ids", "text"} in prompt
    order on rank 0, else None."""
    import torch

    from meshspeed.infer.captions import text_of
    from meshspeed.infer.generate import SamplingConfig
    from meshspeed.infer.vlm_decode import decode

    mesh = comm.ParallelDims(tp=job["tp"], dp=job["dp"], pp=job["pp"]).build(ctx)
    model, stages, config = load(job, mesh)
    features = None
    if model.embed is not None:  # the ViT once, on the ranks holding the embedding (pp: stage 0)
        with torch.no_grad():
            image = torch.tensor(job["pixels"], device=ctx.device)[None]
            features = model.embed.image_features(image)  # [1, n_img, dim]
    sampling = SamplingConfig(job["temperature"], job["top_k"], job["top_p"], job["seed"])
    out = decode(model, stages, mesh, config, job["ids"], features, job["image_at"],
                 max_new_tokens=job["max_new_tokens"], sampling=sampling, eos_id=job["eos_id"],
                 stats=stats)  # fmt: skip
    if ctx.rank != 0:
        return None
    return [{"prompt": p, "token_ids": o, "text": text_of(o)} for p, o in zip(job["texts"], out, strict=True)]


def worker(job: dict) -> None:
    """Every rank: answer(); rank 0 prints each prompt with its answer (and writes --json)."""
    from meshspeed.infer.generate import Stats

    ctx = comm.init(device=job["device"])
    try:
        stats = Stats()
        rows = answer(job, ctx, stats)
        if rows is not None:
            for r in rows:
                if job.get("chat"):
                    print(f"user: [{job['image']}] {r['prompt']}\nassistant: {r['text']}\n", flush=True)
                else:
                    print(f"{job['image']}: {r['prompt']}{r['text']}", flush=True)
            if job.get("json"):
                with open(job["json"], "w") as f:
                    json.dump({"image": job["image"], "outputs": rows}, f, indent=1)
            print(
                f"meshspeed generate: {stats.line()} (rank 0 of {ctx.world_size} on {ctx.device.type}; "
                "the image's ViT runs once, before the prefill)",
                flush=True,
            )
    finally:
        ctx.close()
