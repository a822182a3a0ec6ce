"""`meshspeed eval`: the loss and perplexity of a checkpoint on a text or token file, under any
layout.

It runs the trainer's own validation (`Trainer.validate`: the same loader, the same held-out
tokens, the same mean of per-batch means, through the pipeline runtime when pp > 1), with the
weights loaded through `model.init_from`, so its loss is the trainer's validation loss on the
same data by construction, not by a second implementation that could drift.

Settings default to those the checkpoint's run recorded (data, sequence length, batch sizes,
eval batches, dtype, seed, layout), and any `--section.key` overrides them: evaluate the same
checkpoint on another file or under another layout.
"""

from __future__ import annotations

import json
import math
import os
import tempfile

from meshspeed import comm
from meshspeed.comm import ConfigError

# What the run recorded that decides what validation sees; run/checkpoint settings are the
# evaluation's own (a scratch run.dir, no resume, no export).
RECORDED = ("parallel", "train", "data")


def eval_overrides(checkpoint: str) -> list[tuple[str, str]]:
    """The recorded run's settings as `section.key` overrides (empty for a checkpoint that
    records none, e.g. one written by `meshspeed convert`)."""
    from meshspeed.checkpoint.dirs import CheckpointError
    from meshspeed.interop.hf_import import is_hf_dir
    from meshspeed.interop.model_source import checkpoint_state

    if is_hf_dir(checkpoint):
        return []
    try:
        _, state = checkpoint_state(checkpoint)
    except (CheckpointError, OSError) as e:
        raise ConfigError(f"--checkpoint={checkpoint!r} is not a meshspeed checkpoint: {e}") from None
    run = (state.get("extra") or {}).get("config") or {}
    out = [("nproc", str(run["nproc"]))] if run.get("nproc") else []
    for section in RECORDED:
        for key, value in (run.get(section) or {}).items():
            if section == "model":
                continue  # the architecture comes from the checkpoint itself
            out.append((f"{section}.{key}", str(value)))
    return out


def eval_config(checkpoint: str, config_file: str | None, overrides: list[tuple[str, str]]):
    """The Config to evaluate with: recorded settings < --config file < command-line overrides,
    the weights from `checkpoint`, one step's worth of scratch state in a temporary run.dir."""
    from meshspeed.plan import config

    scratch = tempfile.mkdtemp(prefix="meshspeed-eval-")
    fixed = [
        ("model.init_from", checkpoint),
        ("run.dir", scratch),
        ("checkpoint.resume", ""),
        ("checkpoint.export_hf", "false"),
        ("checkpoint.export_safetensors", "false"),
        ("sparsity.pattern", "none"),  # masked weights are stored masked; nothing to re-mask
    ]
    if config_file:
        return config.load(config_file, overrides + fixed)
    return config.load(None, eval_overrides(checkpoint) + overrides + fixed)


def worker(plan_dict: dict, out_json: str | None) -> None:
    """Every rank: build the model the plan says, load the weights, run the validation; rank 0
    prints (and writes `out_json`)."""
    from meshspeed.plan.run_plan import RunPlan
    from meshspeed.train.job import from_dict
    from meshspeed.train.trainer import Trainer

    plan = RunPlan.from_dict(plan_dict)
    cfg = from_dict(plan.config)
    ctx = comm.init(timeout_s=cfg.run.timeout or None, device=plan.device)  # the plan's choice
    trainer = Trainer(cfg, ctx, plan)
    loss = trainer.validate()
    t = cfg.train
    tokens = trainer.val_loader.num_batches * t.global_batch_size * t.seq_len
    if trainer.lead:
        result = {
            "checkpoint": cfg.model.init_from,
            "loss": loss,
            "perplexity": math.exp(loss) if loss < 700 else math.inf,
            "tokens": tokens,
            "batches": trainer.val_loader.num_batches,
            "layout": plan.dims,
            "device": ctx.device.type,
        }
        print(
            f"meshspeed eval: loss {loss:.6f}, perplexity {result['perplexity']:.4f} over {tokens:,} "
            f"tokens ({result['batches']} batches of {t.global_batch_size} × {t.seq_len}) on "
            f"{ctx.world_size} rank(s) on {ctx.device.type}"
        )
        if out_json:
            with open(out_json, "w") as f:
                json.dump(result, f, indent=1)
    trainer.metrics.close()
    ctx.close()
    if trainer.lead:
        _clean(cfg.run.dir)


def _clean(scratch: str) -> None:
    import shutil

    if os.path.basename(scratch).startswith("meshspeed-eval-"):
        shutil.rmtree(scratch, ignore_errors=True)
