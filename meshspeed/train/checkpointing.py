"""The trainer's checkpoints: when a step validates, saves or exits, and saving and resuming a
trainer (or an encoder-only rank of a `[modules]` layout: train/modules_run.EncoderWorker, which
takes part in the same collectives with its own module). `trainer.whole` is what is saved: the
model, or both modules under their one-device FQNs."""

from __future__ import annotations

import contextlib
import dataclasses

from meshspeed.checkpoint import dcp as ckpt
from meshspeed.checkpoint.dirs import resume_path
from meshspeed.checkpoint.run_dir import check_resume
from meshspeed.comm import ConfigError
from meshspeed.comm.errors import echo


def events(cfg, done: int) -> tuple[bool, bool, bool]:
    """(validate, save, exit) after `done` steps."""
    t, c = cfg.train, cfg.checkpoint
    evaluate = bool(t.eval_interval and done % t.eval_interval == 0) or done == t.steps
    exiting = bool(t.exit_interval) and done % t.exit_interval == 0 and done < t.steps
    saving = bool(c.interval and done % c.interval == 0) or done == t.steps or exiting
    return evaluate, saving, exiting


def whole_weights(trainer):
    """Inside, every parameter holds its value, for reads and loads outside a forward:
    ZeRO-3 gathers them all (collective over dp), ZeRO-1/2's prefetched gather is waited for."""
    if trainer.dp.zero3 is not None:
        return trainer.dp.zero3.gathered()  # a load sets the shards through the optimizer
    if getattr(trainer, "prefetch", None) is not None:
        trainer.prefetch.wait()
    return contextlib.nullcontext()


def resume(trainer, which: str) -> int:
    """Load the checkpoint `which` names ('latest', 'auto' or a path: checkpoint.dirs.resume_path)
    and return its step (0: 'auto' found none)."""
    cfg, lead = trainer.cfg, trainer.lead
    mesh = getattr(trainer, "ckpt_mesh", trainer.mesh)  # [modules]: each tensor on its module's mesh
    path, verified = resume_path(which, cfg.run.dir, mesh, lead)
    if path is None:
        return 0
    if not cfg.checkpoint.allow_data_change:  # the same on every rank: rank 0 says it
        try:
            check_resume(path, cfg.to_dict(), trainer.model_config.vocab_size)
        except ConfigError as e:
            raise echo(e, not lead) from None
    with whole_weights(trainer):
        # disaggregated [modules]: a rank holds one module, as a pipeline stage holds its layers
        apart = trainer.plan.modules and trainer.plan.modules["mode"] == "disaggregated"
        state = ckpt.load_checkpoint(
            path, trainer.whole, trainer.opt, mesh, verify=not verified, strict=not apart
        )
    if getattr(trainer, "sparsity", None) is not None:
        trainer.sparsity.load_state_dict((state["extra"] or {}).get("sparsity"))
    if getattr(trainer, "ema", None) is not None:
        trainer.ema.load(state["extra"], lead)
    if lead:
        print(f"meshspeed: resumed from step {state['step']} ({state['path']})", flush=True)
    return int(state["step"])


def save(trainer, step: int) -> str:
    sparsity, ema = getattr(trainer, "sparsity", None), getattr(trainer, "ema", None)
    with whole_weights(trainer):  # the weights are read outside a forward
        return ckpt.save_checkpoint(
            trainer.cfg.run.dir,
            step,
            trainer.whole,
            trainer.opt,
            getattr(trainer, "ckpt_mesh", trainer.mesh),
            extra={
                "config": trainer.cfg.to_dict(),
                "model_config": dataclasses.asdict(trainer.model_config),
                **({"sparsity": sparsity.state_dict()} if sparsity else {}),
                **(ema.extra() if ema is not None else {}),  # collective: the EMA gathered whole
            },
            config=trainer.plan.to_dict(),  # meta.json records the resolved run plan
            keep=trainer.cfg.checkpoint.keep,
        )
