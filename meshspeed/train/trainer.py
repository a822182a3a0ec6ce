"""The training loop: build the layout, the model, the optimizer and the data, then step.

Every layout trains on the same tokens per step (the loader's global batch is layout
independent and each data-parallel rank takes its slice), starts from the same weights (init
by parameter name) and follows the same learning-rate schedule (a function of the step), so a
float32 run's losses match across layouts and a resumed run matches an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import os
import time

import torch

from meshspeed import comm
from meshspeed.comm import ConfigError, ParallelDims
from meshspeed.models import get_preset, recipe_for
from meshspeed.parallel.optim import build_data_parallel
from meshspeed.parallel.optim import clip_grad_norm_, grad_norm
from meshspeed.parallel.materialize import build_parallel_model
from meshspeed.parallel.tensor import model_loss
from meshspeed.train import checkpoint as ckpt
from meshspeed.train import config as config_mod
from meshspeed.train.data import GlobalBatchLoader, ValidationLoader, load_tokens
from meshspeed.train.export import export_safetensors
from meshspeed.train.metrics import MetricsLogger, lr_at
from meshspeed.train.pipeline import TrainerPipeline
from meshspeed.train.sparsity import build_sparsity

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def from_dict(d: dict) -> config_mod.Config:
    cfg = config_mod.Config()
    for section, values in d.items():
        if isinstance(values, dict):
            setattr(cfg, section, type(getattr(cfg, section))(**values))
        else:
            setattr(cfg, section, values)
    return cfg


class Trainer:
    def __init__(self, cfg: config_mod.Config, ctx: comm.CommContext):
        self.cfg, self.ctx = cfg, ctx
        t, p = cfg.train, cfg.parallel
        dp, self.accum = config_mod.resolve_layout(cfg, ctx.world_size)
        self.mesh = ParallelDims(dp=dp, pp=p.pp, tp=p.tp).build(ctx)
        self.lead = ctx.rank == 0
        overrides = cfg.model.overrides()
        base = get_preset(cfg.model.preset, **overrides)
        if t.seq_len > base.max_seq_len:
            base = get_preset(cfg.model.preset, **overrides, max_seq_len=t.seq_len)
        self.model_config = base
        self.recipe = recipe_for(base)
        torch.manual_seed(t.seed)
        # Born sharded: built on the meta device, each rank materialises only its pieces.
        # pp > 1: this rank's stage model (other stages' layers deleted, FQNs kept) + the schedule's runtime
        self.pipeline = TrainerPipeline(cfg, self.mesh, self.recipe, self.accum, ctx.device) if p.pp > 1 else None
        if self.pipeline is not None:
            self.model = self.pipeline.model
        else:
            self.model = build_parallel_model(self.recipe, self.mesh, seed=t.seed, device=ctx.device,
                                              sequence_parallel=p.sequence_parallel)
        self.dp, self.opt = build_data_parallel(
            self.model, self.mesh, zero=p.zero, bucket_mb=p.bucket_mb, dtype=DTYPES[t.dtype], lr=t.lr,
            weight_decay=t.weight_decay, betas=(t.beta1, t.beta2))
        # masks on the parallel model's weights (same Parameters); None when sparsity.pattern=none
        self.sparsity = build_sparsity(cfg.sparsity, self.model, self.opt, self.mesh, total_steps=t.steps, seed=t.seed)
        train_tokens, val_tokens = load_tokens(cfg.data.path, cfg.data.format, max_mb=cfg.data.max_mb)
        coords = self.mesh.coords
        self.loader = GlobalBatchLoader(train_tokens, t.seq_len, t.global_batch_size, t.micro_batch_size,
                                        dp_rank=coords["dp"], dp_size=dp, seed=t.seed)
        self.val_loader = ValidationLoader(val_tokens, t.seq_len, t.global_batch_size, t.micro_batch_size,
                                           dp_rank=coords["dp"], dp_size=dp, max_batches=t.eval_batches)
        self.start_step = 0
        if cfg.checkpoint.resume:
            self.start_step = self._resume(cfg.checkpoint.resume)
        self.metrics = MetricsLogger(cfg.run.dir, t.steps, self.lead, cfg.run.log_interval, self.start_step)

    # ------------------------------------------------------------------------------------
    def _resume(self, which: str) -> int:
        path = ckpt.latest_checkpoint(self.cfg.run.dir) if which == "latest" else which
        if path is None:
            raise ConfigError(f"checkpoint.resume=latest but {self.cfg.run.dir} holds no complete checkpoint; "
                              f"drop --checkpoint.resume or point --run.dir at the earlier run")
        state = ckpt.load_checkpoint(path, self.model, self.opt, self.mesh)
        if self.sparsity is not None:
            self.sparsity.load_state_dict((state["extra"] or {}).get("sparsity"))
        return int(state["step"])

    def _save(self, step: int) -> str:
        return ckpt.save_checkpoint(self.cfg.run.dir, step, self.model, self.opt, self.mesh,
                                    extra={"config": self.cfg.to_dict(),
                                           **({"sparsity": self.sparsity.state_dict()} if self.sparsity else {})},
                                    keep=self.cfg.checkpoint.keep)

    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = x.to(self.ctx.device), y.to(self.ctx.device)
        loss = model_loss(self.model, x, y, aux=False, plain=self.recipe.loss)  # the cross-entropy: what metrics report
        return loss, self.model.aux_loss()

    def train_step(self, step: int) -> dict:
        t = self.cfg.train
        lr = lr_at(step, lr=t.lr, warmup=t.warmup_steps, total=t.steps, min_ratio=t.min_lr_ratio)
        self.opt.set_lr(lr)
        t0 = time.perf_counter()
        micro = list(self.loader.batches(step))
        total = torch.zeros((), dtype=torch.float64)
        if self.pipeline is not None:  # the schedule runs every micro-batch's forward and backward
            total = self.pipeline.train_step(micro, self.dp, step)
        else:
            for i, (x, y) in enumerate(micro):
                last = i == len(micro) - 1
                with (contextlib.nullcontext() if last else self.dp.no_sync()):
                    loss, aux = self._loss(x, y)
                    # The global-batch loss is the mean of the micro-batch means; DP averages ranks.
                    ((loss + aux) / len(micro)).backward()
                total += loss.detach().double().cpu()
        self.dp.finish_grad_sync()
        norm = clip_grad_norm_(self.dp, t.grad_clip, self.mesh) if t.grad_clip > 0 else grad_norm(self.dp, self.mesh)
        self.opt.step()
        # mask updates read this step's reduced (STE) gradients: after step(), before zero_grad()
        sparse = self.sparsity.after_step(step) if self.sparsity is not None else {}
        self.opt.zero_grad()
        mean_loss = comm.all_reduce(total / len(micro), self.mesh["dp"], "avg").item()
        elapsed = time.perf_counter() - t0
        return {"step": step, "loss": mean_loss, "lr": lr, "grad_norm": float(norm),
                "tokens_per_s": t.global_batch_size * t.seq_len / elapsed, **sparse}

    @torch.no_grad()
    def validate(self) -> float:
        if self.pipeline is not None:
            return self.pipeline.validate(self.val_loader)
        total, n = torch.zeros((), dtype=torch.float64), 0
        for b in range(self.val_loader.num_batches):
            for x, y in self.val_loader.batches(b):
                loss, _ = self._loss(x, y)
                total += loss.double().cpu()
                n += 1
        return comm.all_reduce(total / max(n, 1), self.mesh["dp"], "avg").item()

    def run(self) -> dict:
        t, c = self.cfg.train, self.cfg.checkpoint
        row = None
        last_ckpt = None
        tokens_per_s = []
        for step in range(self.start_step, t.steps):
            row = self.train_step(step)
            done = step + 1
            if (t.eval_interval and done % t.eval_interval == 0) or done == t.steps:
                row["val_loss"] = self.validate()
            if step > self.start_step + 2:  # the first steps pay for warm-up, not steady state
                tokens_per_s.append(row["tokens_per_s"])
            self.metrics.log(row)
            exiting = bool(t.exit_interval) and done % t.exit_interval == 0 and done < t.steps
            if (c.interval and done % c.interval == 0) or done == t.steps or exiting:
                last_ckpt = self._save(done)
            if exiting:
                break
        summary = {"final_loss": row["loss"] if row else None, "val_loss": row.get("val_loss") if row else None,
                   "tokens_per_s": sum(tokens_per_s) / len(tokens_per_s) if tokens_per_s else None,
                   "metrics": self.metrics.path, "checkpoint": last_ckpt}
        if c.export_safetensors:
            summary["safetensors"] = export_safetensors(self.model, self.mesh,
                                                             os.path.join(self.cfg.run.dir, "model.safetensors"))
        if self.lead:
            summary["plot"] = self.metrics.plot(os.path.join(self.cfg.run.dir, "loss.png"))
        self.metrics.close()
        return summary


def _print_summary(cfg: config_mod.Config, trainer: Trainer, s: dict) -> None:
    p = trainer.mesh.dims
    print(f"\nmeshspeed train: {cfg.model.preset} ({sum(x.numel() for x in trainer.model.parameters()):,} local params) "
          f"on {trainer.ctx.world_size} ranks: {f'pp {p.pp} × ' if p.pp > 1 else ''}dp {p.dp} × tp {p.tp}, zero {cfg.parallel.zero}, "
          f"{cfg.train.dtype}")
    if s["final_loss"] is not None:
        val = f", val loss {s['val_loss']:.4f}" if s["val_loss"] is not None else ""
        print(f"  final train loss {s['final_loss']:.4f}{val}")
    if s["tokens_per_s"]:
        print(f"  {s['tokens_per_s']:,.0f} tokens/s (mean over steady-state steps)")
    print(f"  metrics     {s['metrics']}")
    if s.get("plot"):
        print(f"  loss curve  {s['plot']}")
    if s["checkpoint"]:
        print(f"  checkpoint  {s['checkpoint']}")
    if trainer.pipeline is not None and trainer.pipeline.trace_files:
        print(f"  pp trace    {', '.join([trainer.pipeline.trace_files['json']] + trainer.pipeline.trace_files['png'])}")
    if s.get("safetensors"):
        print(f"  safetensors {s['safetensors']}")


def worker(cfg_dict: dict) -> None:
    """Runs on every rank (spawned by `meshspeed train` or under torchrun)."""
    cfg = from_dict(cfg_dict)
    ctx = comm.init()
    try:
        trainer = Trainer(cfg, ctx)
        summary = trainer.run()
        if trainer.lead:
            _print_summary(cfg, trainer, summary)
    finally:
        ctx.close()

