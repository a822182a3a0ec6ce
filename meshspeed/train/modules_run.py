"""Per-module layouts in the trainer (`[modules]`, plan/modules.py): a model whose recipe declares
an encoder (Recipe.encoder: a vlm's ViT and projector) trains with the encoder in a layout of
its own, joined to the decoder through the seam (parallel/seam.py).

    colocated      every rank runs both: the decoder at parallel.* (the trainer's Mesh), the
                   encoder at modules.encoder_dp over all ranks (its ModuleMesh); each rank
                   encodes its share of the micro-batch's images and the seam re-slices the
                   features to the decoder's dp slices
    disaggregated  the decoder's ranks run the Trainer on the decoder's ModuleMesh; the
                   encoder's ranks run EncoderWorker, a loop that mirrors the trainer's step
                   (micro-batches, gradient norm, optimizer, validation, checkpoints) for the
                   encoder alone, one micro-batch ahead of the decoder so both sides work at once

Each module is its own model (the other's modules removed on meta, FQNs kept), its own
DataParallel and AdamW over its own dp group; the trainer sees them joined (JoinedDP,
JoinedOptimizer): one no_sync, one gradient norm over both (so clipping is the one-device
model's), one step. Checkpoints hold both under their one-device FQNs (Both): a `[modules]`
checkpoint loads into any layout and any layout's into `[modules]`.

Gradient scale: the decoder averages its gradients over its dp (each rank's loss a mean); the
encoder's rows carry the gradient of one decoder rank's loss, summed over the encoder's ranks
by its own DataParallel, which averages over the encoder's dp. So the rows' gradient is scaled
by encoder dp / decoder dp on the way back (seam.producer_grad_divisor's convention).

Checkpoint tensors are placed on their own module's mesh (Placement), so the encoder may run
at its own tp. The encoder runs ZeRO-2 when parallel.zero is 3 (its forward does not pass the
model's root, where ZeRO-3 gathers the rest; it is the small module).

A decoder pipeline (parallel.pp): its first stage's ranks consume the rows, in micro-batch order,
inside the schedule (the decoder recipe's embedding takes EncoderSide.next_rows); so no rank
waits on a schedule it does not run, every rank posts all of a step's transfers when the step
begins (all_ahead), and a rank whose rows were consumed elsewhere runs their backward after the
schedule (finish). The seam returns gradients in micro-batch order: schedules whose embedding
backward runs in a deferred W (zero-bubble, dualpipev) are refused.

Not built (refused by the run plan in one line): cp with [modules]; an encoder pipeline;
exports at the end of a disaggregated run or with the encoder at tp > 1 (convert the checkpoint
afterwards); sparsity.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch
from torch import nn

from meshspeed.comm import ParallelDims
from meshspeed.comm.module_mesh import ModuleMesh
from meshspeed.comm.placement import chunk_bounds
from meshspeed.parallel import seam as S
from meshspeed.parallel.materialize import build_parallel_model
from meshspeed.parallel.optim import build_data_parallel, clip_coefficient, grad_norm


def module_meshes(plan, ctx) -> tuple[ModuleMesh, ModuleMesh]:
    """(encoder, decoder) meshes of the plan's resolved `[modules]` (collective: every rank
    builds both, in this order)."""
    e, d = plan.modules["encoder"], plan.modules["decoder"]
    enc = ModuleMesh("encoder", ParallelDims(dp=e["dp"], tp=e["tp"]), e["ranks"], ctx)
    dec = ModuleMesh("decoder", ParallelDims(**d["dims"]), d["ranks"], ctx)
    return enc, dec


def encoder_only(plan, ctx) -> bool:
    """Whether this rank runs only the encoder (a disaggregated layout: EncoderWorker)."""
    return bool(plan.modules) and ctx.rank not in plan.modules["decoder"]["ranks"]


def _keep_only(module: nn.Module, owns, path: str = "") -> None:
    """Remove every submodule of `module` that owns(fqn) rejects and no kept one lies under."""
    for name, child in list(module.named_children()):
        fqn = f"{path}.{name}" if path else name
        if owns(fqn):
            continue
        if any(owns(f"{fqn}.{n}") for n, _ in child.named_modules() if n):
            _keep_only(child, owns, fqn)
        else:
            setattr(module, name, None)


def split_recipe(recipe, side: str, source: EncoderSide | None = None):
    """The recipe of one side ("encoder" or "decoder"): its build keeps only that side's modules
    (same FQNs as the whole model), its tp plan only that side's entries. The decoder's pipeline
    embeds the tokens with `source`'s rows (EncoderSide.next_rows) in place of the images."""
    unit = recipe.encoder
    mine = (lambda f: unit.owns(f)) if side == "encoder" else (lambda f: not unit.owns(f))

    def build():
        model = recipe.build()
        if side == "encoder":
            _keep_only(model, unit.owns)
        else:
            for prefix in unit.prefixes:
                parent, _, name = prefix.rpartition(".")
                setattr(model.get_submodule(parent), name, None)
        return model

    plan = tuple((p, s) for p, s in recipe.tp_plan if mine(p))
    tied = tuple(t for t in recipe.tied if mine(t[0]) and mine(t[1]))
    pipeline = recipe.pipeline
    if side == "decoder" and source is not None:
        embed = lambda model, tokens: unit.embed(model, tokens, source.next_rows())  # noqa: E731
        pipeline = dataclasses.replace(pipeline, inputs=("tokens",), embed=embed)
    return dataclasses.replace(recipe, build=build, tp_plan=plan, tied=tied, pipeline=pipeline)


class Both(nn.Module):
    """Both modules' parameters and buffers under their own (one-device) FQNs, for checkpoint
    reads and writes and exports; runs nothing."""

    def __init__(self, *models):
        super().__init__()
        object.__setattr__(self, "_parts", [m for m in models if m is not None])

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        seen = set()
        for m in self._parts:
            for n, p in m.named_parameters(prefix, recurse, remove_duplicate):
                if id(p) not in seen:
                    seen.add(id(p))
                    yield n, p

    def named_modules(self, memo=None, prefix: str = "", remove_duplicate: bool = True):
        for m in self._parts:
            yield from m.named_modules(memo, prefix, remove_duplicate)


@contextlib.contextmanager
def _each(contexts):
    """Every context manager of `contexts` entered, in order."""
    with contextlib.ExitStack() as stack:
        for c in contexts:
            stack.enter_context(c)
        yield


class _Gathered:
    """ZeRO-3's gathered() and held() (a pipeline step's) over the parts that have one."""

    def __init__(self, parts):
        self.parts = parts

    def gathered(self):
        return _each(z.gathered() for z in self.parts)

    def held(self):
        return _each(z.held() for z in self.parts)


class JoinedDP:
    """The decoder's and the encoder's DataParallel as one: no_sync, finish_grad_sync and, for
    grad_norm, `parts` [(dp, mesh)] (a part is None on a rank that does not run it)."""

    def __init__(self, parts: list[tuple[object, object]]):
        self.parts = parts
        z = [dp.zero3 for dp, _ in parts if dp is not None and dp.zero3 is not None]
        self.zero3 = _Gathered(z) if z else None

    def _dps(self):
        return [dp for dp, _ in self.parts if dp is not None]

    def no_sync(self):
        return _each(dp.no_sync() for dp in self._dps())

    def finish_grad_sync(self) -> None:
        for dp in self._dps():
            dp.finish_grad_sync()


class JoinedOptimizer:
    """Both modules' AdamW as one: the same learning rate, clip factor and skipped steps; the
    per-parameter state split by which optimizer holds each FQN."""

    def __init__(self, *opts):
        self.opts = [o for o in opts if o is not None]

    def set_lr(self, lr: float) -> None:
        for o in self.opts:
            o.set_lr(lr)

    def step(self, clip_coef=None) -> None:
        for o in self.opts:
            o.step(clip_coef=clip_coef)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.opts:
            o.zero_grad(set_to_none)

    def state_dict_per_param(self) -> dict:
        out: dict = {}
        for o in self.opts:  # collective over each optimizer's own dp, in the same order everywhere
            out.update(o.state_dict_per_param())
        return out

    def load_state_dict_per_param(self, state: dict) -> None:
        for o in self.opts:
            mine = {k: v for k, v in state.items() if k in o.dp.slots}
            o.load_state_dict_per_param({**mine, "__step__": state["__step__"]})


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


class EncoderSide:
    """This rank's part of the encoder: its model, DataParallel and optimizer (None off the
    encoder's ranks), the seam, and the rows of each micro-batch."""

    def __init__(self, cfg, ctx, recipe, enc_mesh: ModuleMesh, dec_mesh: ModuleMesh, dtype):
        self.unit, self.ctx, self.dtype = recipe.encoder, ctx, dtype
        self.mesh, self.dec_mesh = enc_mesh, dec_mesh
        self.seam = S.Seam(enc_mesh, dec_mesh)
        self.scale = enc_mesh.dims.dp / dec_mesh.dims.dp  # see the module docstring
        self.model = self.dp = self.opt = None
        self._chunks: list = []
        # a decoder pipeline: its first stage's ranks consume; every micro-batch's transfers are
        # posted when the step begins, so no rank waits on a schedule it does not run
        self.all_ahead = dec_mesh.dims.pp > 1
        self.consumer = dec_mesh.member and dec_mesh.coords["pp"] == 0
        self._pending: list = []
        if enc_mesh.member:
            self.model = build_parallel_model(
                split_recipe(recipe, "encoder"), enc_mesh, seed=cfg.train.seed, device=ctx.device
            )

    def build_optimizer(self, cfg) -> None:
        """Its DataParallel and AdamW over its own dp, once its weights are loaded."""
        from meshspeed.memory import offload_optimizer, share_fp32_masters

        t, p, m = cfg.train, cfg.parallel, cfg.memory
        if self.model is None:
            return
        self.dp, self.opt = build_data_parallel(
            self.model,
            self.mesh,
            zero=min(p.zero, 2),  # ZeRO-3 refused for the encoder (module docstring)
            bucket_mb=p.bucket_mb,
            dtype=self.dtype,
            lr=t.lr,
            weight_decay=t.weight_decay,
            betas=(t.beta1, t.beta2),
        )
        if m.reuse_fp32_param:  # the same memory features as the decoder's optimizer
            share_fp32_masters(self.opt)
        if m.offload_optimizer:
            offload_optimizer(self.opt)

    def begin(self, loader, step: int, micro: list[dict] | None = None) -> None:
        """Take this rank's share of the images of each micro-batch of `step` (the global
        micro-batch a: the decoder's dp slices of it, in dp order) and number the micro-batches.
        Under a decoder pipeline, post every micro-batch's transfers now (all_ahead)."""
        n, rows = loader.micro_batch_size * self.dec_mesh.dims.dp, loader.rows(step)
        self._n, self._m, self._chunks = n, len(rows) // n, []
        for a, mb in enumerate(micro or []):
            mb["micro"] = a
        if self.model is not None:
            j, offs = self.mesh.coords["dp"], chunk_bounds(n, self.mesh.dims.dp)
            for a in range(self._m):
                mine = rows[a * n : (a + 1) * n][offs[j] : offs[j + 1]]
                self._chunks.append(loader.records[self.unit.input][mine])  # the images only
        if self.all_ahead:
            self._pending, self._next = [self._start(a) for a in range(self._m)], 0

    def _start(self, a: int) -> S.Pending:
        x = S.placeholder(self.unit.row_shape, self.dtype, self.ctx.device)
        if self.model is not None and len(self._chunks[a]):
            x = self.unit.encode(self.model, self._chunks[a].to(self.ctx.device))
            x = _ScaleGrad.apply(x, self.scale)
        return S.start(self.seam, x, self._n)

    def rows(self, a: int) -> torch.Tensor:
        """Micro-batch a: this rank's encoder rows sent, its decoder rows received (empty off
        the decoder's ranks); differentiable both ways."""
        return S.wait(self._start(a))

    def next_rows(self) -> torch.Tensor:
        """all_ahead: the next micro-batch's rows (a pipeline's first stage runs its forwards in
        micro-batch order, training and validation alike)."""
        self._next += 1
        return S.wait(self._pending[self._next - 1])

    def finish(self) -> None:
        """all_ahead, after the decoder's schedule: a rank that encoded rows the decoder's first
        stage consumed elsewhere runs their backward, in micro-batch order (its gradients reduced
        over its dp with the last one)."""
        pending, self._pending = self._pending, []
        if self.consumer or self.model is None:
            return  # consumed (its backward ran in the schedule's), or nothing encoded here
        for a, p in enumerate(pending):
            with contextlib.nullcontext() if a == len(pending) - 1 else self.dp.no_sync():
                S.drive(S.wait(p))

    def forward(self, item: dict, batch: dict):
        """The trainer's forward of a micro-batch: the decoder on the seam's rows."""
        a = batch["micro"]
        return lambda model: self.unit.decode(model, item, self.rows(a))


class Placement:
    """The mesh a checkpoint places each tensor on: the encoder's for the encoder's FQNs (split
    over its own tp), the decoder's for the rest; everything else (the world, the lead, the
    pipeline degree) is the decoder's mesh's. comm/checkpoint_io asks `mesh_for(key)` of each
    "model.<fqn>" / "optim.<fqn>.<state>" key."""

    def __init__(self, base, side: EncoderSide):
        self._base, self._encoder, self._unit = base, side.mesh, side.unit

    def mesh_for(self, key: str):
        return self._encoder if self._unit.owns(key.split(".", 1)[1]) else self._base

    def __getattr__(self, name):
        return getattr(self._base, name)

    def __getitem__(self, name):
        return self._base[name]


def join(trainer) -> None:
    """Give the trainer the encoder (colocated, or the decoder's side of a disaggregated layout):
    its DataParallel and optimizer joined to the decoder's, its model to the checkpoints'."""
    side = trainer.encoder
    trainer.dp = JoinedDP([(trainer.dp, trainer.mesh), (side.dp, side.mesh)])
    trainer.opt = JoinedOptimizer(trainer.opt, side.opt)
    trainer.whole = Both(trainer.model, side.model)


class EncoderWorker:
    """An encoder-only rank of a disaggregated layout: the trainer's step, validation and
    checkpoints for the encoder alone, in step with the decoder's ranks (every collective they
    share: gradient norm, checkpoints, resume, in the same order)."""

    lead = False
    pipeline = None

    def __init__(self, cfg, ctx, plan):
        from meshspeed.checkpoint import dcp as ckpt
        from meshspeed.data.tokenizer import load_tokenizer
        from meshspeed.interop.hf_import import source_recipe
        from meshspeed.models import recipe_for
        from meshspeed.train.batches import make_loaders
        from meshspeed.train.model_features import DTYPES

        self.cfg, self.ctx, self.plan, t = cfg, ctx, plan, cfg.train
        self.model_config = plan.model_config()
        weights = plan.weights
        if cfg.model.init_from and weights is None:  # a Hugging Face directory, as the Trainer reads it
            recipe = source_recipe(cfg.model.init_from, self.model_config)
        else:
            recipe = recipe_for(self.model_config)
        torch.manual_seed(t.seed)
        self.enc_mesh, self.dec_mesh = module_meshes(plan, ctx)
        self.mesh = self.enc_mesh

        self.side = EncoderSide(cfg, ctx, recipe, self.enc_mesh, self.dec_mesh, DTYPES[t.dtype])
        if weights:  # model.init_from a meshspeed checkpoint: one load, with the decoder's ranks
            whole = Both(self.side.model)
            ckpt.load_checkpoint(weights, whole, None, self.mesh, strict=False, restore_rng=False)
        self.side.build_optimizer(cfg)
        self.dp = JoinedDP([(self.side.dp, self.enc_mesh)])
        self.opt, self.whole = JoinedOptimizer(self.side.opt), Both(self.side.model)
        self.loader, self.val_loader = make_loaders(
            cfg, load_tokenizer(cfg.data.tokenizer), 0, self.dec_mesh.dims.dp, self.model_config
        )
        self.start_step = self._resume(cfg.checkpoint.resume) if cfg.checkpoint.resume else 0

    def _resume(self, which: str) -> int:
        from meshspeed.train.checkpointing import resume

        return resume(self, which)

    def _produce(self, loader, step: int):
        """Micro-batch rows in order, each encoded (and its sends posted) before the decoder
        needs it: micro-batch a+1's encoder runs while the decoder works on a."""
        self.side.begin(loader, step)
        for a in range(len(self.side._chunks)):
            yield self.side.rows(a)

    def train_step(self, step: int) -> None:
        from meshspeed.train.metrics import lr_at

        t = self.cfg.train
        self.opt.set_lr(lr_at(step, lr=t.lr, warmup=t.warmup_steps, total=t.steps, min_ratio=t.min_lr_ratio))
        if self.side.all_ahead:  # a decoder pipeline: every micro-batch encoded and sent first
            self.side.begin(self.loader, step)
            self.side.finish()
        else:
            outs = self._produce(self.loader, step)
            y = next(outs)
            m = self.loader.accum_steps
            for a in range(m):
                nxt = next(outs) if a + 1 < m else None  # one ahead: encoded while the decoder runs a
                with contextlib.nullcontext() if a == m - 1 else self.dp.no_sync():
                    S.drive(y)  # waits for micro-batch a's gradients, backpropagates them
                y = nxt
        self.dp.finish_grad_sync()
        norm = grad_norm(self.dp, self.enc_mesh)  # with the decoder's: one norm, every rank
        coef = clip_coefficient(norm, t.grad_clip) if t.grad_clip > 0 else None
        if math.isfinite(float(norm)):  # the decoder skips the same step (its loss is its norm's)
            self.opt.step(clip_coef=coef)
        self.opt.zero_grad()
        self.side.seam.flush()

    @torch.no_grad()
    def validate(self) -> None:
        for b in range(self.val_loader.num_batches):
            if self.side.all_ahead:  # every micro-batch sent when it begins; nothing comes back
                self.side.begin(self.val_loader, b)
                continue
            for _ in self._produce(self.val_loader, b):
                pass
        self.side.seam.flush()  # a send dropped unfinished with this object would never arrive

    def run(self) -> dict:
        from meshspeed.train.checkpointing import events, save

        last = None
        for step in range(self.start_step, self.cfg.train.steps):
            self.train_step(step)
            evaluate, saving, exiting = events(self.cfg, step + 1)
            if evaluate:
                self.validate()
            if saving:
                last = save(self, step + 1)
            if exiting:
                break
        self.side.seam.flush()
        return {"checkpoint": last}
