"""AdamW over DataParallel's flat buckets (ZeRO 0/1/2/3), and global gradient-norm clipping.

ZeroAdamW keeps, for the part of each bucket this rank updates (the whole bucket at zero=0,
its 1/dp slice at zero=1/2/3), an fp32 master copy of the parameters and the two AdamW moments.
In float32 the parameters' own storage is the master (the bucket at zero=0, its slice at
ZeRO-1/2, the rank's shard at ZeRO-3): updated in place and gathered from, never cloned. The
update is torch.optim.AdamW's (decoupled weight decay, bias correction), one kernel per bucket
(meshspeed.kernels.adamw: Triton on CUDA, torch's fused AdamW elsewhere) that also writes the
published bf16 parameters, applies the clipping factor and honours a non-finite flag; a float32
run equals torch's to rounding.

Weight decay: applied to parameters of two or more dimensions (matrices, embeddings included),
not to 1-D ones (norm weights, biases), as nanoGPT and Megatron do; pass
`no_decay(name, param) -> bool` to choose otherwise.

Gradient norm and clipping: grad_norm.py (re-exported here).
"""

from __future__ import annotations

import torch
from torch import nn

from meshspeed import comm
from meshspeed.kernels.adamw import AdamWHyper, DecayLayout, ViewCache, adamw_, resolve_impl
from meshspeed.parallel.buckets import segments
from meshspeed.parallel.data import DataParallel
from meshspeed.parallel.grad_norm import clip_coefficient, clip_grad_norm_, grad_norm

__all__ = ["ZeroAdamW", "build_data_parallel", "clip_coefficient", "clip_grad_norm_", "grad_norm"]

STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")


def default_no_decay(name: str, p: torch.Tensor) -> bool:
    """No weight decay for 1-D parameters (norm weights, biases)."""
    return p.dim() < 2


class _Shard:
    """The state of one bucket's opt_range. meshspeed.memory swaps in shards that keep it
    elsewhere (fp32_reuse.py: the master inside the bf16 parameters' storage; offload.py: on
    the host); between open() and close() `master`, `exp_avg` and `exp_avg_sq` are fp32
    tensors on the parameters' device, to read and change in place."""

    writes_params = False  # close() leaves the parameters alone: the kernel publishes them

    def __init__(self, master: torch.Tensor, decay: DecayLayout, owns_master: bool):
        self.master = master
        self.exp_avg = torch.zeros_like(master)
        self.exp_avg_sq = torch.zeros_like(master)
        self.decay = decay
        self.owns_master = owns_master
        self.views = ViewCache()

    def open(self) -> None:
        """Before the state is read or changed (here it always is where it lives)."""

    def close(self, changed: bool = True) -> None:
        """After; `changed`: it was written and must be stored back where it lives."""

    def nbytes(self) -> int:
        """Bytes of this state on the parameters' device."""
        return self.exp_avg.nbytes + self.exp_avg_sq.nbytes + (self.master.nbytes if self.owns_master else 0)


class ZeroAdamW:
    """AdamW with fp32 master weights, sharded over data parallelism at zero >= 1.

    param_groups[0] holds lr, betas, eps, weight_decay (a scheduler may set "lr" there, or
    call set_lr). step() finishes the gradient reduction first; zero_grad() zeros the buckets.
    impl: the update kernel, "auto" (Triton on CUDA, torch's fused AdamW elsewhere), "triton",
    "torch" or "reference" (one pass per term: the original arithmetic, bit for bit).
    """

    def __init__(
        self,
        dp: DataParallel,
        *,
        lr: float = 3e-4,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        no_decay=None,
        impl: str = "auto",
    ):
        if not lr >= 0:
            raise comm.ConfigError(f"lr={lr!r} must be >= 0")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise comm.ConfigError(f"betas={betas!r} must be two numbers in [0, 1), e.g. (0.9, 0.95)")
        if not eps > 0 or not weight_decay >= 0:
            raise comm.ConfigError(f"eps={eps!r} must be > 0 and weight_decay={weight_decay!r} >= 0")
        self.dp = dp
        self.impl = resolve_impl(impl, dp.buckets[0].data.device)
        self._skip_pending: torch.Tensor | None = None  # a device-side skip flag not read yet
        self.early = None  # memory.offload.EarlyUpdates: buckets updated during backward
        self._step_t: torch.Tensor | None = None
        # ZeRO-1 over dp > 1: the clipping factor of the last step, which the kernels applied to
        # this rank's slice of each bucket's gradient only (see clip_whole_grads)
        self._clip_rest: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.param_groups = [
            {
                "lr": float(lr),
                "betas": tuple(map(float, betas)),
                "eps": float(eps),
                "weight_decay": float(weight_decay),
            }
        ]
        self.step_count = 0
        no_decay = no_decay or default_no_decay
        decayed = {n for n, p in dp.params.items() if not no_decay(n, p)}
        self.shards: list[_Shard] = []
        for i, b in enumerate(dp.buckets):
            lo, hi = dp.opt_range(i)
            alias = dp.master_alias(i)
            if alias is not None:
                master, owns = alias, False  # fp32 parameters (their slice, or shard) are the master
            else:
                master, owns = dp.master_source(i)[lo:hi].clone(), True
            layout = DecayLayout(hi - lo, segments(b.spec, lo, hi, lambda s: s.name in decayed))
            self.shards.append(_Shard(master, layout, owns))
        dp.release_master_source()
        # whether this rank updates only a slice of some bucket (ZeRO over dp > 1)
        self._partial = any(dp.opt_range(i) != (0, b.spec.numel) for i, b in enumerate(dp.buckets))
        # views made once: slicing is an operator call per bucket and step otherwise
        self._grads = [dp.reduced_grad(i, *dp.opt_range(i)) for i in range(len(dp.buckets))]

    # -- scheduler hooks -------------------------------------------------------------------
    @property
    def lr(self) -> float:
        return self.param_groups[0]["lr"]

    def set_lr(self, lr: float) -> None:
        self.param_groups[0]["lr"] = float(lr)

    # -- step ------------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: ARG002 - buckets are reused, never None
        if self.early is not None:
            self.early.discard()  # a skipped step: what backward updated ahead is undone
        self._clip_rest = None
        self.dp.zero_grad()

    @torch.no_grad()
    def clip_whole_grads(self) -> None:
        """After a clipped step(): make the REST of every reduced bucket gradient hold the
        clipped product too, rounded as the kernel rounded this rank's slice, so each bucket's
        whole gradient is what one process (or clip_grad_norm_) leaves, on every dp rank.

        The kernels scale only the slice this rank updates (its opt_range). Under ZeRO-1 over
        dp > 1 each rank holds the whole reduced gradient, but after step() only its 1/dp slice
        is clipped: a reader of whole gradients between step() and zero_grad() (RigL or elastic
        N:M growth by |grad|, the gradient adapters) would see part clipped, part not, and a
        different mixture on each dp rank. The pass costs a multiply over the other (dp-1)/dp
        of the gradients, so it is made only here, on request, once per step; without ZeRO, at
        dp 1, or when the step clipped nothing it does nothing (ZeRO-2/3 keep only the slice)."""
        rest, self._clip_rest = self._clip_rest, None
        if rest is None:
            return
        coef, scale = rest
        dp = self.dp
        for i, b in enumerate(dp.buckets):
            if b.grad_shard is not None or b.freed:
                continue
            lo, hi = dp.opt_range(i)
            for g in (b.grad[:lo], b.grad[hi:]):
                if not g.numel():
                    continue
                if scale is not None and g.dtype == torch.float32:
                    g.div_(scale)  # torch's fused kernel divides by 1 / coef (adamw_torch)
                else:
                    g.mul_(coef.to(g.device))  # the reference, Triton and bf16-gradient paths

    def _settle(self) -> None:
        """Take back the count of a step its kernel skipped on the device (found_inf), read
        one step late so that the step itself never waited for the flag."""
        if self._skip_pending is not None:
            self.step_count -= int(bool(self._skip_pending))
            self._skip_pending = None

    def hyper(self) -> AdamWHyper:
        g = self.param_groups[0]
        return AdamWHyper(g["lr"], *g["betas"], g["eps"], g["weight_decay"], self.step_count)

    @torch.no_grad()
    def step(self, clip_coef: torch.Tensor | None = None, found_inf: torch.Tensor | None = None) -> None:
        """One AdamW step. clip_coef: 0-d tensor the gradients are multiplied by first (the
        buckets keep the product, as clip_grad_norm_ leaves them; see clip_coefficient);
        found_inf: 0-d tensor, nonzero = change nothing (on CUDA decided by the kernel, with no
        host synchronisation: the step count is corrected at the next step)."""
        dp = self.dp
        dp.finish_grad_sync()
        self._settle()
        on_device = self.impl == "triton"  # the others read the scalars on the host
        if found_inf is not None and not on_device:
            if bool(found_inf):
                if self.early is not None:
                    self.early.discard()
                return
            found_inf = None
        if clip_coef is not None and not on_device and float(clip_coef) >= 1.0:
            clip_coef = None  # clip_grad_norm_'s rule: no product when nothing is clipped
        self.step_count += 1
        self._skip_pending = found_inf
        hp = self.hyper()
        # memory.offload's early updates (made during backward) stand or are undone here
        ahead = self.early.settle(hp, clip_coef, found_inf) if self.early is not None else 0
        step_t = self.step_tensor(hp)
        scale = clip_coef.reciprocal() if clip_coef is not None and self.impl == "torch" else None
        # what clip_whole_grads applies to the gradients outside this rank's slices, if asked
        partial = clip_coef is not None and found_inf is None and self._partial
        self._clip_rest = (clip_coef, scale) if partial else None
        handles = []
        for i in range(len(self.shards)):
            if i >= ahead:
                self.update_bucket(i, hp, clip_coef, found_inf, step_t, grad_scale=scale)
            # Issued per bucket so the gather of bucket i overlaps the update of bucket i+1.
            h = dp.publish(i)
            if h is not None:
                handles.append(h)
        for h in handles:
            h.wait()

    def step_tensor(self, hp: AdamWHyper) -> torch.Tensor | None:
        """The step count as torch's fused kernel takes it: one tensor, set once per step."""
        if self.impl != "torch":
            return None
        if self._step_t is None:
            self._step_t = torch.zeros((), device=self.dp.buckets[0].data.device)
        return self._step_t.fill_(float(hp.step))

    def update_bucket(self, i: int, hp: AdamWHyper, clip_coef=None, found_inf=None, step_t=None,
                      close: bool = True, grad_scale=None) -> None:  # fmt: skip
        """Bucket i's update: its state opened, one kernel (writing the published parameters
        into dp.param_slice(i) too), closed unless `close` is False (the caller closes it)."""
        dp, st = self.dp, self.shards[i]
        dp.before_update(i)  # a gather still reading (or writing) the parameters' slice
        st.open()
        out = None if st.writes_params else dp.param_slice(i)
        if out is not None and out.data_ptr() == st.master.data_ptr():
            out = None  # fp32: the master is the parameters' storage
        adamw_(st.master, self._grads[i], st.exp_avg, st.exp_avg_sq, hp, st.decay, impl=self.impl,
               clip_coef=clip_coef, found_inf=found_inf, out=out, step_t=step_t,
               cache=getattr(st, "views", None), grad_scale=grad_scale)  # fmt: skip
        if close:
            st.close()

    # -- per-parameter state (CONTRACTS.md §2) ---------------------------------------------
    def _full_state(self, i: int) -> torch.Tensor:
        """[3, bucket numel] fp32: master, exp_avg, exp_avg_sq of all of bucket i (gathered)."""
        st, dp = self.shards[i], self.dp
        group = dp.group_of(i)
        st.open()
        if not dp.zero or group.size == 1:
            full = torch.stack([st.master.float(), st.exp_avg, st.exp_avg_sq])
        else:
            flat = comm.all_gather(torch.cat([st.master, st.exp_avg, st.exp_avg_sq]), group)
            full = flat.view(group.size, 3, -1).transpose(0, 1).reshape(3, -1)
        st.close(changed=False)
        return full

    def state_dict_per_param(self) -> dict:
        """{fqn: {"master", "exp_avg", "exp_avg_sq"}, "__step__": int}: fp32, local tp shape,
        identical on every dp rank and for every ZeRO stage. Collective over the dp group."""
        out: dict = {}
        for i, b in enumerate(self.dp.buckets):
            full = self._full_state(i)
            for s in b.spec.slots:
                out[s.name] = {
                    k: full[j, s.offset : s.offset + s.numel].view(s.shape).clone()
                    for j, k in enumerate(STATE_KEYS)
                }
        self._settle()
        out["__step__"] = self.step_count
        return out

    @torch.no_grad()
    def load_state_dict_per_param(self, state: dict) -> None:
        """Inverse of state_dict_per_param: each rank keeps its slice; the parameters are set
        from the masters. Needs no communication (every rank has the full dict)."""
        dp = self.dp
        names = set(dp.slots)
        given = {k for k in state if k != "__step__"}
        if names != given or "__step__" not in state:
            raise KeyError(
                f"optimizer state does not match the model: missing {sorted(names - given)[:8]}, "
                f"unexpected {sorted(given - names)[:8]}, "
                f"__step__ {'present' if '__step__' in state else 'missing'}"
            )
        for i, (b, st) in enumerate(zip(dp.buckets, self.shards)):
            full = torch.zeros(3, b.spec.numel, dtype=torch.float32, device=b.data.device)
            for s in b.spec.slots:
                for j, k in enumerate(STATE_KEYS):
                    t = state[s.name][k]
                    if tuple(t.shape) != s.shape:
                        raise comm.ConfigError(
                            f"optimizer state {s.name}.{k} has shape {list(t.shape)}, the "
                            f"parameter here has local shape {list(s.shape)}; reshard it first"
                        )
                    full[j, s.offset : s.offset + s.numel].copy_(t.reshape(-1))
            lo, hi = dp.opt_range(i)
            st.open()
            st.master.copy_(full[0, lo:hi])
            st.exp_avg.copy_(full[1, lo:hi])
            st.exp_avg_sq.copy_(full[2, lo:hi])
            st.close()
            dp.load_params(i, full[0])
        self.step_count, self._skip_pending = int(state["__step__"]), None

    @torch.no_grad()
    def reset_state_where(self, param: torch.Tensor, where: torch.Tensor) -> int:
        """Zero `param`, its fp32 master and both AdamW moments where `where` is True.

        For dynamic sparse training (RigL/SET): a regrown weight starts at zero with no stale
        moments. The master must be zeroed with the parameter, or the next step() would write
        the old value back (bf16 parameters, ZeRO). `where`: bool in the parameter's local (tp)
        shape, the same on every dp rank. No communication: each rank edits the state it holds.
        Returns the number of positions reset.
        """
        names = self.__dict__.get("_names_by_id")
        if names is None:
            names = self._names_by_id = {id(p): n for n, p in self.dp.params.items()}
        name = names.get(id(param))
        if name is None:
            raise KeyError("reset_state_where: the tensor is not one of this optimizer's parameters")
        if tuple(where.shape) != tuple(param.shape):
            raise ValueError(
                f"reset_state_where({name}): mask shape {list(where.shape)} != parameter "
                f"shape {list(param.shape)}"
            )
        dp, s = self.dp, self.dp.slots[name]
        where = where.to(device=param.device, dtype=torch.bool)
        param.data.masked_fill_(where, 0)  # a view into the bucket: every rank's copy of the weight
        lo, hi = dp.opt_range(s.bucket)
        a, b = max(s.offset, lo), min(s.offset + s.numel, hi)
        if a < b:  # the part of this parameter whose optimizer state this rank holds
            sel = where.reshape(-1)[a - s.offset : b - s.offset]
            st = self.shards[s.bucket]
            st.open()
            for t in (st.master, st.exp_avg, st.exp_avg_sq):
                t[a - lo : b - lo].masked_fill_(sel, 0)
            st.close()
        return int(where.sum())

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds on the parameters' device (fp32 masters it
        owns + both moments; offloaded state is on the host, and shared masters' residuals in
        the parameters' own storage, neither counted here)."""
        return sum(st.nbytes() for st in self.shards)


def build_data_parallel(
    model: nn.Module,
    mesh,
    *,
    zero: int = 0,
    bucket_mb: float = 25.0,
    dtype: torch.dtype = torch.bfloat16,
    grad_dtype: torch.dtype = torch.float32,
    lr: float = 3e-4,
    weight_decay: float = 0.1,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    no_decay=None,
    group: str = "dp",
    units: str | None = None,
    impl: str = "auto",
):
    """Make `model` data parallel over mesh[group] and build its (ZeRO) AdamW.

    units (zero=3): the FQN of the model's container of blocks (the recipe's pipeline.layers),
    each block gathered on its own (meshspeed.parallel.zero3).

    dtype: parameter storage and compute (bf16 default; fp32 for exactness checks). Master
    weights and AdamW moments are fp32 whatever it is; gradients are accumulated and reduced in
    grad_dtype (fp32 default). impl: ZeroAdamW's update kernel. Returns (DataParallel, ZeroAdamW).
    """
    dp = DataParallel(
        model,
        mesh,
        zero=zero,
        bucket_mb=bucket_mb,
        param_dtype=dtype,
        grad_dtype=grad_dtype,
        group=group,
        units=units,
    )
    opt = ZeroAdamW(dp, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, no_decay=no_decay, impl=impl)
    return dp, opt
