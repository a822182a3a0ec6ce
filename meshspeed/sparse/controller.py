"""MaskController: drives every mask of a sparsified model through training.

Call `controller.step(step)` once per training step AFTER optimizer.step() and BEFORE zero_grad():
RigL and the gradient/sensitivity adapters read the step's dense (STE) gradients. Masks change
only every `update_interval` steps and when the schedule enters or leaves a dense phase.

Unstructured: the global schedule gives the budget, the distribution (uniform/ERK) and adapter give
each layer its share (parameter-weighted mean = global), and the method moves the mask:
magnitude/sr-ste re-select top-|W|; rigl/set drop small |W| and grow by |grad| / at random.
N:M: a layer is either dense or N:M, so the schedule sets WHICH layers are sparse (their parameter
fraction follows global / (1 - N/M)) and ramps the SR-STE decay; masks are recomputed from |W|.
Elastic N:M (config.pattern_schedule): at a change step every target takes the new pattern and its
mask is re-derived from the current |W|; when the pattern keeps more (1:4 -> 2:4) the weights kept
so far stay and the extra ones are grown by |grad| as RigL grows, starting from zero (weight and
optimizer state), so they enter the forward without a jump.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from meshspeed.sparse.budget import adapter_ratios, erk_sparsities, layer_score, solve_budget
from meshspeed.sparse.config import SparsityConfig, parse_pattern
from meshspeed.sparse.convert import mask_for, targets
from meshspeed.sparse.masks import flip_count
from meshspeed.sparse.rigl import drop_grow_grouped, reset_regrown
from meshspeed.sparse.schedule import SparsitySchedule, cosine_anneal


@dataclass
class LayerUpdate:
    sparsity: float  # measured after the update
    flips: int  # mask entries that changed
    flip_rate: float  # flips / numel
    regrown: int = 0  # rigl/set: newly active weights reset to zero


@dataclass
class UpdateRecord:
    step: int
    phase: str
    target: float  # scheduled global sparsity
    sparsity: float  # measured, parameter-weighted
    flip_rate: float  # all flips / all mask entries
    sr_ste_lambda: float
    drop_fraction: float
    layers: dict[str, LayerUpdate] = field(default_factory=dict)


class MaskController:
    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        config: SparsityConfig,
        *,
        target_list: list | None = None,
    ) -> None:
        """`target_list`: (name, target) pairs to drive instead of `targets(model)`, e.g. views of
        tensor-parallel shards as full weights (meshspeed.train.sparsity); same surface as a target."""
        self.model, self.optimizer, self.base_config = model, optimizer, config
        # the config in force: the base one, or its phase under the pattern schedule's first pattern
        self.config = config = config.phase_config(config.pattern) if config.pattern_schedule else config
        self.schedule = SparsitySchedule.from_config(config)
        self.targets = list(target_list) if target_list is not None else targets(model)
        if not self.targets:
            raise ValueError(
                "MaskController: the model has no sparse layers; call sparsify(model, config) first"
            )
        patterns = {t.nm for _, t in self.targets}
        if len(patterns) > 1:
            raise ValueError(
                f"MaskController: layers mix patterns {patterns}; "
                "use one SparsityConfig.pattern per controller"
            )
        if patterns.pop() != config.nm:
            raise ValueError(
                "MaskController: layers were sparsified with another pattern than "
                f"sparsity.pattern={config.pattern!r}"
            )
        self.numels = {n: t.weight.numel() for n, t in self.targets}
        self.end_step = config.update_end_step
        if self.end_step is None and config.total_steps is not None:
            self.end_step = int(0.75 * config.total_steps)
        self.generator = torch.Generator().manual_seed(config.seed)
        self.history: list[UpdateRecord] = []
        self.last_update: int | None = None
        self.update(0, regrow=False)

    # ---- when -------------------------------------------------------------------------------
    def should_update(self, step: int, last_update: int | None | str = "current") -> bool:
        """`last_update`: decide as if the last update had been at that step (e.g. one running
        in the background that has not set self.last_update yet)."""
        last = self.last_update if last_update == "current" else last_update
        if last is not None and step <= last:
            return False
        dense_now = self.schedule(step) == 0
        dense_before = self.schedule(last or 0) == 0
        due = step % self.config.update_interval == 0 or dense_now != dense_before
        return due or self.pattern_due(step)

    def pattern_due(self, step: int) -> bool:
        """True when the pattern schedule names another pattern for `step` than the one in force."""
        if not self.base_config.pattern_schedule:
            return False
        return parse_pattern(self.base_config.pattern_at(step)) != self.config.nm

    def step(self, step: int) -> UpdateRecord | None:
        """Update masks if this step is an update step; returns the record (with flip rates) or None."""
        if not self.should_update(step):
            return None
        if self.pattern_due(step):
            return self.change_pattern(step, self.base_config.pattern_at(step))
        return self.update(step)

    def step_on(self, step: int, stand_ins: list) -> UpdateRecord | None:
        """step() computed on stand-ins for the targets (same names and order, e.g. background
        Snapshots): masks and decays land on the stand-ins; the caller installs them."""
        saved, self.targets = self.targets, [(t.name, t) for t in stand_ins]
        try:
            return self.step(step)
        finally:
            self.targets = saved

    # ---- elastic N:M ------------------------------------------------------------------------
    def set_pattern(self, pattern: str) -> None:
        """Put `pattern` in force (config, schedule, every target's pattern); masks unchanged."""
        cfg = self.base_config.phase_config(pattern)
        self.config, self.schedule = cfg, SparsitySchedule.from_config(cfg)
        for _, t in self.targets:
            t.nm, t.transposable = cfg.nm, cfg.use_transposable

    def change_pattern(self, step: int, pattern: str) -> UpdateRecord:
        """Switch to `pattern` at `step` and re-derive every mask (growth by |grad| if it keeps more)."""
        n0, m0 = self.config.nm
        self.set_pattern(pattern)
        n1, m1 = self.config.nm
        return self.update(step, regrow=False, grow=n1 / m1 > n0 / m0)

    # ---- how much ---------------------------------------------------------------------------
    def layer_sparsities(self, sparsity: float) -> dict[str, float]:
        """Per-layer unstructured sparsity: distribution x adapter ratios, solved to the budget."""
        cfg = self.config
        if sparsity <= 0:
            return {n: 0.0 for n in self.numels}
        if cfg.distribution == "erk":
            base = erk_sparsities({n: tuple(t.weight.shape) for n, t in self.targets}, sparsity)
        else:
            base = {n: 1.0 for n in self.numels}
        ratios = self._adapter_ratios()
        combined = {n: base[n] * ratios[n] for n in base}
        return solve_budget(self.numels, combined, sparsity, max_sparsity=cfg.max_layer_sparsity)

    def _adapter_ratios(self) -> dict[str, float]:
        if self.config.adapter == "none":
            return {n: 1.0 for n in self.numels}
        scores = {n: layer_score(t.weight, self.config.adapter) for n, t in self.targets}
        return adapter_ratios(scores, self.numels)

    def sparse_layers(self, sparsity: float) -> set[str]:
        """N:M: which layers are N:M so their parameter fraction best matches sparsity / (1 - N/M).

        Order: least important first by the adapter score, model order when adapter is 'none'.
        """
        n, m = self.config.nm
        fraction = min(sparsity / (1.0 - n / m), 1.0)
        names = [name for name, _ in self.targets]
        if self.config.adapter != "none":
            ratios = self._adapter_ratios()
            names.sort(key=lambda k: -ratios[k])
        total = sum(self.numels.values())
        chosen, acc = set(), 0
        for name in names:
            # include the next layer if that moves the sparse fraction closer to the goal
            if abs((acc + self.numels[name]) / total - fraction) <= abs(acc / total - fraction):
                chosen.add(name)
                acc += self.numels[name]
            else:
                break
        return chosen

    # ---- update -----------------------------------------------------------------------------
    def update(self, step: int, *, regrow: bool = True, grow: bool = False) -> UpdateRecord:
        """Recompute every mask for `step` now (step() calls this on update steps). `grow`: an
        N:M pattern change to a denser pattern keeps the active weights and grows by |grad|."""
        cfg = self.config
        global_s = self.schedule(step)
        progress = global_s / cfg.target if cfg.target else 0.0
        lam = cfg.sr_ste_lambda * min(progress, 1.0)
        drop_frac = cosine_anneal(cfg.drop_fraction, step, cfg.warmup_steps, self.end_step)
        record = UpdateRecord(step, self.schedule.phase(step), global_s, 0.0, 0.0, lam, 0.0)
        if cfg.nm is not None:
            on = self.sparse_layers(global_s) if global_s > 0 else set()
            levels = {n: (1.0 if n in on else 0.0) for n in self.numels}
        else:
            levels = self.layer_sparsities(global_s)
        dynamic = regrow and cfg.method in ("rigl", "set") and global_s > 0
        if dynamic:
            record.drop_fraction = drop_frac
        for name, t in self.targets:
            old = t.mask.clone()
            regrown = 0
            if dynamic and not bool(old.all()):
                grow = self._grow_scores(t)
                new = drop_grow_grouped(old, t.weight, grow, levels[name], drop_frac, t.groups)
                # only drop-and-grow growth starts from zero; leaving a dense phase or entering the
                # dense finish keeps the STE-trained values
                regrown = reset_regrown(t.weight, new & ~old, self.optimizer)
            elif grow and levels[name] > 0 and not bool(old.all()):
                g = self._grow_scores(t).float()
                # kept weights outrank every candidate; the rest compete by |grad|. Scaled to
                # [0, 1] first: the transposable mask ranks float32 SUMS of 8 scores per 4x4
                # block, and a bonus of 16 (a power of two) exceeds any difference of 8
                # candidates' sums without drowning them, whatever the gradient's scale (a bonus
                # of max + 1 added to gradients ~1e-5 ranked them at ~5e-7 absolute resolution:
                # the choice then moved with a uniform scale of the gradient)
                top = g.max()
                g = g / torch.where(top > 0, top, torch.ones_like(top))  # no host sync
                new = mask_for(t, levels[name], scores=g + old.float() * 16.0)
                regrown = reset_regrown(t.weight, new & ~old, self.optimizer)
            else:
                new = mask_for(t, levels[name])
            t.set_mask(new)
            t.sr_ste_lambda = lam if levels[name] > 0 else 0.0
            flips = flip_count(old, new)
            record.layers[name] = LayerUpdate(
                1.0 - float(new.sum()) / new.numel(), flips, flips / new.numel(), regrown
            )
        total = sum(self.numels.values())
        record.sparsity = sum(self.numels[n] * u.sparsity for n, u in record.layers.items()) / total
        record.flip_rate = sum(u.flips for u in record.layers.values()) / total
        self.history.append(record)
        self.last_update = step
        return record

    def _grow_scores(self, t) -> torch.Tensor:
        if self.config.method == "set":
            rand = torch.rand(t.weight.shape, generator=self.generator)
            return rand.to(t.weight.device)
        grad = t.weight.grad
        if grad is None:
            raise RuntimeError(
                f"RigL / elastic growth for {t.name} found no gradient; call controller.step(step) after "
                "loss.backward() and optimizer.step(), before optimizer.zero_grad()"
            )
        return grad.detach().abs()

    # ---- resume -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Masks live in the model's state_dict; this holds only the controller's own position."""
        return {
            "last_update": self.last_update,
            "generator": self.generator.get_state(),
            "pattern": self.config.pattern,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restores the position and the pattern in force (load it before the masks are checked)."""
        if "pattern" in state and parse_pattern(state["pattern"]) != self.config.nm:
            self.set_pattern(state["pattern"])
        self.last_update = state["last_update"]
        self.generator.set_state(state["generator"])
