"""`meshspeed generate` resolved before any worker starts, then run on every rank.

The launcher side (resolve) reads the model's config, the tokenizer and the prompts and checks
the layout, so bad input costs one line; the workers get plain data and only build, load and
generate.
"""

from __future__ import annotations

import dataclasses
import json
import os

from meshspeed import comm
from meshspeed.comm import ConfigError


def _device(opts: dict, gpus: int | None):
    """--run.device for the --nproc local ranks (comm.context.choose_device), with the layout
    to type when the GPUs are fewer than the ranks."""
    from meshspeed.comm.context import choose_device, fit_degrees, local_gpus

    gpus = local_gpus() if gpus is None else gpus
    fit = fit_degrees(gpus, {"tp": opts["tp"], "pp": opts["pp"]})
    flags = [f"--nproc {gpus}"] + [f"--parallel.{k} {v}" for k, v in fit.items() if v != opts[k]]
    if (dp := gpus // (fit["tp"] * fit["pp"])) != opts["dp"]:
        flags.append(f"--parallel.dp {dp}")
    fix = "add " + " ".join(flags)
    return choose_device(opts.get("device") or "auto", opts["nproc"], gpus, key="--run.device", fix=fix)


def prompt_texts(opts: dict) -> list[str]:
    """--prompt (repeatable) then the lines of --prompts FILE (blank lines skipped)."""
    texts = list(opts.get("prompt") or [])
    if opts.get("prompts"):
        try:
            with open(opts["prompts"]) as f:
                texts += [line.rstrip("\n") for line in f if line.strip()]
        except OSError as e:
            raise ConfigError(
                f"--prompts={opts['prompts']!r} cannot be read ({e.strerror}); pass a text file"
            ) from None
    return texts


def resolve(opts: dict, *, local_gpus: int | None = None) -> dict:
    """Checked, plain-data job description from the command's options (see commands/generate.py).
    `local_gpus`: the GPUs to place the ranks on (default: counted here)."""
    from meshspeed.data.tokenizer import check_vocab, load_tokenizer
    from meshspeed.interop.hf_import import HFCheckpoint, is_hf_dir
    from meshspeed.interop.model_source import checkpoint_model_config
    from meshspeed.models import recipe_for
    from meshspeed.parallel.tensor import check_tp

    if bool(opts.get("checkpoint")) == bool(opts.get("hf")):
        raise ConfigError("give exactly one of --checkpoint DIR (meshspeed) or --hf DIR (Hugging Face)")
    if opts.get("hf"):
        if not is_hf_dir(opts["hf"]):
            raise ConfigError(f"--hf={opts['hf']!r} has no config.json; pass a Hugging Face model directory")
        config = HFCheckpoint(opts["hf"], "--hf").config
    else:
        config = checkpoint_model_config(opts["checkpoint"], "--checkpoint")
    tp, dp, pp, nproc = opts["tp"], opts["dp"], opts["pp"], opts["nproc"]
    if tp * dp * pp != nproc:
        raise ConfigError(
            f"--parallel.tp={tp} × --parallel.dp={dp} × --parallel.pp={pp} = {tp * dp * pp} must equal "
            f"--nproc={nproc}"
        )
    check_tp(tp, recipe_for(config))
    if pp > 1:  # the training split, checked here: tied embeddings, fewer layers than stages
        from meshspeed.parallel.pipeline.stage import stage_layouts

        try:
            stage_layouts(recipe_for(config), pp)
        except ValueError as err:
            raise ConfigError(f"--parallel.pp={pp}: {err}") from None
    spec = opts.get("tokenizer") or (
        opts["hf"]
        if opts.get("hf") and os.path.isfile(os.path.join(opts["hf"], "tokenizer.json"))
        else "bytes"
    )
    tok = load_tokenizer(spec)
    check_vocab(tok, config.vocab_size, "--tokenizer")
    texts = prompt_texts(opts)
    if not texts:
        raise ConfigError("no prompt: give --prompt TEXT (repeatable) or --prompts FILE (one per line)")
    eos_id = tok.eot
    if opts.get("chat"):  # a user turn + the generation prompt, tokenized as training records were
        from meshspeed.data.chat_template import prompt_ids
        from meshspeed.data.corpus import DataError

        try:
            turns = [prompt_ids(tok, [{"role": "user", "content": t}]) for t in texts]
        except DataError as err:
            raise ConfigError(f"--chat: {err}") from None
        ids, eos_id = [i for i, _ in turns], turns[0][1]
    else:
        ids = [tok.encode(t) for t in texts]
    if empty := [t for t, i in zip(texts, ids, strict=True) if not i]:
        raise ConfigError(f"--prompt {empty[0]!r} encodes to no tokens; give a non-empty prompt")
    prompt = max(len(i) for i in ids)
    longest = prompt + opts["max_new_tokens"]
    if prompt >= config.max_seq_len:  # no --max-new-tokens fits: the prompt is what must change
        raise ConfigError(
            f"the longest prompt is {prompt} tokens, leaving no room under the model's max_seq_len "
            f"{config.max_seq_len}; shorten it to at most {config.max_seq_len - 1} tokens"
        )
    if longest > config.max_seq_len:
        raise ConfigError(
            f"--max-new-tokens={opts['max_new_tokens']}: the longest prompt plus it is {longest} tokens, "
            f"over the model's max_seq_len {config.max_seq_len}; use ≤ {config.max_seq_len - prompt}"
        )
    device = _device(opts, local_gpus)
    return {
        **opts,
        "device": device.device,
        "device_notice": device.notice,
        "tokenizer": spec,
        "texts": texts,
        "ids": ids,
        "eos_id": eos_id,
        "model_config": dataclasses.asdict(config),
    }


def worker(job: dict) -> None:
    """Every rank: build the (tensor-parallel) model, load the weights, generate, rank 0 reports."""
    from meshspeed.checkpoint.dcp import load_checkpoint
    from meshspeed.checkpoint.dirs import COMPLETE, CheckpointError, newest_verified
    from meshspeed.data.tokenizer import load_tokenizer
    from meshspeed.infer.generate import SamplingConfig, Stats
    from meshspeed.infer.parallel import build_inference_model, generate_parallel
    from meshspeed.interop.hf_import import HFCheckpoint, hf_recipe
    from meshspeed.models import ModelConfig, recipe_for

    ctx = comm.init(device=job.get("device", "auto"))  # resolve()'s choice, made before spawning
    mesh = comm.ParallelDims(tp=job["tp"], dp=job["dp"], pp=job["pp"]).build(ctx)
    if job.get("hf"):
        model, stages = build_inference_model(hf_recipe(HFCheckpoint(job["hf"], "--hf")), mesh)
    else:
        model, stages = build_inference_model(recipe_for(ModelConfig(**job["model_config"])), mesh)
        path = job["checkpoint"]
        if not os.path.isfile(os.path.join(path, COMPLETE)):  # a run directory: newest that verifies
            path, skipped = newest_verified(path, mesh)
            if path is None:
                raise CheckpointError(
                    f"--checkpoint={job['checkpoint']!r}: no checkpoint verifies ({skipped})"
                )
        load_checkpoint(path, model, None, mesh, restore_rng=False)
        model.eval()
    sampling = SamplingConfig(job["temperature"], job["top_k"], job["top_p"], job["seed"])
    stats = Stats()
    out = generate_parallel(
        model, job["ids"], mesh, max_new_tokens=job["max_new_tokens"], sampling=sampling,
        eos_id=job["eos_id"], stats=stats, stages=stages,
    )  # fmt: skip
    if ctx.rank == 0:
        tok = load_tokenizer(job["tokenizer"])
        chat, eos = job.get("chat"), job["eos_id"]
        # --chat: the answer's text without its end-of-turn token (the ids keep it)
        answers = [o[:-1] if chat and o and o[-1] == eos else o for o in out]
        rows = [
            {"prompt": p, "token_ids": o, "text": tok.decode(a)}
            for p, o, a in zip(job["texts"], out, answers, strict=True)
        ]
        for r in rows:
            print(f"user: {r['prompt']}\nassistant: {r['text']}\n" if chat else f"{r['prompt']}{r['text']}\n")
        if job.get("json"):
            with open(job["json"], "w") as f:
                json.dump({"outputs": rows}, f, indent=1)
        print(
            f"meshspeed generate: {stats.line()} "
            f"(rank 0 of {ctx.world_size} on {ctx.device.type}; dp replicas time their own share)"
        )
    ctx.close()
