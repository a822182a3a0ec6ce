"""AdamW over DataParallel's flat buckets (ZeRO 0/1/2/3), and global gradient-norm clipping.

ZeroAdamW keeps, for the part of each bucket this rank updates (the whole bucket at zero=0,
its 1/dp slice at zero=1/2/3), an fp32 master copy of the parameters (shared with the parameter
buffer itself when that is fp32 and unsharded) and the two AdamW moments. The update is
torch.optim.AdamW's (decoupled weight decay, bias correction, the same operation order), run
elementwise on flat slices, so a float32 run equals torch's to rounding.

Weight decay: applied to parameters of two or more dimensions (matrices, embeddings included),
not to 1-D ones (norm weights, biases), as nanoGPT and Megatron do; pass
`no_decay(name, param) -> bool` to choose otherwise.

Gradient norm: the norm of the logical (single-device) model's gradient. Each rank sums the
squares it is responsible for and one all-reduce over the world adds them: tensor-parallel
shards (CONTRACTS.md §1) count on every tp rank, replicated parameters only on tp rank 0;
DataParallel's buckets count only this rank's 1/dp slice (disjoint; under zero=2 that is all it
holds); pipeline stages all count (their parameters differ); context-parallel replicas only once.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from meshspeed import comm
from meshspeed.parallel.buckets import segments
from meshspeed.parallel.data import DataParallel, tp_sharded

STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")


def default_no_decay(name: str, p: torch.Tensor) -> bool:
    """No weight decay for 1-D parameters (norm weights, biases)."""
    return p.dim() < 2


class _Shard:
    """The state of one bucket's opt_range. meshspeed.memory swaps in shards that keep it
    elsewhere (fp32_reuse.py: the master inside the bf16 parameters' storage; offload.py: on
    the host); between open() and close() `master`, `exp_avg` and `exp_avg_sq` are fp32
    tensors on the parameters' device, to read and change in place."""

    def __init__(self, master: torch.Tensor, decay: list[tuple[int, int]], owns_master: bool):
        self.master = master
        self.exp_avg = torch.zeros_like(master)
        self.exp_avg_sq = torch.zeros_like(master)
        self.decay = decay
        self.owns_master = owns_master

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
    ):
        if not lr >= 0:
            raise comm.ConfigError(f"lr={lr!r} must be >= 0")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise comm.ConfigError(f"betas={betas!r} must be two numbers in [0, 1), e.g. (0.9, 0.95)")
        if not eps > 0 or not weight_decay >= 0:
            raise comm.ConfigError(f"eps={eps!r} must be > 0 and weight_decay={weight_decay!r} >= 0")
        self.dp = dp
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
                master, owns = alias, False  # fp32 parameters (zero=3: their shard) are the master
            else:
                master, owns = dp.master_source(i)[lo:hi].clone(), True
            self.shards.append(_Shard(master, segments(b.spec, lo, hi, lambda s: s.name in decayed), owns))
        dp.release_master_source()

    # -- scheduler hooks -------------------------------------------------------------------
    @property
    def lr(self) -> float:
        return self.param_groups[0]["lr"]

    def set_lr(self, lr: float) -> None:
        self.param_groups[0]["lr"] = float(lr)

    # -- step ------------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: ARG002 - buckets are reused, never None
        self.dp.zero_grad()

    @torch.no_grad()
    def step(self) -> None:
        dp = self.dp
        dp.finish_grad_sync()
        self.step_count += 1
        g = self.param_groups[0]
        lr, (beta1, beta2), eps, wd = g["lr"], g["betas"], g["eps"], g["weight_decay"]
        step = float(self.step_count)
        # Exactly torch.optim.AdamW's (single-tensor, non-capturable) scalar arithmetic.
        bias_correction1 = 1 - beta1**step
        bias_correction2_sqrt = (1 - beta2**step) ** 0.5
        step_size = lr / bias_correction1
        handles = []
        for i, st in enumerate(self.shards):
            lo, hi = dp.opt_range(i)
            grad = dp.reduced_grad(i, lo, hi)
            if grad.dtype != torch.float32:
                grad = grad.float()
            st.open()
            p = st.master
            if wd:
                for a, e in st.decay:
                    p[a:e].mul_(1 - lr * wd)
            st.exp_avg.lerp_(grad, 1 - beta1)
            st.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denom = (st.exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
            p.addcdiv_(st.exp_avg, denom, value=-step_size)
            st.close()
            # Issued per bucket so the gather of bucket i overlaps the update of bucket i+1.
            h = dp.publish(i, p)
            if h is not None:
                handles.append(h)
        for h in handles:
            h.wait()

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
        self.step_count = int(state["__step__"])

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


# ------------------------------------------------------------------------------ clipping
def _owner(mesh, dims: tuple[str, ...]) -> bool:
    return all(mesh.coords[d] == 0 for d in dims)


def grad_norm(target, mesh, norm_type: float = 2.0) -> torch.Tensor:
    """Norm of the logical model's gradient (fp32 scalar, the same on every rank); collective
    over the world. target: a DataParallel, ZeroAdamW, nn.Module or iterable of parameters
    (plain parameters: .main_grad if present, else .grad, taken as reduced over dp)."""
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise comm.ConfigError(f"norm_type={norm_type!r} must be > 0 (2.0, or inf for the max norm)")
    if isinstance(target, ZeroAdamW):
        target = target.dp
    if isinstance(target, DataParallel):
        target.finish_grad_sync()
        segs = target.norm_segments()
        replicated = ("cp",) if target.group_name == "dp" else ()  # the dp slices are disjoint
        device = target.buckets[0].grad.device
    else:
        params = target.parameters() if isinstance(target, nn.Module) else target
        segs = []
        for p in params:
            g = getattr(p, "main_grad", None)
            g = g if g is not None else p.grad
            if g is not None:
                segs.append((g, tp_sharded(p)))
        replicated = ("dp", "cp")
        device = segs[0][0].device if segs else torch.device(mesh.ctx.device)
    keep = {True: _owner(mesh, replicated), False: _owner(mesh, replicated + ("tp",))}
    inf = math.isinf(norm_type)
    local = torch.zeros((), dtype=torch.float64, device=device)
    for g, tp in segs:
        if not g.numel() or not (inf or keep[tp]):
            continue
        # float64: a float32 norm over a whole flat bucket is only good to ~2e-5 relative, enough
        # for layouts (whose buckets differ) to report visibly different grad norms.
        n = torch.linalg.vector_norm(g, norm_type, dtype=torch.float64)
        local = torch.maximum(local, n) if inf else local + n**norm_type
    total = comm.all_reduce(local.reshape(1), mesh["world"], "max" if inf else "sum")[0]
    return (total if inf else total ** (1.0 / norm_type)).float()


def clip_grad_norm_(target, max_norm: float, mesh, norm_type: float = 2.0) -> torch.Tensor:
    """Scale all gradients so that their global norm is at most max_norm (torch's rule:
    coef = max_norm / (norm + 1e-6), clamped to 1). Returns the norm before clipping."""
    if not isinstance(target, (DataParallel, ZeroAdamW, nn.Module)):
        target = list(target)  # read twice: once for the norm, once to scale
    total = grad_norm(target, mesh, norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if coef.item() < 1.0:
        if isinstance(target, ZeroAdamW):
            target = target.dp
        if isinstance(target, DataParallel):
            target.scale_grads_(coef)
        else:
            params = target.parameters() if isinstance(target, nn.Module) else target
            with torch.no_grad():
                for p in params:
                    g = getattr(p, "main_grad", None)
                    g = g if g is not None else p.grad
                    if g is not None:
                        g.mul_(coef.to(g.device))
    return total


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
):
    """Make `model` data parallel over mesh[group] and build its (ZeRO) AdamW.

    units (zero=3): the FQN of the model's container of blocks (the recipe's pipeline.layers),
    each block gathered on its own (meshspeed.parallel.zero3).

    dtype: parameter storage and compute (bf16 default; fp32 for exactness checks). Master
    weights and AdamW moments are fp32 whatever it is; gradients are accumulated and reduced in
    grad_dtype (fp32 default). Returns (DataParallel, ZeroAdamW).
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
    opt = ZeroAdamW(dp, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, no_decay=no_decay)
    return dp, opt
