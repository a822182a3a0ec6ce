"""ZeRO-3 (`--parallel.zero 3`): the parameters are sharded over dp too, gathered one block at a time.

ZeRO-3 = ZeRO-2 + parameter storage released outside a block's use. DataParallel (data.py) lays
out one flat bucket per *unit*: each transformer block of the recipe's `pipeline.layers`, plus a
root unit holding every other parameter (embedding, final norm, output head), as FSDP2's
`fully_shard(block)` for each block and then `fully_shard(model)` do. As under ZeRO-2 each
bucket's gradient is reduce-scattered into a 1/dp fp32 shard during backward (at zero=3 a
bucket's full gradient storage goes as soon as the bucket two blocks later is launched) and
ZeroAdamW updates this rank's 1/dp slice. What this file adds:

- each bucket keeps only this rank's 1/dp slice of its parameters (`shards[i]`, parameter
  dtype; in float32 it *is* the optimizer's master). The full buffer's storage is resize_(0)'d:
  the parameters, views into it, keep their names, shapes and Sharding tags but hold no bytes;
- forward: a pre-hook on each block waits for its all-gather (issued one block earlier) and
  issues the next block's, asynchronously; a post-hook frees the block;
- backward: a hook on each block's output gradient (it runs before the block's backward nodes)
  gathers the block again and prefetches the one that ran before it; once every parameter of
  the block has its gradient (post-accumulate-grad hooks) its storage is freed. A callback at
  the end of backward frees whatever is left (parameters that got no gradient);
- the root unit is gathered by the model's pre-hook and kept through forward and backward (its
  head runs last in forward and first in backward) until its gradients are in; after a
  no-grad forward (validation) it stays until the next backward or `release()`;
- step() writes the updated slice into the shard and gathers nothing: the next forward does.
Writes into the gathered buffers go through the bucket, not the parameter, so they leave the
parameters' autograd version counters alone: tensors saved for backward stay valid.
Anything reading or writing whole parameters outside forward (checkpoints, exports) does it
inside `gathered()`.

Pipeline parallelism (`held()`, entered by PipelineRuntime.train_step and evaluate): a stage runs
its micro-batches' forwards and backwards interleaved (1F1B, interleaved chunks), each a forward
or backward of its own. Gathering per block and micro-batch (FSDP2's reshard_after_forward=True)
would all-gather every block 2·m times a step and make the hooks track which micro-batch's
backward runs next. Instead, as torchtitan does under pp (reshard_after_forward=False, reshard
after the last backward), every unit of the stage model is gathered once when the step begins
(asynchronously, in forward order: a block's pre-hook waits for its own gather only; the root,
whose embedding or head runs without a hook of its own, is waited for at once) and freed when it
ends; the hooks stand aside meanwhile. So within a step a rank holds its stage's whole
parameters (1/pp of the model), as ZeRO-2 does; between steps, 1/dp of them. Gradients are
ZeRO-2's under pp: full buckets accumulated (no_sync) until each chunk's last backward, then
reduce-scattered. The root unit differs per stage (embedding on the first, final norm and head
on the last, none in the middle): it is whatever the stage model holds outside its blocks.
Expert parallelism: a block's expert weights are a bucket of their own, reduced and sharded over
"edp" (DataParallel.group_of), so a block unit holds two or three buckets (dense and expert),
gathered and freed together, each over its own group; an edp of one rank keeps its bucket whole.
Refused (one line each, `check_zero3`, called by the run plan): sparse training and
zero_prefetch (ZeRO-1/2's gather).
"""

from __future__ import annotations

import contextlib
import fnmatch

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from meshspeed import comm

ROOT = ""  # the root unit's key: every parameter outside the blocks
FREE, PENDING, READY = "free", "pending", "ready"


def check_zero3(*, sparsity: str, prefetch: bool) -> None:
    """One ConfigError line for a setting ZeRO-3 does not combine with."""
    if sparsity != "none":
        raise comm.ConfigError(
            f"parallel.zero=3 with sparsity.pattern={sparsity}: masks read and edit whole weights "
            f"between steps, which ZeRO-3 does not keep; use parallel.zero 1 or 2"
        )
    if prefetch:
        raise comm.ConfigError(
            "parallel.zero_prefetch=true is ZeRO-1/2's post-step gather; ZeRO-3 always prefetches "
            "the next block's parameters: drop it"
        )


def unit_layout(model: nn.Module, named: list[tuple[str, torch.Tensor]], blocks: str | None):
    """(named in bucket order, {name: unit key}, {unit key: module} in forward order).

    Bucket order is backward's: the last block first, the root unit last (its embedding's
    gradient is the last to arrive), so DataParallel's in-order launches never wait long."""
    container = None
    if blocks:
        with contextlib.suppress(AttributeError):
            container = model.get_submodule(blocks)
    if container is None:
        raise comm.ConfigError(
            f"zero=3 needs the model's container of blocks (units={blocks!r} names none); pass the "
            f"recipe's pipeline.layers, e.g. units='layers'"
        )
    modules = {ROOT: model} | {f"{blocks}.{n}": m for n, m in container.named_children()}

    # Parameters a model uses outside their block's forward stay in the root unit, gathered for
    # the whole forward and backward: fnmatch patterns in `model.ms_zero3_root` (parallelize sets
    # them for a diffusers DiT, whose forward reruns block 0's conditioning embedder at the end).
    root = tuple(getattr(model, "ms_zero3_root", ()))

    def key(name: str) -> str:
        if name.startswith(blocks + ".") and not any(fnmatch.fnmatchcase(name, p) for p in root):
            return f"{blocks}.{name[len(blocks) + 1 :].split('.')[0]}"
        return ROOT

    units = {n: key(n) for n, _ in named}
    owner: dict[int, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if owner.setdefault(id(p), key(n)) != key(n):
            raise comm.ConfigError(
                f"zero=3: parameter {n} is shared by units {owner[id(p)] or 'root'!r} and "
                f"{key(n) or 'root'!r}; ZeRO-3 gathers a parameter with one unit only"
            )
    rank = {k: i for i, k in enumerate(modules)}
    ordered = sorted(reversed(named), key=lambda x: (units[x[0]] == ROOT, -rank[units[x[0]]]))
    return ordered, units, modules


class _Unit:
    def __init__(self, key: str, module: nn.Module, buckets: list[int], n_params: int):
        # buckets: one, or under ep a block's dense and expert buckets (reduced over dp / edp)
        self.key, self.module, self.buckets, self.n_params = key, module, buckets, n_params
        self.root = key == ROOT
        self.state = FREE
        self.handles: list = []
        self.got = 0  # parameters whose gradient arrived in this backward


class Zero3:
    """The parameter side of ZeRO-3 for one DataParallel (built by it when zero=3)."""

    def __init__(self, dp, blocks: str | None):
        self.dp = dp
        _, unit_of, modules = unit_layout(dp.module, list(dp.params.items()), blocks)
        by_key: dict[str, list] = {}
        for spec in dp.specs:
            by_key.setdefault(unit_of[spec.slots[0].name], []).append(spec)
        # forward order: the root, then the blocks as registered (blocks without parameters: none)
        self.units = [
            _Unit(k, m, [sp.index for sp in by_key[k]], sum(len(sp.slots) for sp in by_key[k]))
            for k, m in modules.items()
            if k in by_key
        ]
        self.of_bucket = {i: u for u in self.units for i in u.buckets}
        # a bucket is sharded over its reduction group (group_of: dp, or edp for experts); a group
        # of one rank (dp 1; edp 1 when ep = dp) keeps it whole, as ZeRO-2 does
        self.sharded = [dp.group_of(i).size > 1 for i in range(len(dp.buckets))]
        self.active = any(self.sharded)
        self.shards: list[torch.Tensor] = []
        self._nbytes: list[int] = []
        for i, b in enumerate(dp.buckets):
            self._nbytes.append(b.data.untyped_storage().nbytes())
            if not self.sharded[i]:
                self.shards.append(b.data)
                continue
            lo, hi = dp.dp_shard(i)
            self.shards.append(b.data[lo:hi].clone())
            b.data.untyped_storage().resize_(0)
        self.stats = {"gathers": 0, "prefetched_forward": 0, "prefetched_backward": 0, "frees": 0}
        self.peak_bytes = self.live_param_bytes()
        self._order: list[_Unit] = []  # units run by the current grad-mode forward, in order
        self._final_queued = False
        self._holding = False  # inside held(): every unit stays gathered, the hooks stand aside
        self._hooks = []
        if self.active:
            for u in self.units:
                self._hooks.append(u.module.register_forward_pre_hook(self._pre_forward(u)))
                self._hooks.append(u.module.register_forward_hook(self._post_forward(u)))
                for s in (s for i in u.buckets for s in dp.specs[i].slots):
                    self._hooks.append(dp.params[s.name].register_post_accumulate_grad_hook(self._grad_in(u)))

    # -- gather / free -----------------------------------------------------------------------
    def _gather(self, u: _Unit) -> bool:
        """Issue u's all-gathers (asynchronous); False when it is already gathered or on the way."""
        if u.state != FREE:
            return False
        for i in u.buckets:
            if not self.sharded[i]:
                continue
            b = self.dp.buckets[i]
            b.data.untyped_storage().resize_(self._nbytes[i])
            u.handles.append(comm.all_gather(self.shards[i], self.dp.group_of(i), out=b.data, async_op=True))
        u.state = PENDING
        self.stats["gathers"] += 1
        self.peak_bytes = max(self.peak_bytes, self.live_param_bytes())
        return True

    def _wait(self, u: _Unit) -> None:
        if u.state == PENDING:
            for h in u.handles:
                h.wait()
            u.handles, u.state = [], READY

    def _free(self, u: _Unit) -> None:
        if u.state == FREE:
            return
        self._wait(u)  # never release a buffer a collective is still writing
        for i in u.buckets:
            if self.sharded[i]:
                self.dp.buckets[i].data.untyped_storage().resize_(0)
        u.state = FREE
        self.stats["frees"] += 1

    def release(self) -> None:
        """Free every gathered unit (the root after a no-grad forward, say)."""
        for u in self.units:
            self._free(u)

    # -- hooks -------------------------------------------------------------------------------
    def _pre_forward(self, u: _Unit):
        nxt = self.units[self.units.index(u) + 1] if self.units.index(u) + 1 < len(self.units) else None

        def hook(module, args) -> None:
            if self._holding:
                self._wait(u)  # held(): gathered at the step's start, maybe still on the wire
                return
            if u.root and torch.is_grad_enabled():
                self._order = []
            prefetched = not self._gather(u)
            if nxt is not None:
                self._gather(nxt)  # on the wire while u computes
            self._wait(u)
            if not u.root:
                self.stats["prefetched_forward"] += prefetched
            if torch.is_grad_enabled():
                self._order.append(u)

        return hook

    def _post_forward(self, u: _Unit):
        def hook(module, args, output) -> None:
            if self._holding:
                return
            if torch.is_grad_enabled():
                order, pos = self._order, len(self._order) - 1
                for t in tree_leaves(output):
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(self._pre_backward(u, order, pos))
            if not u.root:
                self._free(u)

        return hook

    def _pre_backward(self, u: _Unit, order: list[_Unit], pos: int):
        # backward runs the units in the reverse of forward's order: the root's head first, then
        # the last block; prefetch the unit that ran just before this one (the root's: the last)
        if u.root:
            prev = order[-1] if len(order) > 1 else None
        else:
            prev = order[pos - 1] if pos > 1 else None  # order[0] is the root: still gathered

        def hook(grad: torch.Tensor) -> None:
            if not self._final_queued:
                self._final_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)
            prefetched = not self._gather(u)
            if prev is not None:
                self._gather(prev)
            self._wait(u)
            if not u.root:
                self.stats["prefetched_backward"] += prefetched

        return hook

    def _grad_in(self, u: _Unit):
        def hook(p: torch.Tensor) -> None:
            if self._holding:
                return
            u.got += 1
            if u.got == u.n_params:  # the unit's backward is over: nothing reads its weights now
                u.got = 0
                self._free(u)

        return hook

    def _after_backward(self) -> None:
        self._final_queued = False
        for u in self.units:
            u.got = 0
            self._free(u)

    # -- what the optimizer and checkpoints use ------------------------------------------------
    def publish(self, i: int, master: torch.Tensor | None = None) -> None:
        """The optimizer's updated slice of bucket i becomes this rank's shard (the optimizer
        writes it there itself unless `master` is given): no communication."""
        shard = self.shards[i]
        if master is not None and master.data_ptr() != shard.data_ptr():
            shard.copy_(master)
        u = self.of_bucket.get(i)
        if u is not None and self.sharded[i]:
            self._free(u)  # a gathered copy is stale now; the next use gathers the new values

    @torch.no_grad()
    def load(self, i: int, full: torch.Tensor) -> None:
        """Set bucket i's parameters from `full` (its whole flat values, every rank alike)."""
        lo, hi = self.dp.dp_shard(i) if self.sharded[i] else (0, full.numel())
        self.shards[i].copy_(full[lo:hi])
        u = self.of_bucket.get(i)
        if self.sharded[i] and u is not None and u.state != FREE:
            self._wait(u)
            self.dp.buckets[i].data.copy_(full)

    @contextlib.contextmanager
    def held(self):
        """Every unit gathered from entry to exit, the hooks standing aside: a pipeline step (or
        evaluation), whose micro-batches' forwards and backwards interleave (see the module's
        docstring). Gathers are issued at entry in forward order; a block's forward pre-hook
        waits for its own. Collective over dp on entry."""
        if not self.active or self._holding:
            yield
            return
        for u in self.units:
            self._gather(u)
        for u in self.units:
            if u.root:
                self._wait(u)  # the embedding / final norm and head run without a hook
        self._holding = True
        try:
            yield
        finally:
            self._holding = False
            self.release()

    @contextlib.contextmanager
    def gathered(self, writeback: bool = False):
        """Every parameter holds its full value inside (collective over dp on entry). With
        `writeback`, edits made inside are kept (this rank's slice goes back into its shard)."""
        if not self.active:
            yield
            return
        for u in self.units:
            self._gather(u)
        for u in self.units:
            self._wait(u)
        try:
            yield
        finally:
            if writeback:
                with torch.no_grad():
                    for i, shard in enumerate(self.shards):
                        if self.sharded[i]:  # else the shard is the bucket itself
                            lo, hi = self.dp.dp_shard(i)
                            shard.copy_(self.dp.buckets[i].data[lo:hi])
            self.release()

    def live_param_bytes(self) -> int:
        """Bytes of parameter storage this rank holds now: its shards and the gathered buckets
        (counted storage sizes, not an estimate)."""
        n = sum(s.untyped_storage().nbytes() for s in self.shards)
        n += sum(b.data.untyped_storage().nbytes() for i, b in enumerate(self.dp.buckets) if self.sharded[i])
        return n

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
