"""Pipeline parallelism in the trainer: start-up checks, building the stages, the step.

The trainer keeps its shape: with parallel.pp > 1 its model is this rank's *stage model*
(the single-device Transformer with the layers other stages hold deleted, FQNs unchanged), so
data parallelism, the optimizer, clipping and checkpoints work on it unchanged; only the
micro-batch loop and validation go through the pipeline runtime. Micro-batches per step =
global_batch_size / (micro_batch_size * dp), as without pipelining.
"""

from __future__ import annotations

import os

import torch

from meshspeed.memory import chunked_model_loss
from meshspeed.parallel.tensor import loss_fn


class TrainerPipeline:
    """This rank's stages and runtime, plus what the trainer's step and validation need."""

    def __init__(
        self,
        cfg,
        mesh,
        recipe,
        microbatches: int,
        device,
        layouts=None,
        cp=None,
        transform=None,
        rows_per_record=1,
    ):
        """cp: the context-parallel core (parallel/context.py) when parallel.cp > 1: the trainer
        cuts micro-batches to this rank's slice of each sequence, and its positions feed RoPE.
        transform: applied to the stage model on meta before its weights are materialised
        (experts). rows_per_record: sequences the model runs per record (DPO's pairs: 2)."""
        from meshspeed.parallel.pipeline.runtime import PipelineRuntime
        from meshspeed.parallel.pipeline.schedules import get_schedule
        from meshspeed.parallel.pipeline.stage import build_stages

        p, t = cfg.parallel, cfg.train
        self.cfg, self.mesh = cfg, mesh
        self.stages = build_stages(
            recipe,
            mesh,
            vpp=p.vpp,
            layout=p.pp_layout,
            seed=t.seed,
            device=device,
            sequence_parallel=p.sequence_parallel,
            layouts=layouts,
            transform=transform,
            placement=get_schedule(p.pp_schedule).placement,  # where layouts is None (a library caller)
        )
        self.model = self.stages.model
        seq = recipe.pipeline.seq_len or t.seq_len  # a dit's stages pass its image tokens
        self.runtime = PipelineRuntime(
            self.stages,
            mesh,
            p.pp_schedule,
            microbatches,
            micro_batch_size=t.micro_batch_size * rows_per_record,
            seq_len=seq,
            sequence_parallel=p.sequence_parallel,
            trace=p.pp_trace,
            positions=None if cp is None else cp.positions(seq),
            overlap=p.pp_overlap,
        )
        if cfg.memory.chunked_loss and self.stages.has_head:
            lf = loss_fn(self.model, recipe.loss)
            sp = p.tp if p.sequence_parallel and p.tp > 1 else 1
            chunk = cfg.memory.loss_chunk
            self.runtime.last_loss = lambda forward, y: chunked_model_loss(
                self.model, forward, y, lf, chunk, sp
            )
        self.trace_files: dict | None = None

    def set_objective(self, objective, scorer) -> None:
        """The last stage's loss is the objective's (train/objectives); language modelling keeps
        the runtime's own cross-entropy (and memory.chunked_loss's head swap)."""
        if objective.name == "lm":
            return
        self.runtime.objective = lambda forward, item: objective.loss(forward, item, item, scorer)
        self.runtime.n_metrics = len(objective.metric_names)

    def train_step(self, micro, dp, step: int) -> torch.Tensor:
        """Sum over this rank's micro-batches (batch dicts, already this rank's cp slice) of the
        loss (float64, CPU; same on all pp ranks); the trainer moves it to the backend's device
        before reducing over dp."""
        total = self.runtime.train_step(micro, dp)
        if self.cfg.parallel.pp_trace and step == self.cfg.train.steps - 1:
            self.trace_files = self.write_trace(step)
        return total

    def write_trace(self, step: int) -> dict | None:
        """Gather the last step's per-action times over the pp group; the first rank writes
        run_dir/pp_trace.json (+ PNGs). Collective over the pp group."""
        from meshspeed.parallel.pipeline.trace import measured_result, write_trace

        rt = self.runtime
        times = rt.gathered_trace()
        if self.mesh.ctx.rank != 0:
            return None
        result = measured_result(rt.name, rt.schedule, times, rt.pp, rt.vpp, rt.microbatches, rt.split)
        return write_trace(os.path.join(self.cfg.run.dir), result, step)
