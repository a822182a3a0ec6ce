"""Data parallelism: flat gradient buckets reduced during backward, and the ZeRO shard layout.

    dp, opt = build_data_parallel(model, mesh, zero=1, dtype=torch.bfloat16, lr=3e-4)  # optim.py
    for i, batch in enumerate(micro_batches):                    # loss scaled by 1/len(...)
        with dp.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
            (loss_fn(model(batch)) / len(micro_batches)).backward()
    norm = clip_grad_norm_(dp, 1.0, mesh)                        # waits for the reductions
    opt.step(); opt.zero_grad()

Layout (buckets.py): trainable parameters packed, roughly in backward's order, into flat
buckets of about `bucket_mb` of gradient, each parameter's `.data` a view into its bucket's
parameter buffer and its gradient a view into the gradient buffer: `p.grad` itself when the
dtypes match (autograd then accumulates in place, no copy), else `p.main_grad` (bf16
parameters with fp32 gradients: the hook adds the bf16 gradient in and drops it).

Overlap. A post-accumulate-grad hook counts each parameter in; a complete bucket is reduced at
once with an async collective (average over dp), while backward goes on with earlier layers.
Buckets are launched strictly in index order so every rank issues the same collectives in the
same order; a bucket whose parameters got no gradient (unused) goes out in finish_grad_sync().

ZeRO. zero=0: all-reduce; the optimizer updates whole buckets. zero=1: all-reduce (full
reduced gradients stay readable, e.g. by sparse-training growth criteria); the optimizer keeps
fp32 master + AdamW moments for this rank's 1/dp slice of every bucket and all-gathers the
updated parameters. zero=2: reduce-scatter into a 1/dp fp32 gradient shard, after which the
full bucket's storage is released (re-allocated, zeroed, by the next backward's first hook), so
outside backward a rank holds 1/dp of the gradients. Gradient accumulation under no_sync keeps
full buckets until the last micro-batch (one reduction per step, not per micro-batch).
zero=3 (zero3.py): zero=2 with one bucket per transformer block (`units`) plus one for the rest,
whose parameter storage, too, is 1/dp outside the block's forward and backward.
"""

from __future__ import annotations

import contextlib
import math
import weakref

import torch
from torch import nn

from meshspeed import comm
from meshspeed.comm import placement
from meshspeed.parallel import zero3 as zero3_mod
from meshspeed.parallel.buckets import Bucket, aliases, describe, plan_buckets

GROUPS = ("dp", "dp_cp")  # dp_cp with context parallelism: cp ranks see other tokens of a sample


class DataParallel:
    """Owns the flat buckets of `model`'s trainable parameters and reduces their gradients over
    `mesh[group]`. Not an nn.Module: the model keeps its own parameter names (FQNs)."""

    def __init__(
        self,
        model: nn.Module,
        mesh,
        *,
        zero: int = 0,
        bucket_mb: float = 25.0,
        param_dtype: torch.dtype | None = None,
        grad_dtype: torch.dtype = torch.float32,
        group: str = "dp",
        units: str | None = None,
    ):
        if zero not in (0, 1, 2, 3):
            raise comm.ConfigError(f"zero={zero!r} is not a ZeRO stage; valid: 0, 1, 2, 3")
        if not (isinstance(bucket_mb, (int, float)) and bucket_mb > 0):
            raise comm.ConfigError(f"bucket_mb={bucket_mb!r} must be a number of MiB > 0, e.g. 25")
        if group not in GROUPS:
            raise comm.ConfigError(f"data-parallel group={group!r}; valid: {', '.join(GROUPS)}")
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise comm.ConfigError(
                "the model has no trainable parameters (requires_grad=True) to data-parallelise"
            )
        dtypes = {p.dtype for _, p in named}
        if param_dtype is None and len(dtypes) > 1:
            raise comm.ConfigError(
                f"parameters have several dtypes {sorted(map(str, dtypes))}; pass param_dtype="
            )
        self.module, self.mesh, self.zero, self.group_name = model, mesh, zero, group
        self.group = mesh[group]
        self.param_dtype = param_dtype or next(iter(dtypes))
        self.grad_dtype = grad_dtype
        self.params: dict[str, nn.Parameter] = dict(named)
        # Expert parallelism: expert weights (split over "ep") are reduced over "edp", the ranks
        # holding the same experts, in buckets of their own (ZeRO shards them over edp too).
        # Their gradients already sum the whole ep group's tokens (the backward all-to-all brought
        # them), so the edp sum holds every dp × cp rank's contribution: the bucket is scaled by
        # edp / (dp × cp) first (1/ep; tp/ep when edp also spans tp, whose ranks split the tokens).
        expert = {n for n, p in named if _expert_sharded(p)}
        self._groups = {"dp": self.group, "expert": mesh["edp"] if expert else self.group}
        self.expert_scale = mesh["edp"].size / mesh["dp_cp"].size if expert else 1.0
        # ep or edp spanning tp: the tp ranks hold other experts, or other slices of an expert
        # bucket (edp's members split it): each tp rank's part counts in the gradient norm
        tp_ranks = set(mesh["tp"].ranks) if expert else set()
        self._experts_vary_over_tp = any(len(set(mesh[g].ranks) & tp_ranks) > 1 for g in ("ep", "edp"))
        cap = max(1, int(bucket_mb * 2**20) // torch.empty((), dtype=grad_dtype).element_size())
        order, unit_of = list(reversed(named)), None
        if zero == 3:  # zero3.py: one bucket per block (units: the recipe's pipeline.layers) + a root
            # (experts: a block's expert weights get buckets of their own, sharded over edp)
            order, unit_of, _ = zero3_mod.unit_layout(model, named, units)
            cap = math.inf
        self.specs = plan_buckets(
            [(n, tuple(p.shape)) for n, p in order],
            cap,
            self.group.size,
            kinds={n: "expert" for n in expert},
            sizes={k: g.size for k, g in self._groups.items()},
            units=unit_of,
        )
        self.slots = {s.name: s for spec in self.specs for s in spec.slots}
        device = named[0][1].device
        self.buckets = [Bucket(spec, self.param_dtype, grad_dtype, device) for spec in self.specs]
        self.views_grad = self.param_dtype == grad_dtype  # p.grad is the bucket view itself
        # fp32 copies of the starting values for the optimizer's masters, when the parameter
        # buffer cannot give them exactly (bf16 storage of an fp32 model); see master_source.
        self._source: list[torch.Tensor | None] = []
        self._slices: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # param_slice's, by bucket
        self._gviews: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for b in self.buckets:
                src = (
                    torch.zeros(b.spec.numel, dtype=torch.float32, device=device)
                    if self.param_dtype != torch.float32
                    else None
                )
                for s in b.spec.slots:
                    p = self.params[s.name]
                    flat = p.detach().reshape(-1)
                    b.data[s.offset : s.offset + s.numel].copy_(flat)
                    if src is not None:
                        src[s.offset : s.offset + s.numel].copy_(flat)
                    p.data = b.data[s.offset : s.offset + s.numel].view(s.shape)
                    self._gviews[s.name] = g = b.grad[s.offset : s.offset + s.numel].view(s.shape)
                    if self.views_grad:
                        p.grad = g
                    else:
                        p.grad = None
                        p.main_grad = g
                self._source.append(src)
                size = self._groups[b.spec.kind].size
                if zero >= 2 and size > 1:
                    b.grad_shard = torch.zeros(b.spec.numel // size, dtype=grad_dtype, device=device)
        self.require_grad_sync = True
        self._marked: set[str] = set()
        self._next = 0  # next bucket to launch
        self._final = 0  # next bucket to report to on_final
        # on_final: called with i once bucket i's reduction has landed in a synchronising
        # backward (memory.offload's early update); grad_version: bumped whenever gradients change
        # outside backward (scaled, zeroed), so that such an early update knows it is stale
        self.on_final: list = []
        self.grad_version = 0
        self._dirty = False  # gradients accumulated since the last reduction
        # grad_comm_bytes: gradient bytes handed to dp collectives (payload, not per-algorithm wire bytes)
        self.stats = {"launched_in_backward": 0, "launched_in_finish": 0, "syncs": 0, "grad_comm_bytes": 0}
        self.grad_comm = None  # meshspeed.parallel.sparse_comm.SparseGradComm: packs masked gradients
        self._norm_plan: list[tuple[int, int, int, bool]] | None = None  # grad_norm.norm_segments
        self.events: list[tuple[str, object]] | None = None  # set to [] to log ("grad", name) / ("launch", i)
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(n)) for n, p in named]
        # ZeRO-3: this rank keeps 1/dp of the parameters; blocks are gathered around their use
        self.zero3 = zero3_mod.Zero3(self, units) if zero == 3 else None

    # -- use -------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (no communication) for the micro-batches inside."""
        old, self.require_grad_sync = self.require_grad_sync, False
        try:
            yield
        finally:
            self.require_grad_sync = old

    def finish_grad_sync(self) -> None:
        """Launch what backward did not, wait for every reduction. Idempotent; call before
        reading gradients (the optimizer and clip_grad_norm_ call it themselves)."""
        if not self._dirty:
            for i in range(len(self.buckets)):  # zero_grad, then read without a backward
                self.settle(i)
            return
        while self._next < len(self.buckets):
            self._launch(self._next, "launched_in_finish")
        for b in self.buckets:
            if b.handle is not None:
                b.handle.wait()
                b.handle = None
        if self.zero >= 2:
            for b in self.buckets:
                if b.grad_shard is None:
                    continue  # a group of one: nothing was reduce-scattered
                for s in b.spec.slots:
                    p = self.params[s.name]
                    if p.grad is not None and aliases(p.grad, self._gviews[s.name]):
                        p.grad = None  # its storage goes now; only the shard is kept
                b.free()
        for b in self.buckets:
            b.ready = 0
        self._marked.clear()
        self._next, self._final, self._dirty = 0, 0, False
        self.stats["syncs"] += 1

    @torch.no_grad()
    def zero_grad(self) -> None:
        self.finish_grad_sync()  # never zero a buffer a collective is still writing
        self.grad_version += 1
        for b in self.buckets:
            if b.freed:
                continue  # zero=2: re-allocated zeroed by the next backward
            b.landed.clear()
            if self.views_grad:  # autograd adds into p.grad (the view itself): zeros are needed
                b.grad.zero_()
                for s in b.spec.slots:
                    self.params[s.name].grad = self._gviews[s.name]
            else:  # each first gradient is copied, not added: zero only what none reaches (settle)
                b.stale = True

    def settle(self, i: int) -> None:
        """Zero bucket i's views no gradient reached since zero_grad (still the last step's
        values): a small fill per unused parameter, not a pass of zeros over the bucket each
        step (~2 ms at 1.92B fp32 gradients on an H200). Before the bucket is reduced or read."""
        b = self.buckets[i]
        if not b.stale:
            return
        for s in b.spec.slots:
            if s.name not in b.landed:
                self._gviews[s.name].zero_()
        b.stale = False

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self.zero3 is not None:
            self.zero3.remove_hooks()

    # -- backward --------------------------------------------------------------------------
    def _make_hook(self, name: str):
        slot = self.slots[name]
        # The parameter holds this hook; a strong reference back to self would be a cycle through
        # the parameter's C++ side that the collector cannot see, keeping every bucket, master
        # and the model alive after the trainer is dropped (GiBs per trainer on a GPU).
        ref = weakref.ref(self)

        def hook(p: torch.Tensor) -> None:
            self = ref()
            if self is None:
                return
            b = self.buckets[slot.bucket]
            self._accumulate(p, name, b)
            self._dirty = True
            if self.events is not None:
                self.events.append(("grad", name))
            if not self.require_grad_sync:
                return
            if name in self._marked:
                raise RuntimeError(
                    f"meshspeed DataParallel: parameter {name} got a second gradient after its bucket was "
                    "reduced in this step. ---> HINT: run every micro-batch but the last inside "
                    "dp.no_sync(), and call dp.finish_grad_sync() / opt.step() before the next backward"
                )
            self._marked.add(name)
            b.ready += 1
            while self._next < len(self.buckets) and self.buckets[self._next].ready == len(
                self.buckets[self._next].spec.slots
            ):
                self._launch(self._next, "launched_in_backward")
            if self.on_final:
                self._report_final()

        return hook

    def _report_final(self) -> None:
        """Call on_final(i), in bucket order, for each launched bucket whose reduction has landed
        (polled, never waited for: backward goes on meanwhile). A bucket is final then: no later
        gradient of this step can reach it."""
        while self._final < self._next:
            h = self.buckets[self._final].handle
            if h is not None:
                done = getattr(h, "is_completed", None)
                if done is None or not done():
                    return
                h.wait()  # landed: this only runs the collective's finishing (the average)
                self.buckets[self._final].handle = None
            for fn in self.on_final:
                fn(self._final)
            self._final += 1

    @torch.no_grad()
    def _accumulate(self, p: torch.Tensor, name: str, b: Bucket) -> None:
        """The gradient lands in the fp32 bucket once, Megatron's main-grad way: fp32 ones are
        the bucket itself (autograd adds in place); a bf16 one (or the first after a release) is
        copied in when it is the parameter's first since the bucket was zeroed (the copy casts
        in the same pass, where a CPU add would cast into a temporary first), added otherwise,
        and dropped: no p.grad is kept."""
        b.materialize()
        view, g = self._gviews[name], p.grad
        if g is None or aliases(g, view):
            return  # autograd accumulated into the bucket itself
        if name in b.landed:
            view.add_(g)
        else:
            view.copy_(g)
            b.landed.add(name)
        p.grad = view if self.views_grad else None

    def _launch(self, i: int, counter: str) -> None:
        b = self.buckets[i]
        b.materialize()  # a bucket of unused parameters may still be released
        self.settle(i)
        self._next = i + 1
        self.stats[counter] += 1
        if self.events is not None:
            self.events.append(("launch", i))
        if b.spec.kind == "expert" and self.expert_scale != 1.0:
            b.grad.mul_(self.expert_scale)
        group = self.group_of(i)
        if group.size == 1:
            return
        if self.grad_comm is not None:
            b.handle = self.grad_comm.launch(i, b)  # None: this bucket goes dense
            if b.handle is not None:
                return
        self.stats["grad_comm_bytes"] += b.grad.numel() * b.grad.element_size()
        if self.zero >= 2:
            b.handle = comm.reduce_scatter(b.grad, group, "avg", out=b.grad_shard, async_op=True)
            if self.zero3 is not None and i >= 2:
                self._release_grad(i - 2)  # ZeRO-3: about two blocks' full gradients alive, not all
        else:
            b.handle = comm.all_reduce(b.grad, group, "avg", async_op=True)

    def _release_grad(self, i: int) -> None:
        """Bucket i's full gradient storage goes once its reduce-scatter has landed in the shard."""
        b = self.buckets[i]
        if b.handle is not None:
            b.handle.wait()
            b.handle = None
        if b.grad_shard is None or b.freed:
            return
        for s in b.spec.slots:
            p = self.params[s.name]
            if p.grad is not None and aliases(p.grad, self._gviews[s.name]):
                p.grad = None
        b.free()

    # -- what the optimizer and clipping read ----------------------------------------------
    def group_of(self, i: int) -> comm.Group:
        """The group bucket i is reduced (and ZeRO-sharded) over: dp (or dp_cp), or edp for experts."""
        return self._groups[self.specs[i].kind]

    def dp_shard(self, i: int) -> tuple[int, int]:
        """This rank's 1/dp slice of bucket i: disjoint across dp whatever the ZeRO stage."""
        g = self.group_of(i)
        return self.specs[i].shard(g.rank, g.size)

    def opt_range(self, i: int) -> tuple[int, int]:
        """The part of bucket i this rank's optimizer updates."""
        return self.dp_shard(i) if self.zero else (0, self.specs[i].numel)

    def reduced_grad(self, i: int, lo: int, hi: int) -> torch.Tensor:
        """Reduced gradient of bucket i over [lo, hi) (within this rank's shard under zero=2)."""
        b = self.buckets[i]
        if b.grad_shard is None:
            return b.grad[lo:hi]
        base = self.dp_shard(i)[0]
        return b.grad_shard[lo - base : hi - base]

    def master_source(self, i: int) -> torch.Tensor:
        """Full fp32 starting values of bucket i (for the optimizer's master weights)."""
        src = self._source[i]
        return src if src is not None else self.buckets[i].data.float()

    def master_alias(self, i: int) -> torch.Tensor | None:
        """A buffer that can be the optimizer's fp32 master of bucket i itself (no copy), or None:
        this rank's part of the parameter storage (param_slice) when the parameters are fp32."""
        return self.param_slice(i) if self.param_dtype == torch.float32 else None

    def param_slice(self, i: int) -> torch.Tensor:
        """The parameter storage of this rank's opt_range of bucket i, where the optimizer writes
        the updated (rounded) parameters before publish(i): the bucket, its 1/dp slice, or at
        ZeRO-3 the rank's shard. Made once per buffer (a slice is an operator call)."""
        b = self.buckets[i]
        cached = self._slices.get(i)
        if cached is not None and cached[0] is b.data:
            return cached[1]
        if self.zero3 is not None:
            out = self.zero3.shards[i]
        else:
            lo, hi = self.opt_range(i)
            out = b.data if (lo, hi) == (0, b.spec.numel) else b.data[lo:hi]
        self._slices[i] = (b.data, out)
        return out

    @torch.no_grad()
    def load_params(self, i: int, full: torch.Tensor) -> None:
        """Set bucket i's parameters from its whole flat values (the same on every dp rank)."""
        if self.zero3 is not None:
            self.zero3.load(i, full)
        else:
            self.buckets[i].data.copy_(full)

    def release_master_source(self) -> None:
        self._source = [None] * len(self.buckets)

    def before_update(self, i: int) -> None:
        """Before the optimizer rewrites bucket i's param_slice: the previous step's gather of
        that slice (zero_prefetch: still in flight) must have read it."""
        prefetch = getattr(self, "prefetch", None)
        if prefetch is not None:
            prefetch.wait_bucket(i)

    def publish(self, i: int):
        """Bring the updated param_slice(i) to every dp rank's parameters (the optimizer has
        written it); returns a handle to wait on (or None). ZeRO-1/2 gather in place from the
        slice into the bucket; ZeRO-3 gathers at the next use."""
        group = self.group_of(i)
        if not self.zero or group.size == 1:
            return None
        if self.zero3 is not None:  # the shard is the parameter storage: the next forward gathers
            return self.zero3.publish(i)
        src, b = self.param_slice(i), self.buckets[i]
        prefetch = getattr(self, "prefetch", None)  # zero_prefetch.py: gathered during the next forward
        if prefetch is not None:
            return prefetch.publish(i, src)
        return comm.all_gather(src, group, out=b.data, async_op=True)

    @torch.no_grad()
    def scale_grads_(self, coef: torch.Tensor) -> None:
        self.grad_version += 1
        for b in self.buckets:
            (b.grad_shard if b.grad_shard is not None else b.grad).mul_(coef)

    def grad_bytes(self) -> int:
        """Bytes of gradient storage this rank holds now (counted, not estimated)."""
        return sum(
            (0 if b.freed else b.nbytes)
            + (b.grad_shard.untyped_storage().nbytes() if b.grad_shard is not None else 0)
            for b in self.buckets
        )

    def layout(self) -> str:
        """The bucket layout, one line per bucket."""
        return describe(self.specs)


def _expert_sharded(p: torch.Tensor) -> bool:
    sharding = placement.sharding_of(p)
    return sharding is not None and any(d == "ep" for d, _ in sharding.axes)
