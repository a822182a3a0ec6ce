"""One training run as a job: the run directory's policy, the per-rank entry point, the summary.

Beside trainer.py (which is the loop itself): what happens around the loop when the CLI
runs it, on a laptop (meshspeed's launcher) or under torchrun.

- A new run never mixes its outputs with an earlier run's: a run.dir holding checkpoints or
  metrics needs `--checkpoint.resume` (latest / auto / a path) or `--run.overwrite true`, which
  deletes only what meshspeed's manifests list (checkpoint/run_dir.py). One run at a time owns
  a run.dir (checkpoint/lock.py): the launcher, or rank 0 under torchrun, holds its lock.
- After a torchrun restart (TORCHELASTIC_RESTART_COUNT > 0) the run dir holds the progress of
  the attempt that died, and `run.overwrite` resumes it instead of deleting it.
- A rank that fails exits at once with a one-line report (comm.launch.run_worker), without
  waiting for its peers in a barrier; only a rank that succeeded closes the job.
"""

from __future__ import annotations

import os
import sys

from meshspeed import comm
from meshspeed.checkpoint.lock import RunDirLock
from meshspeed.checkpoint.run_dir import claim_run_dir, export_names
from meshspeed.comm.errors import echo
from meshspeed.plan import config as config_mod


def from_dict(d: dict) -> config_mod.Config:
    cfg = config_mod.Config()
    for section, values in d.items():
        if isinstance(values, dict):
            setattr(cfg, section, type(getattr(cfg, section))(**values))
        else:
            setattr(cfg, section, values)
    return cfg


def restart_count() -> int:
    """How many times torchrun's agent has restarted the workers (0 on the first attempt)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def prepare_run_dir(cfg: config_mod.Config, *, lead: bool) -> None:
    """Apply the run-directory policy before any worker joins the job (so no rank can have
    written anything yet): refuse an occupied run.dir, or clear it for `run.overwrite` (only
    the `lead` process deletes). After a torchrun restart, overwrite means resume (auto)."""
    run, ck = cfg.run, cfg.checkpoint
    if run.overwrite and restart_count() > 0:
        run.overwrite, ck.resume = False, "auto"  # never delete the progress a restart resumes
        if lead:
            print(
                f"meshspeed: torchrun restart {restart_count()}: resuming in {run.dir} instead of "
                f"overwriting it",
                file=sys.stderr,
                flush=True,
            )
    c = cfg.checkpoint
    exports = export_names(c.export_safetensors, c.export_hf, cfg.parallel.pp)
    removed = claim_run_dir(
        run.dir, resume=bool(ck.resume), overwrite=run.overwrite, exports=exports, lead=lead
    )
    if removed:
        print(
            f"meshspeed: run.overwrite=true: deleted {len(removed)} earlier output(s) in {run.dir}",
            file=sys.stderr,
            flush=True,
        )


def print_summary(cfg: config_mod.Config, trainer, s: dict) -> None:
    from meshspeed.plan.modules import describe as describe_modules

    p = trainer.mesh.dims
    n = sum(x.numel() for x in trainer.model.parameters())
    pp = f"pp {p.pp} × " if p.pp > 1 else ""
    cp = f"cp {p.cp} ({cfg.parallel.cp_impl}) × " if p.cp > 1 else ""
    print(
        f"\nmeshspeed train: {cfg.model.preset} ({n:,} local params) on {trainer.ctx.world_size} ranks: "
        f"{pp}dp {p.dp} × {cp}tp {p.tp}{f' (ep {p.ep})' if p.ep > 1 else ''}, zero {cfg.parallel.zero}, "
        f"{cfg.train.dtype}"
    )
    if trainer.plan.modules:  # [modules]: the line above is the decoder's layout
        print("  " + describe_modules(trainer.plan.modules)[0].strip())
    if s["final_loss"] is not None:
        val = f", val loss {s['val_loss']:.4f}" if s["val_loss"] is not None else ""
        print(f"  final train loss {s['final_loss']:.4f}{val}")
    if s.get("skipped_steps"):
        print(f"  skipped     {s['skipped_steps']} step(s) with a non-finite loss or gradient norm")
    if s["tokens_per_s"]:
        print(f"  {s['tokens_per_s']:,.0f} tokens/s (mean over steady-state steps)")
    if "mfu" in s:
        mfu = "n/a (peak unknown: set --train.peak_tflops)" if s["mfu"] is None else f"{s['mfu']:.1%}"
        print(f"  MFU         {mfu}")
    print(f"  metrics     {s['metrics']}")
    if s.get("plot"):
        print(f"  loss curve  {s['plot']}")
    if s["checkpoint"]:
        print(f"  checkpoint  {s['checkpoint']}")
    if trainer.pipeline is not None and trainer.pipeline.trace_files:
        files = trainer.pipeline.trace_files
        print(f"  pp trace    {', '.join([files['json']] + files['png'])}")
    if s.get("safetensors"):
        print(f"  safetensors {s['safetensors']}")
    if s.get("hf"):
        print(f"  hugging face {s['hf']}")


def worker(plan_dict: dict, prepared: bool = False) -> None:
    """Runs on every rank (spawned by `meshspeed train` or under torchrun), given the run plan
    (plan/run_plan.py) as plain data. `prepared`: the launcher already applied the run-directory
    policy."""
    from meshspeed.plan.run_plan import RunPlan
    from meshspeed.train.modules_run import EncoderWorker, encoder_only
    from meshspeed.train.trainer import Trainer

    plan = RunPlan.from_dict(plan_dict)
    cfg = from_dict(plan.config)
    lock = None  # rank 0's hold on run.dir, released when this process ends (the launcher holds its own)
    if not prepared:  # under torchrun: every rank checks, rank 0 clears; nobody has joined yet
        try:
            if os.environ.get("RANK", "0") == "0":
                lock = RunDirLock(cfg.run.dir).acquire()
            prepare_run_dir(cfg, lead=os.environ.get("RANK", "0") == "0")
        except comm.ConfigError as err:
            raise echo(err, os.environ.get("RANK", "0") != "0")  # the same on every rank
    ctx = comm.init(timeout_s=cfg.run.timeout or None, device=plan.device)  # the plan's choice
    # [modules] disaggregated: the encoder's own ranks run its loop (train/modules_run.py)
    trainer = (EncoderWorker if encoder_only(plan, ctx) else Trainer)(cfg, ctx, plan)
    summary = trainer.run()
    if trainer.lead:
        print_summary(cfg, trainer, summary)
    ctx.close()
    if lock is not None:
        lock.release()
