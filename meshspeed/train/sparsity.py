"""Dynamic sparse training in the trainer: the [sparsity] section applied to the parallel model.

    hook = build_sparsity(cfg.sparsity, model, opt, mesh, total_steps=..., seed=...)  # or None
    ... loss.backward(); opt.step(); metrics |= hook.after_step(step); opt.zero_grad()

Targets. After tensor and data parallelism are applied, the weights whose names match
`sparsity.layers` get a mask: a plain nn.Linear (tp 1, or a linear the tp plan leaves whole)
becomes a SparseLinear (2:4 sparse kernels on CUDA), a Column/RowParallelLinear or a stacked
expert weight [E, out, in] gets a SparseParam (masked in a forward pre-hook; each expert its own
mask). Both keep the Parameter objects, which DataParallel has made views into its buckets.

Masks are computed on the FULL logical weight. At an update every rank gathers each sparse
weight (and, for RigL and gradient adapters, its reduced gradient) over tp, runs the core
MaskController on it, and keeps its torch.chunk piece of the result. Every tp rank computes
the same mask from the same full tensors, and every dp rank too (weights and reduced gradients
are identical across dp, SET's generator is seeded alike), so no mask is ever communicated.
N:M groups must not straddle a shard boundary (checked at build, one-line error).

Weights under a mask are not zeroed: the forward multiplies by the mask and the straight-through
gradient keeps training them, so the parameter and its fp32 master stay one value. The one
in-place write is RigL/SET regrowth, which zeroes the regrown weights AND their master and AdamW
moments (ZeroAdamW.reset_state_where), so bf16 storage or ZeRO cannot bring the old value back.

Masks are persistent buffers (`<linear>.mask` whatever the layout, `<experts>.w1_mask`) tagged like their
parameter (comm.placement), so checkpoints save and reshard them; `state_dict()` holds the
controller's position and pattern, its RNG, the SR-STE decays and an update in flight for the
checkpoint's `extra`.

Step 2 of the design (issue 19): `async_masks` (SparsityHook's docstring), `pattern_schedule`
(elastic N:M, the core controller's change_pattern; growth reads the full reduced gradient, so
not under ZeRO-2), `sparse_grad_comm` (meshspeed.parallel.sparse_comm, given the local mask
buffers by parameter name; this hook keeps it dense on the steps whose after_step updates).
Every row gets `grad_comm_bytes`, the gradient bytes the step handed to the dp collectives.
"""

from __future__ import annotations

import fnmatch
import re

import torch
from torch import nn

from meshspeed.comm import ConfigError, placement
from meshspeed.models.moe import GroupedExperts
from meshspeed.parallel.sparse_comm import SparseGradComm
from meshspeed.parallel.tensor import ColumnParallelLinear, RowParallelLinear
from meshspeed.plan.sparsity import sparsity_config
from meshspeed.sparse import (
    MaskController,
    SparseLinear,
    SparseParam,
    SparsityConfig,
    check_shardable,
    parse_pattern,
)
from meshspeed.sparse import report as sparse_report
from meshspeed.sparse.background import MaskJob, Snapshot
from meshspeed.sparse.choice import kernel_choices, kernel_report
from meshspeed.sparse.rigl import reset_regrown
from meshspeed.sparse.view import FullView, gather_mask

GRAD_ADAPTERS = ("gradient", "sensitivity")


def _matcher(spec: str):
    if spec.startswith("re:"):
        regex = re.compile(spec[3:])
        return lambda name: regex.search(name) is not None
    globs = [g.strip() for g in spec.split(",") if g.strip()]
    return lambda name: any(fnmatch.fnmatchcase(name, g) for g in globs)


def _candidates(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(target name, module, parameter name) of every weight that can take a mask, in model order."""
    out = []
    for fqn, mod in model.named_modules():
        if type(mod) is nn.Linear or isinstance(mod, (ColumnParallelLinear, RowParallelLinear, SparseLinear)):
            out.append((fqn, mod, "weight"))
        elif isinstance(mod, GroupedExperts):
            out += [(f"{fqn}.{p}", mod, p) for p in ("w1", "w2", "w3")]
    return out


class SparsityHook:
    """Drives the masks of a sparsified parallel model; built by `build_sparsity`.

    async_masks: at an update step the weights (and reduced gradients) are gathered and copied
    here, on the training thread (collectives stay in program order), the controller runs on the
    copies in a worker thread (meshspeed.sparse.background) while the next step trains, and the
    result is installed at the next after_step, before anything else. So async is exactly the
    synchronous run with each update's masks installed one step later (`threaded=False` computes
    them inline for that comparison). Pattern changes (elastic N:M) stay synchronous: they are few
    and their growth reads the live gradients. A checkpoint taken with an update in flight
    carries its full masks (bool, in rank 0's state) so a resume installs them at the same step."""

    def __init__(self, model: nn.Module, config: SparsityConfig, views: list[FullView], optimizer):
        self.model, self.config, self.views, self.optimizer = model, config, views, optimizer
        try:
            self.controller = MaskController(model, None, config, target_list=[(v.name, v) for v in views])
        except ValueError as err:  # a shape the pattern cannot take, named by the core
            raise ConfigError(str(err)) from None
        self.regrown = 0  # weights reset by RigL/SET regrowth so far (this process)
        self.async_masks, self.threaded = False, True
        self.print_kernels = False  # build_sparsity sets it on one rank per pipeline stage
        self.kernels_note = ""  # printed instead of the kernel table where no 2:4 kernel can run
        self.need_grad = bool(views) and views[0].need_grad
        self._pending: MaskJob | dict | None = None  # an update computed (or computing) off the step
        self.grad_comm = None  # a SparseGradComm when sparsity.sparse_grad_comm is on
        self._done = 0  # steps done at the last after_step
        self.dp = getattr(optimizer, "dp", None)  # its counted gradient bytes go to the metrics
        self._comm_bytes = 0 if self.dp is None else self.dp.stats["grad_comm_bytes"]
        self._sparsity = self._measure()

    def _measure(self) -> float:
        """Parameter-weighted sparsity of all masks (full weights)."""
        zeros = sum(int((~v.mask).sum()) for v in self.views)
        return zeros / sum(v.mask.numel() for v in self.views)

    def after_step(self, step: int) -> dict:
        """Call after opt.step() and before zero_grad() of 0-based training step `step`: updates
        the masks when step + 1 steps are done and that is an update step (collective over tp
        then). Returns {"sparsity"} and, when masks changed, {"flip_rate"} for the metrics (and
        {"grad_comm_bytes"} with a data-parallel model)."""
        done = self._done = step + 1
        ctl, out = self.controller, {}
        if self.print_kernels:  # the layers chose at their first forward: print once, after it
            self.print_kernels = False
            table = kernel_report(self.model) or self.kernels_note
            if table:
                print(table, flush=True)
        if self._pending is not None:  # launched at the previous step: installed now, whatever the timing
            out["flip_rate"] = self._install(self._resolve())
            self._pending = None
        last = ctl.last_update
        if ctl.should_update(done):
            last = done  # also when a background job has not recorded it yet
            if self.need_grad and hasattr(self.optimizer, "clip_whole_grads"):
                # under ZeRO-1 step() clipped only this rank's slice of the reduced gradients:
                # growth must read the whole clipped gradient, the same on every dp rank
                self.optimizer.clip_whole_grads()
            if self.async_masks and not ctl.pattern_due(done):
                self._launch(done)
            else:
                old = {v.name: v.mask for v in self.views}
                record = ctl.step(done)
                for v in self.views:
                    if record.layers[v.name].regrown:
                        self._reset(v, v.local_piece(v.mask & ~old[v.name]))
                out["flip_rate"] = record.flip_rate
        if self.dp is not None:
            total = self.dp.stats["grad_comm_bytes"]
            out["grad_comm_bytes"], self._comm_bytes = total - self._comm_bytes, total
        if self.grad_comm is not None:
            if "flip_rate" in out:
                self.grad_comm.masks_changed()
            # the next step packs unless its after_step updates masks (they may read dense gradients)
            self.grad_comm.active = not ctl.should_update(done + 1, last)
        self._sparsity = self._measure()
        return {"sparsity": self._sparsity, **out}

    def _launch(self, done: int) -> None:
        snaps = []
        for v in self.views:  # gathers over tp here, on the training thread
            w = v.weight
            g = None if w.grad is None else w.grad.clone()
            snaps.append(Snapshot(v.name, w.detach().clone(), g, v))
            v._w = None
        fn = lambda: (self.controller.step_on(done, snaps), snaps)  # noqa: E731
        device = self.views[0].local.weight.device
        self._pending = MaskJob(fn, device=device, threaded=self.threaded)

    def _resolve(self) -> dict:
        """The pending update as plain data: full masks, decays, regrown counts, flip rate."""
        if isinstance(self._pending, dict):
            return self._pending
        record, snaps = self._pending.result()
        self._pending = {
            "step": record.step,
            "masks": {s.name: s.mask for s in snaps},
            "sr_ste_lambda": {s.name: s.sr_ste_lambda for s in snaps},
            "regrown": {n: u.regrown for n, u in record.layers.items()},
            "flip_rate": record.flip_rate,
        }
        return self._pending

    def _install(self, pending: dict) -> float:
        for v in self.views:
            old, new = v.mask, pending["masks"][v.name]
            v.set_mask(new)
            v.sr_ste_lambda = pending["sr_ste_lambda"][v.name]
            if pending["regrown"][v.name]:
                self._reset(v, v.local_piece(new & ~old))
        return pending["flip_rate"]

    def _reset(self, view: FullView, where: torch.Tensor) -> None:
        """Regrown weights start at zero with zero optimizer state (weight, master, moments)."""
        opt = self.optimizer
        if hasattr(opt, "reset_state_where"):
            self.regrown += opt.reset_state_where(view.local.weight, where)
        else:  # a torch optimizer: per-element state shaped like the parameter
            self.regrown += reset_regrown(view.local.weight, where, opt)

    # -- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Plain data for the checkpoint's `extra` (the masks themselves are model buffers; an
        update in flight is joined and saved whole)."""
        pending = None if self._pending is None else self._resolve()  # first: it sets last_update
        return {
            "controller": self.controller.state_dict(),
            "sr_ste_lambda": {v.name: float(v.sr_ste_lambda) for v in self.views},
            "pending": pending,
            "done": self._done,
        }

    def load_state_dict(self, state: dict | None) -> None:
        """After the model's buffers were loaded: put the saved pattern in force, re-install the
        local masks (refreshing each layer's cached state: DCP writes buffers in place), re-gather
        the full ones (collective over tp) and restore the controller's position."""
        if state is not None:
            self.controller.load_state_dict(state["controller"])
        for v in self.views:
            v.local.set_mask(v.local.mask.clone())
            v.mask = gather_mask(v.local.mask, v.split_groups, v.sharding)
        if state is not None:
            for v in self.views:
                v.sr_ste_lambda = state["sr_ste_lambda"][v.name]
            self._pending = state.get("pending")
        if self.grad_comm is not None:
            self.grad_comm.masks_changed()
            if state is not None:  # the next step packs unless its after_step updates (as in after_step)
                done, pending = state.get("done", 0), state.get("pending")
                last = pending["step"] if pending else self.controller.last_update
                self.grad_comm.active = not self.controller.should_update(done + 1, last)
        self._sparsity = self._measure()

    def report(self) -> str:
        """Per-layer sparsity and matmul path (local shards)."""
        return sparse_report(self.model)

    def kernel_choices(self) -> dict[str, dict]:
        """{layer: where y, dX and dW run on 2:4 kernels, and why} for meta.json (this rank's layers)."""
        return kernel_choices(self.model)


def build_sparsity(
    section, model: nn.Module, optimizer, mesh, *, total_steps: int | None = None, seed: int = 0
) -> SparsityHook | None:
    """Attach masks to the matching weights of the (tensor- and data-parallel) `model` and return
    the hook driving them, or None when section.pattern is 'none'. Collective over tp."""
    config = sparsity_config(section, total_steps=total_steps, seed=seed)
    if config is None:
        return None
    densities = [nm[0] / nm[1] for nm in (parse_pattern(p) for _, p in config.pattern_steps) if nm]
    grows = any(b > a for a, b in zip(densities, densities[1:]))  # elastic growth reads |grad|
    need_grad = config.method == "rigl" or config.adapter in GRAD_ADAPTERS or grows
    dp = getattr(optimizer, "dp", None)
    if need_grad and dp is not None and dp.zero == 2 and dp.group.size > 1:
        why = "sparsity.method=rigl" if config.method == "rigl" else f"sparsity.adapter={config.adapter}"
        why = f"sparsity.pattern_schedule={config.pattern_schedule!r} (growth)" if grows else why
        raise ConfigError(
            f"{why} reads the full reduced gradient, but parallel.zero=2 keeps only 1/dp of it; "
            f"use parallel.zero 0 or 1"
        )
    group = mesh["tp"]
    match = _matcher(section.layers)
    chosen = [c for c in _candidates(model) if match(c[0])]
    if not chosen:
        raise ConfigError(
            f"sparsity.layers={section.layers!r} matches no linear or expert weight; names look like "
            f"{', '.join(n for n, _, _ in _candidates(model)[:4])}"
        )
    views = []
    for name, mod, pname in chosen:
        p = getattr(mod, pname)
        sharding = placement.sharding_of(p)
        for _, pattern in config.pattern_steps if sharding is not None and config.nm else ():
            phase = config.phase_config(pattern)  # every pattern of an elastic schedule must fit
            try:
                check_shardable(
                    name,
                    sharding.full_shape,
                    sharding.shard_dims().get("tp", 0),
                    group.size if "tp" in sharding.shard_dims() else 1,
                    phase.nm,
                    transposable=phase.use_transposable,
                )
            except ValueError as err:
                raise ConfigError(str(err)) from None
        kw = dict(nm=config.nm, transposable=config.use_transposable, sr_ste_lambda=config.sr_ste_lambda)
        if isinstance(mod, SparseLinear):
            local = mod  # already sparse (sparsified before parallelism): drive it as it is
        elif type(mod) is nn.Linear:
            local = SparseLinear.from_linear(mod, use_sparse_kernels=config.use_sparse_kernels, **kw)
            local.name = name
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, local)
        else:  # a tp linear keeps its mask under the name a SparseLinear's has: checkpoints reshard
            local = SparseParam(mod, pname, name=name, mask_name="mask" if pname == "weight" else None, **kw)
        if isinstance(local, SparseLinear):
            local.kernel_mode = section.kernels  # where y and dX run on cuSPARSELt (sparse/choice.py)
        views.append(FullView(name, local, {"tp": group, "ep": mesh["ep"]}, need_grad))
    hook = SparsityHook(model, config, views, optimizer)
    hook.async_masks = section.async_masks
    # one rank per pipeline stage prints the 2:4 kernel choices (its own layers) once
    hook.print_kernels = all(c == 0 for d, c in getattr(mesh, "coords", {}).items() if d != "pp")
    if section.kernels == "sparse" and config.use_sparse_kernels and config.nm == (2, 4) and all(
        getattr(mod, pname).device.type != "cuda" for _, mod, pname in chosen
    ):  # asked for, not possible here: say so once rather than fall back without a word
        hook.kernels_note = (
            "meshspeed: note: sparsity.kernels=sparse: 2:4 sparse kernels need a CUDA GPU "
            "(cuSPARSELt or CUTLASS); here every product runs dense on the masked weights"
        )
    if section.sparse_grad_comm:
        hook.grad_comm = _grad_comm(hook, dp)
    return hook


def _grad_comm(hook: SparsityHook, dp) -> SparseGradComm:
    """Sparse gradient communication over the hook's local masks (live buffers, by parameter name)."""
    if dp is None:
        raise ConfigError(
            "sparsity.sparse_grad_comm=true needs meshspeed's data parallelism (an optimizer from "
            "build_data_parallel); set it false"
        )
    by_id = {id(v.local.weight): v.local.mask for v in hook.views}
    masks = {n: by_id[id(p)] for n, p in dp.params.items() if id(p) in by_id}
    grad_comm = SparseGradComm(dp, masks)
    grad_comm.active = not hook.controller.should_update(1)
    return grad_comm


__all__ = ["SparsityHook", "build_sparsity", "sparsity_config"]
