"""The training loop: build the layout, the model, the optimizer and the data, then step.

Every layout trains on the same tokens per step (the loader's global batch is layout
independent and each data-parallel rank takes its slice), starts from the same weights (init
by parameter name) and follows the same learning-rate schedule (a function of the step), so a
float32 run's losses match across layouts and a resumed run matches an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import math
import os
import time

import torch

from meshspeed import comm
from meshspeed.checkpoint import dcp as ckpt
from meshspeed.checkpoint.export import export_safetensors
from meshspeed.comm import ConfigError
from meshspeed.data.tokenizer import load_tokenizer
from meshspeed.interop.hf_export import export_hf, source_hf_config
from meshspeed.interop.hf_import import source_recipe
from meshspeed.memory import chunked_model_loss, offload_optimizer, share_fp32_masters
from meshspeed.models import recipe_for
from meshspeed.models.flops import flops_per_token
from meshspeed.parallel.context import context_parallel
from meshspeed.parallel.materialize import build_parallel_model
from meshspeed.parallel.optim import build_data_parallel, clip_coefficient, grad_norm
from meshspeed.parallel.pipeline.layout import StageLayout
from meshspeed.parallel.tensor import loss_fn, token_ce_fn
from meshspeed.parallel.zero_prefetch import enable_zero_prefetch
from meshspeed.plan import config as config_mod
from meshspeed.plan.experts import apply_expert_parallel
from meshspeed.plan.run_plan import RunPlan, make_plan
from meshspeed.sparse.cuda import invalidate_compressed
from meshspeed.train import checkpointing, modules_run
from meshspeed.train.batches import make_loaders, packed_documents, prepare_rows, to_device  # noqa: F401
from meshspeed.train.experts import expert_load, replication_metrics, update_routing_bias
from meshspeed.train.flow_run import make_ema
from meshspeed.train.guards import NonFiniteError, check_bad  # noqa: F401  (NonFiniteError: re-exported)
from meshspeed.train.metrics import MetricsLogger, lr_at, peak_flops
from meshspeed.train.model_features import apply_model_features
from meshspeed.train.objectives import Scorer, make_objective
from meshspeed.train.pipeline import TrainerPipeline
from meshspeed.train.reference import Reference
from meshspeed.train.sparsity import build_sparsity

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class Trainer:
    def __init__(self, cfg: config_mod.Config, ctx: comm.CommContext, plan: RunPlan | None = None):
        """`plan`: the run plan the launcher resolved (plan/run_plan.py); made here, for this world
        size, when the trainer is used as a library without one."""
        self.cfg, self.ctx = cfg, ctx
        t, p = cfg.train, cfg.parallel
        self.plan = plan if plan is not None else make_plan(cfg, ctx.world_size, ranks=False)
        if plan is None:  # the caller's comm.init chose the device: meta.json records that one
            self.plan.device, self.plan.device_info["backend"] = ctx.device.type, ctx.backend
        if self.plan.world_size != ctx.world_size:
            raise ConfigError(
                f"the run plan is for {self.plan.world_size} ranks but {ctx.world_size} joined the job"
            )
        self.accum = self.plan.microbatches
        # [modules] (train/modules_run.py): the encoder's and the decoder's meshes; disaggregated,
        # the decoder's ModuleMesh is this trainer's mesh (the encoder's ranks run EncoderWorker)
        apart = bool(self.plan.modules) and self.plan.modules["mode"] == "disaggregated"
        self.mesh = None if apart else self.plan.parallel_dims().build(ctx)
        meshes = modules_run.module_meshes(self.plan, ctx) if self.plan.modules else None
        self.mesh = self.mesh or meshes[1]
        dp = self.mesh.dims.dp
        self.lead = ctx.rank == 0
        self.model_config = self.plan.model_config()
        init_weights = self.plan.weights  # model.init_from a meshspeed checkpoint: loaded once built
        if cfg.model.init_from and init_weights is None:
            # a Hugging Face (transformers or diffusers) directory: the recipe's init reads this
            # rank's slices of its files
            self.recipe = source_recipe(cfg.model.init_from, self.model_config)
        else:
            self.recipe = recipe_for(self.model_config)
        whole_recipe = self.recipe
        self.encoder = meshes and modules_run.EncoderSide(cfg, ctx, whole_recipe, *meshes, DTYPES[t.dtype])
        if meshes:  # this trainer's model is the decoder, embedding the encoder's rows
            self.recipe = modules_run.split_recipe(whole_recipe, "decoder", self.encoder)
        self.tokenizer = load_tokenizer(cfg.data.tokenizer)
        torch.manual_seed(t.seed)
        # Born sharded: built on the meta device, each rank materialises only its pieces.
        # pp > 1: this rank's stage model (other stages' layers deleted, FQNs kept) + the schedule's runtime
        # cp > 1: the attention cores see this rank's tokens only (its zigzag slice of each sequence)
        cp_args = (self.mesh, p.cp_impl, p.cp_ulysses, None, self.recipe.causal)  # dit: full attention
        self.cp = context_parallel(*cp_args) if p.cp > 1 else None

        def experts(model):  # ep > 1: this rank's block of experts, cut on meta (born sharded)
            apply_expert_parallel(model, self.mesh, cfg)

        self.objective = make_objective(cfg, self.model_config)
        self.pipeline = None
        if p.pp > 1:
            self.pipeline = TrainerPipeline(
                cfg,
                self.mesh,
                self.recipe,
                self.accum,
                ctx.device,
                self.layouts(),
                self.cp,
                experts,
                rows_per_record=self.objective.rows_per_record,
            )
            self.model = self.pipeline.model
        else:
            sp = p.sequence_parallel
            self.model = build_parallel_model(
                self.recipe,
                self.mesh,
                seed=t.seed,
                device=ctx.device,
                sequence_parallel=sp,
                transform=experts,
            )
        # tp overlap, fused kernels, cp cores, recompute, swap: in the order they compose
        self.features = apply_model_features(self.model, cfg, self.mesh, self.recipe, ctx.device, self.cp)
        for line in self.features.lines if self.lead else ():  # kernel choices: once, rank 0
            print(f"meshspeed: {line}", flush=True)
        m = cfg.memory

        def load_weights(model):  # model.init_from a meshspeed checkpoint
            if init_weights:
                mesh = getattr(self, "ckpt_mesh", self.mesh)  # [modules]: each module's own
                ckpt.load_checkpoint(init_weights, model, None, mesh, strict=False, restore_rng=False)

        # DPO's frozen reference: the starting weights in this layout, built before any update
        self.reference = Reference(self, experts, load_weights) if self.objective.needs_reference else None
        self.whole = modules_run.Both(self.model, self.encoder.model) if meshes else self.model
        self.ckpt_mesh = modules_run.Placement(self.mesh, self.encoder) if meshes else self.mesh
        load_weights(self.whole)  # before the optimizer copies the weights into its masters
        self.dp, self.opt = build_data_parallel(
            self.model,
            self.mesh,
            zero=p.zero,
            bucket_mb=p.bucket_mb,
            dtype=DTYPES[t.dtype],
            lr=t.lr,
            weight_decay=t.weight_decay,
            betas=(t.beta1, t.beta2),
            # cp ranks hold other tokens of the same samples: their gradients are summed like dp's
            group="dp_cp" if p.cp > 1 else "dp",
            units=self.recipe.pipeline.layers,  # zero=3: each block gathered on its own
        )
        if m.reuse_fp32_param:  # masters inside the bf16 parameters' storage, before anyone holds it
            share_fp32_masters(self.opt)
        if m.offload_optimizer:  # the optimizer state on the host between steps
            offload_optimizer(self.opt)
        # masks on the parallel model's weights (same Parameters); None when sparsity.pattern=none
        self.sparsity = build_sparsity(
            cfg.sparsity, self.model, self.opt, self.mesh, total_steps=t.steps, seed=t.seed
        )
        # ZeRO: step()'s parameter all-gather lands during the next forward (zero_prefetch.py);
        # sparsity reads the weights right after step(), so it keeps the blocking gather.
        self.prefetch = enable_zero_prefetch(self.dp) if p.zero_prefetch and self.sparsity is None else None
        if self.encoder:  # its own DataParallel and AdamW, joined to the decoder's
            self.encoder.build_optimizer(cfg)
            modules_run.join(self)
        self.loader, self.val_loader = make_loaders(cfg, self.tokenizer, self.mesh.coords["dp"], dp)
        if self.reference is not None and cfg.dpo.precompute_reference:
            self.reference = self.reference.precompute_loaders(self)  # then freed: None
        self.scorer = Scorer(
            ce=self._ce, token_ce=token_ce_fn(self.model), cp_group=self.mesh["cp"] if self.cp else None
        )
        if self.pipeline is not None:
            self.pipeline.set_objective(self.objective, self.scorer)
        self.ema = make_ema(self)  # flow.ema_decay > 0: the weights' average, in the optimizer's layout
        self.start_step = 0
        if cfg.checkpoint.resume:
            self.start_step = self._resume(cfg.checkpoint.resume)
        self.metrics = MetricsLogger(
            cfg.run.dir,
            t.steps,
            self.lead,
            cfg.run.log_interval,
            self.start_step,
            flops_per_token=flops_per_token(self.model_config, t.seq_len),
            peak=peak_flops(ctx.device, ctx.world_size, t.peak_tflops or None),  # None: MFU n/a
        )

    def layouts(self) -> list[StageLayout]:
        return [StageLayout(**{**s, "layers": tuple(s["layers"])}) for s in self.plan.stages]

    # ------------------------------------------------------------------------------------
    # checkpoints (train/checkpointing.py): `self.whole` is saved, the model or both modules
    def _resume(self, which: str) -> int:
        return checkpointing.resume(self, which)

    def _whole_weights(self):
        return checkpointing.whole_weights(self)

    def _save(self, step: int) -> str:
        return checkpointing.save(self, step)

    def item(self, batch: dict):
        """(micro-batch ready for the model on this rank, forward(model) on its rows): the
        objective's rows, this rank's cp slice, host-side counts, moved to the device."""
        if not self.objective.token_rows:  # images, timesteps, labels...: the objective runs them
            item = to_device(self.objective.rows(batch), self.ctx.device)
            if self.encoder:  # the decoder on the rows the seam delivers
                return item, self.encoder.forward(item, batch)
            return item, lambda model: self.objective.forward(model, item)
        rows, rope = prepare_rows(
            self.objective.rows(batch),
            cp=self.cp,
            packing_eot=self.tokenizer.eot,
            packing=self.cfg.data.packing,
        )
        extra = {k: v for k, v in batch.items() if k.startswith("ref_")}  # per-record values
        item = to_device({**extra, **rows}, self.ctx.device)
        rope = None if rope is None else rope.to(self.ctx.device)
        tokens, docs = item["tokens"], item.get("doc_ids")
        if rope is not None:
            return item, lambda model: model(tokens, positions=rope, doc_ids=docs)
        if docs is not None:
            return item, lambda model: model(tokens, doc_ids=docs)
        return item, lambda model: model(tokens)

    def _with_reference(self, micro: list[dict]) -> list:
        """[(item, forward)] for the step's micro-batches, the reference log-probabilities
        filled in (DPO, unless precomputed into the records)."""
        pairs = [self.item(b) for b in micro]
        if self.reference is not None and pairs and "ref_chosen_logps" not in pairs[0][0]:
            self.reference.logps([i for i, _ in pairs], [f for _, f in pairs])
        return pairs

    def micro_loss(self, item: dict, forward) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(objective loss, MoE aux loss, objective metrics or None) of one prepared micro-batch."""
        loss, metrics = self.objective.loss(lambda: forward(self.model), item, item, self.scorer)
        return loss, self.model.aux_loss(), metrics

    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss, aux) of one (tokens, targets) micro-batch (benchmarks and memory tests)."""
        self.scorer.replicas = 1
        loss, aux, _ = self.micro_loss(*self.item({"tokens": x, "labels": y}))
        return loss, aux

    def _ce(self, forward, y: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of forward()'s logits, or, with memory.chunked_loss, of the hidden
        states projected and scored chunk by chunk (the full logits never exist)."""
        m, head = self.cfg.memory, self.features.head  # head: train.fused_kernels' choice
        if not m.chunked_loss and head == "ref":  # the plain loss is compiled with train.compile
            return loss_fn(self.model, self.features.loss or self.recipe.loss)(forward(), y, -100)
        p = self.cfg.parallel
        sp = p.tp if p.sequence_parallel and p.tp > 1 else 1  # the head gathers each chunk's rows
        chunk = m.loss_chunk if m.chunked_loss else 0  # 0: kernels.linear_ce's chunk
        lf, impl = loss_fn(self.model, self.recipe.loss), "torch" if head == "ref" else head
        return chunked_model_loss(self.model, forward, y, lf, chunk, sp, impl=impl)

    @property
    def loss_dtype(self) -> torch.dtype:
        """Losses are summed and reduced in the compute dtype promoted to float32, on the
        backend's device: NCCL cannot reduce a CPU tensor, and some backends lack float64."""
        return torch.promote_types(DTYPES[self.cfg.train.dtype], torch.float32)

    def _mean_over_dp(self, total: torch.Tensor, n: int):
        """The mean over data-parallel ranks of total / n (tp and pp ranks hold the same value):
        a float, or a list for a vector (one all-reduce either way)."""
        t = (total.to(device=self.ctx.device, dtype=self.loss_dtype) / max(n, 1)).reshape(-1)
        t = comm.all_reduce(t, self.mesh["dp_cp" if self.cp is not None else "dp"], "avg")
        return t.item() if total.dim() == 0 else t.tolist()

    def _step_batches(self, loader, step: int) -> list:
        """This rank's micro-batches of `step`, prepared (_with_reference), with the objective's
        per-step state (SFT's global count) and the scorer's replica count set."""
        micro = loader.batches(step)
        if self.encoder:  # the encoder's share of the step's images; micro-batches numbered
            self.encoder.begin(loader, step, micro)
        self.objective.training, self.objective.step = loader is self.loader, step
        if self.objective.uses_global_batch:
            self.objective.prepare(loader.global_batch(step))
        self.scorer.replicas = len(micro) * self.mesh["dp_cp" if self.cp is not None else "dp"].size
        return self._with_reference(micro)

    def _metric_row(self, metrics, n: int, prefix: str = "") -> dict:
        if metrics is None or not self.objective.metric_names:
            return {}
        values = self._mean_over_dp(metrics, n)
        return {prefix + k: v for k, v in zip(self.objective.metric_names, values)}

    def train_step(self, step: int) -> dict:
        """One optimizer step; a step whose loss or gradient norm is not finite changes
        nothing (the row says "skipped"). Every rank takes the same decision: the gradient
        norm is reduced over the world, and the loss is equal on the ranks of one data-parallel
        replica (tp reduces it, pp broadcasts it) and then averaged over dp."""
        t = self.cfg.train
        lr = lr_at(step, lr=t.lr, warmup=t.warmup_steps, total=t.steps, min_ratio=t.min_lr_ratio)
        self.opt.set_lr(lr)
        t0 = time.perf_counter()
        micro = self._step_batches(self.loader, step)
        total = torch.zeros((), dtype=self.loss_dtype, device=self.ctx.device)
        metrics = None
        if self.pipeline is not None:  # the schedule runs every micro-batch's forward and backward
            total = self.pipeline.train_step([item for item, _ in micro], self.dp, step)
            if self.encoder:  # the encoder's backward on ranks whose rows stage 0 consumed elsewhere
                self.encoder.finish()
            metrics = self.pipeline.runtime.last_metrics
        else:
            for i, (item, forward) in enumerate(micro):
                last = i == len(micro) - 1
                with contextlib.nullcontext() if last else self.dp.no_sync():
                    loss, aux, m = self.micro_loss(item, forward)
                    # The global-batch loss is the mean of the micro-batch losses (the objective
                    # scales each so); DP averages ranks.
                    ((loss + aux) / len(micro)).backward()
                total += loss.detach().to(self.loss_dtype)
                if m is not None:
                    metrics = m.detach() if metrics is None else metrics + m.detach()
        self.dp.finish_grad_sync()
        mean_loss = self._mean_over_dp(total, len(micro))
        extra = self._metric_row(metrics, len(micro))
        norm = grad_norm(self.dp, self.mesh)
        # clipping's factor is applied inside the optimizer's kernel, not by a pass of its own
        coef = clip_coefficient(norm, t.grad_clip) if t.grad_clip > 0 else None
        norm = float(norm)
        finite = math.isfinite(mean_loss) and math.isfinite(norm)
        sparse = {}
        if finite:
            self.opt.step(clip_coef=coef)
            self.ema.update()  # the step's new weights into the average (a no-op when off)
            # DP writes weights through bucket views, which leave weight._version alone: the 2:4
            # compressed weights would go stale without this.
            invalidate_compressed(self.model)
            # mask updates read this step's reduced (STE) gradients: after step(), before zero_grad()
            sparse = self.sparsity.after_step(step) if self.sparsity is not None else {}
        if self.model_config.n_experts:  # DeepSeek-V3 routing bias (balance=bias); counts reset
            update_routing_bias(self.model, self.mesh["dp_cp"], apply=finite)
        self.opt.zero_grad()
        elapsed, tokens = time.perf_counter() - t0, self.objective.tokens_per_row or t.seq_len
        row = {
            "step": step,
            "loss": mean_loss,
            "lr": lr,
            "grad_norm": norm,
            "tokens_per_s": t.global_batch_size * self.objective.rows_per_record * tokens / elapsed,
            **extra,
            **sparse,
        }
        if self.model_config.n_experts:  # worst layer's max/mean tokens per expert, whole batch
            load = expert_load(self.model, self.mesh["dp_cp"]) or 0.0
            if self.mesh["pp"].size > 1:  # each stage holds its own layers
                load = torch.tensor([load], dtype=torch.float64, device=self.ctx.device)
                load = comm.all_reduce(load, self.mesh["pp"], "max")
                load = float(load[0])
            row["expert_load"] = load
            if self.cfg.moe.replicate_hot:  # what the hot-expert copies balanced and moved
                row.update(replication_metrics(self.model, self.mesh["pp"]))
        if not finite:
            row["skipped"] = True
        return row

    @torch.no_grad()
    def validate(self) -> float:
        """The validation loss (the objective's; its metrics in self.val_metrics)."""
        total, n, metrics = torch.zeros((), dtype=self.loss_dtype, device=self.ctx.device), 0, None
        for b in range(self.val_loader.num_batches):
            micro = self._step_batches(self.val_loader, b)
            if self.pipeline is not None:  # dp: ZeRO-3 gathers the stage
                total += self.pipeline.runtime.evaluate([i for i, _ in micro], self.dp).to(total)
                m = self.pipeline.runtime.last_metrics
                metrics = m if metrics is None or m is None else metrics + m
                n += len(micro)
                continue
            for item, forward in micro:
                loss, _, m = self.micro_loss(item, forward)
                total += loss.to(self.loss_dtype)
                metrics = m if metrics is None or m is None else metrics + m
                n += 1
        self.val_metrics = self._metric_row(metrics, n, prefix="val_")
        return self._mean_over_dp(total, n)

    def run(self) -> dict:
        t, c = self.cfg.train, self.cfg.checkpoint
        row = None
        last_ckpt = None
        tokens_per_s = []
        bad_in_row = skipped = 0
        for step in range(self.start_step, t.steps):
            row = self.train_step(step)
            done = step + 1
            bad_in_row = bad_in_row + 1 if row.get("skipped") else 0
            skipped += bool(row.get("skipped"))
            if skipped:
                row["skipped_steps"] = skipped  # counted for the whole run (this process)
            evaluate, saving, exiting = checkpointing.events(self.cfg, done)
            if evaluate:
                row["val_loss"] = self.validate()
                row.update(self.val_metrics)
            if step > self.start_step + 2:  # the first steps pay for warm-up, not steady state
                tokens_per_s.append(row["tokens_per_s"])
            self.metrics.log(row)
            if bad_in_row:
                check_bad(self.cfg.train, row, bad_in_row, self.lead)
            if saving:
                last_ckpt = self._save(done)
            if exiting:
                break
        summary = {
            "final_loss": row["loss"] if row else None,
            "val_loss": row.get("val_loss") if row else None,
            "tokens_per_s": sum(tokens_per_s) / len(tokens_per_s) if tokens_per_s else None,
            "mfu": self.metrics.mean_mfu(skip=3),  # the same steady-state steps as tokens_per_s
            "metrics": self.metrics.path,
            "checkpoint": last_ckpt,
            "skipped_steps": skipped,
        }
        with self._whole_weights() if c.export_safetensors or c.export_hf else contextlib.nullcontext():
            if c.export_safetensors:  # exports read the weights outside a forward
                summary["safetensors"] = export_safetensors(
                    self.whole, self.mesh, os.path.join(self.cfg.run.dir, "model.safetensors")
                )
            if c.export_hf and self.model_config.family != "vlm":  # a vlm's: the launcher converts
                summary["hf"] = export_hf(
                    self.whole,
                    self.mesh,
                    os.path.join(self.cfg.run.dir, "hf"),
                    self.model_config,
                    tokenizer_files=getattr(self.tokenizer, "files", list)(),
                    hf_extra=source_hf_config(self.cfg.model.init_from),
                )
        if self.lead:
            summary["plot"] = self.metrics.plot(os.path.join(self.cfg.run.dir, "loss.png"))
        self.metrics.close()
        return summary
