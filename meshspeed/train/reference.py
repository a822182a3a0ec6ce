"""DPO's reference model: the starting weights, frozen, in the policy's layout.

Built exactly as the policy is (same recipe, seed or `model.init_from`, tp/pp/cp/ep layout and
attention cores) but never given to the optimizer: no gradients, no optimizer state. ZeRO does
not shard it (it has nothing to update), so under ZeRO-3 each dp rank holds its tp/pp piece
whole. A resumed run rebuilds it from the same starting weights, never from the checkpoint.

`logps(items)` fills each micro-batch's `ref_chosen_logps` / `ref_rejected_logps` by one
forward of the reference on the same rows, just before the policy's. `precompute(...)` does it
once for a whole record set (`dpo.precompute_reference`), each dp rank for its share, and the
reference is then freed.
"""

from __future__ import annotations

import math

import torch

from meshspeed import comm
from meshspeed.parallel.materialize import build_parallel_model
from meshspeed.parallel.tensor import token_ce_fn
from meshspeed.train.objectives import Scorer
from meshspeed.train.objectives.dpo import DPO, REF_KEYS


class Reference:
    def __init__(self, trainer, experts, load_weights):
        """trainer: the Trainer being built (its cfg, mesh, recipe, cp, pipeline layouts);
        experts: its meta-device transform; load_weights(model): its model.init_from load."""
        from meshspeed.train.model_features import apply_model_features
        from meshspeed.train.pipeline import TrainerPipeline

        cfg, mesh, p = trainer.cfg, trainer.mesh, trainer.cfg.parallel
        self.mesh, self.device, self.cp = mesh, trainer.ctx.device, trainer.cp
        self.pipeline = None
        if p.pp > 1:
            self.pipeline = TrainerPipeline(
                cfg,
                mesh,
                trainer.recipe,
                trainer.accum,
                self.device,
                trainer.layouts(),
                trainer.cp,
                experts,
                rows_per_record=2,
            )
            self.model = self.pipeline.model
        else:
            self.model = build_parallel_model(
                trainer.recipe,
                mesh,
                seed=cfg.train.seed,
                device=self.device,
                sequence_parallel=p.sequence_parallel,
                transform=experts,
            )
        # the cp attention cores, tp overlap and kernels the policy runs, so the numbers match
        apply_model_features(self.model, cfg, mesh, trainer.recipe, self.device, trainer.cp)
        load_weights(self.model)
        self.model.requires_grad_(False)
        self.scorer = Scorer(
            ce=None, token_ce=token_ce_fn(self.model), cp_group=mesh["cp"] if trainer.cp else None
        )

    def _row_logps(self, logits: torch.Tensor, item: dict) -> torch.Tensor:
        return DPO.sequence_logps(logits, item, self.scorer)

    @torch.no_grad()
    def logps(self, items: list[dict], forwards) -> None:
        """Set each item's reference log-probabilities. forwards[i](model) runs the model on
        item i's rows (the trainer's forward: positions, documents); pp: the pipeline's."""
        if self.pipeline is not None:
            width = items[0]["tokens"].shape[0]
            out = self.pipeline.runtime.forward_rows(items, self._row_logps, width)
            values = [out[i] for i in range(len(items))]
        else:
            values = [self._row_logps(f(self.model), item) for item, f in zip(items, forwards)]
        for item, v in zip(items, values):
            half = v.shape[0] // 2
            item[REF_KEYS[0]], item[REF_KEYS[1]] = v[:half].float(), v[half:].float()

    @torch.no_grad()
    def precompute(self, records: dict, loader_cls, loader_args, prepare) -> dict:
        """`records` with `ref_chosen_logps` / `ref_rejected_logps` [N] added: every pair scored
        once, each dp rank its share (the loader's slicing), summed over dp."""
        n = records["chosen_tokens"].shape[0]
        g = loader_args[0]  # global batch
        table = torch.zeros(n, 3, dtype=torch.float64)  # chosen, rejected, times seen
        for b in range(math.ceil(n / g)):
            idx = torch.arange(b * g, (b + 1) * g) % n  # the last batch wraps to stay whole
            loader = loader_cls({k: v[idx] for k, v in records.items()}, *loader_args)
            mine = loader.batches(0)
            per = loader.micro_batch_size
            items, forwards = zip(*(prepare(mb) for mb in mine))
            self.logps(list(items), list(forwards))
            for a, item in enumerate(items):
                first = (a * loader.dp_size + loader.dp_rank) * per
                rows = idx[first : first + per]
                table[rows, 0] += item[REF_KEYS[0]].double().cpu()
                table[rows, 1] += item[REF_KEYS[1]].double().cpu()
                table[rows, 2] += 1
        table = comm.all_reduce(table.to(self.device), self.mesh["dp"]).cpu()
        seen = table[:, 2].clamp(min=1)
        return {
            **records,
            REF_KEYS[0]: (table[:, 0] / seen).float(),
            REF_KEYS[1]: (table[:, 1] / seen).float(),
        }

    def precompute_loaders(self, trainer):
        """dpo.precompute_reference: score every training and validation pair once into the
        loaders' records; the caller then drops the reference (returns None for that)."""
        from meshspeed.data.records import RecordValidation

        t, mesh = trainer.cfg.train, trainer.mesh
        args = (t.global_batch_size, t.micro_batch_size, mesh.coords["dp"], mesh.dims.dp)
        for loader in (trainer.loader, trainer.val_loader):
            loader.records = self.precompute(loader.records, RecordValidation, args, trainer.item)
        if trainer.lead:
            print("meshspeed: reference log-probabilities precomputed for every pair", flush=True)
        return None
