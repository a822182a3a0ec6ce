"""`meshspeed sample` resolved before any worker starts, then run on every rank.

As for `meshspeed generate` (infer/runner.py): the launcher side reads the checkpoint's model
config and checks every flag, so bad input costs one line before a worker exists; the workers
get plain data, build the model from that config (infer/parallel.build_inference_model, the
training recipe's layout), load the newest checkpoint that verifies, sample their share of the
request (dp over the batch) and rank 0 writes the PNGs.
"""

from __future__ import annotations

import dataclasses
import os
import time

from meshspeed import comm
from meshspeed.comm.errors import ConfigError

GRID_MIN_TILE = 64  # pixels: small images (8 × 8 digits) are scaled up in the grid to be seen


def parse_classes(text: str | None, n_classes: int, setting: str = "--classes") -> list[int]:
    """ "0,1,2" → [0, 1, 2], each in [0, n_classes); None or "" → every class (0..n_classes−1)."""
    if not text:
        return list(range(n_classes))
    if n_classes == 0:
        raise ConfigError(f"{setting}={text!r}: this model has no class labels (n_classes=0); leave it out")
    out = []
    for part in text.split(","):
        try:
            c = int(part.strip())
        except ValueError:
            c = -1
        if not 0 <= c < n_classes:
            raise ConfigError(
                f"{setting}={text!r}: {part.strip()!r} is not a class id; give comma-separated ids in "
                f"0..{n_classes - 1}, e.g. 0,1,2"
            )
        out.append(c)
    return out


def image_spec(config) -> tuple[tuple[int, int, int], int]:
    """((C, H, W), n_classes) of a 'dit' ModelConfig."""
    size = config.image_size
    return (config.in_channels, size, size), config.n_classes


def resolve(opts: dict, *, local_gpus: int | None = None) -> dict:
    """Checked, plain-data job description from the command's options (commands/sample.py)."""
    from meshspeed.comm.context import choose_device
    from meshspeed.comm.context import local_gpus as count_gpus
    from meshspeed.infer.diffusion import check_sampling
    from meshspeed.interop.model_source import checkpoint_model_config

    if bool(opts.get("run")) == bool(opts.get("checkpoint")):
        raise ConfigError("give exactly one of --run DIR (a training run) or --checkpoint PATH")
    setting, path = ("--run", opts["run"]) if opts.get("run") else ("--checkpoint", opts["checkpoint"])
    for flag in ("n", "nproc"):
        if opts[flag] < 1:
            raise ConfigError(f"--{flag}={opts[flag]} must be ≥ 1")
    check_sampling(opts["steps"], opts["sampler"], opts["guidance"])
    if os.path.isfile(opts["out"]):
        raise ConfigError(f"--out={opts['out']!r} is a file; name a directory for the PNGs")
    if not os.path.exists(path):
        raise ConfigError(f"{setting}={path!r} does not exist; give a run directory or a checkpoint")
    config = checkpoint_model_config(path, setting)
    if config.family != "dit":
        raise ConfigError(
            f"{setting}={path!r} holds a {config.family!r} model; meshspeed sample draws images from "
            "'dit' models (for text use meshspeed generate)"
        )
    shape, n_classes = image_spec(config)
    if opts.get("prompts"):
        # the stated model signature conditions on class ids; a text encoder is not wired in yet
        raise ConfigError(
            f"--prompts: text-conditioned sampling is not available yet (this model: "
            f"text_dim={config.text_dim}, n_classes={n_classes}); give --classes"
        )
    classes = parse_classes(opts.get("classes"), n_classes)
    labels = [c for c in (classes or [0]) for _ in range(opts["n"])]  # n images per class, grouped
    if opts.get("score") and (shape != (1, 8, 8) or n_classes != 10):
        raise ConfigError(
            f"--score: the digit classifier scores 1×8×8 images of 10 classes; this model makes "
            f"{'×'.join(map(str, shape))} images of {n_classes} classes"
        )
    gpus = count_gpus() if local_gpus is None else local_gpus
    device = choose_device(
        opts.get("device") or "auto", opts["nproc"], gpus, key="--run.device", fix=f"add --nproc {gpus}"
    )
    return {
        **{k: v for k, v in opts.items() if k != "func"},
        "path": path,
        "setting": setting,
        "device": device.device,
        "device_notice": device.notice,
        "model_config": dataclasses.asdict(config),
        "shape": list(shape),
        "labels": labels,
        "per_class": opts["n"] if classes else len(labels),
        # the null class is the unconditional branch; a model without labels has none to drop to
        "null_class": n_classes if n_classes > 0 else None,
    }


def write_images(images, labels: list[int], out: str, per_row: int) -> list[str]:
    """sample-IIII-cC.png per image and grid.png (one row per class) under `out`."""
    from meshspeed.data.images import grid, save_png, to_uint8

    os.makedirs(out, exist_ok=True)
    paths = []
    for i, (im, c) in enumerate(zip(to_uint8(images), labels, strict=True)):
        paths.append(os.path.join(out, f"sample-{i:04d}-c{c}.png"))
        save_png(im, paths[-1])
    scale = max(1, GRID_MIN_TILE // max(images.shape[2:]))
    save_png(grid(images, cols=per_row, scale=scale), os.path.join(out, "grid.png"))
    return paths


def sample_and_report(model, job: dict, mesh, rank: int) -> dict | None:
    """Sample the request (dp over mesh), and on rank 0 write the PNGs and print the lines.
    Returns (rank 0) {"images", "labels", "seconds", "score"} for callers and tests."""
    import torch

    from meshspeed.infer.diffusion import SampleStats, sample_parallel

    stats = SampleStats()
    labels = torch.tensor(job["labels"], dtype=torch.long)
    start = time.perf_counter()
    images = sample_parallel(
        model, labels, tuple(job["shape"]), mesh, stats=stats, steps=job["steps"], sampler=job["sampler"],
        guidance=job["guidance"], seed=job["seed"], null_class=job["null_class"],
    )  # fmt: skip
    wall = time.perf_counter() - start
    if rank != 0:
        return None
    write_images(images, job["labels"], job["out"], job["per_class"])
    dp = job.get("nproc", 1)
    print(
        f"meshspeed sample: wrote {len(job['labels'])} PNGs and grid.png to {job['out']} "
        f"({job['sampler']}, {job['steps']} steps, guidance {job['guidance']:g}, seed {job['seed']}; "
        f"{job.get('weights', 'the trained weights')})"
    )
    print(
        f"meshspeed sample: {stats.line(len(job['labels']))} sampling, {wall:.2f} s with the "
        f"gather (dp {dp}, {mesh.ctx.device.type if mesh is not None else 'cpu'})"
    )
    score = None
    if job.get("score"):
        from meshspeed.data.digits_quality import score_samples

        score = score_samples(images, labels)
        print(
            f"meshspeed sample: the digit classifier recognises {score['accuracy']:.1%} of "
            f"{score['n']} samples as their class (noise: 10%), FID {score['fid']:.2f}"
        )
    return {"images": images, "labels": labels, "seconds": wall, "score": score}


def load_model(job: dict, mesh):
    """The 'dit' model of job's config on this rank, with the newest verified checkpoint."""
    from meshspeed.checkpoint.dcp import load_checkpoint
    from meshspeed.checkpoint.dirs import COMPLETE, CheckpointError, newest_verified
    from meshspeed.infer.parallel import build_inference_model
    from meshspeed.models import ModelConfig, recipe_for

    model, _ = build_inference_model(recipe_for(ModelConfig(**job["model_config"])), mesh)
    path = job["path"]
    if not os.path.isfile(os.path.join(path, COMPLETE)):  # a run directory: newest that verifies
        path, skipped = newest_verified(path, mesh)
        if path is None:
            raise CheckpointError(f"{job['setting']}={job['path']!r}: no checkpoint verifies ({skipped})")
    state = load_checkpoint(path, model, None, mesh, restore_rng=False)
    ema = (state["extra"] or {}).get("ema")  # a flow run's EMA (train/flow_run.py): whole tensors
    job["weights"] = "the trained weights"
    if ema is not None and not job.get("no_ema"):
        load_ema(model, ema["weights"])
        job["weights"] = f"the EMA of the weights (decay {ema['decay']:g}, {ema['updates']} updates)"
    return model.eval()


def load_ema(model, weights: dict) -> None:
    """Copy a checkpoint's EMA (whole tensors by name) into a dp-only model's parameters."""
    import torch

    params = dict(model.named_parameters())
    missing = sorted(set(params) ^ set(weights))
    if missing:
        raise ConfigError(
            f"the checkpoint's EMA does not match the model ({missing[0]}); sample with --no-ema"
        )
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(weights[name].to(p))


def after_training(cfg) -> dict | None:
    """The end of `meshspeed train` on a dit run (commands/train.py calls it in the launcher once
    the workers are done; train/ never imports infer/): flow.sample_n images of every class from
    the final checkpoint (its EMA when kept) in this process, the PNGs under run.dir/samples,
    the grid copied to run.dir/samples.png beside loss.png, and for digits-shaped models the
    classifier's accuracy and FID printed and written to run.dir/samples/score.json."""
    import json
    import shutil

    f, out = cfg.flow, os.path.join(cfg.run.dir, "samples")
    opts = {
        "run": cfg.run.dir, "checkpoint": None, "classes": None, "prompts": None, "n": f.sample_n,
        "steps": f.sample_steps, "sampler": "euler", "guidance": f.sample_guidance, "seed": 0,
        "out": out, "score": False, "nproc": 1, "device": cfg.run.device,
    }  # fmt: skip
    job = resolve(opts)
    job["score"] = job["shape"] == [1, 8, 8] and len(set(job["labels"])) == 10  # the digits' classifier
    ctx = comm.init(device=job["device"])
    try:
        mesh = comm.ParallelDims(dp=1).build(ctx)
        result = sample_and_report(load_model(job, mesh), job, mesh, ctx.rank)
    finally:
        ctx.close()
    shutil.copyfile(os.path.join(out, "grid.png"), os.path.join(cfg.run.dir, "samples.png"))
    if result["score"] is not None:
        with open(os.path.join(out, "score.json"), "w") as fh:
            json.dump({**result["score"], "guidance": f.sample_guidance, "steps": f.sample_steps}, fh)
    return result


def worker(job: dict) -> None:
    """Every rank: build and load the model, sample its share, rank 0 writes and reports."""
    ctx = comm.init(device=job.get("device", "auto"))
    mesh = comm.ParallelDims(dp=ctx.world_size).build(ctx)
    model = load_model(job, mesh)
    sample_and_report(model, job, mesh, ctx.rank)
    ctx.close()
