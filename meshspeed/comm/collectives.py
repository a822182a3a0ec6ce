"""Public collectives. Each takes a Group, returns its result (or a Handle with async_op=True).

The backend's own collective ("native") is the default; a meshspeed algorithm runs when the
caller (`algo=`), MESHSPEED_ALGO, or the cost model picks it — the model picks one where the
backend's op is wasteful (gloo's reduce_scatter is an all-reduce plus a slice) and where the
sizes are uneven (backends need equal chunks). Algorithms run on the group's worker thread
when async on CPU backends, so they overlap the caller's compute like a native async op.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

import meshspeed.comm.algorithms as alg
import meshspeed.comm.cost_model as cost_model
from meshspeed.comm.desync import signature
from meshspeed.comm.errors import ConfigError
from meshspeed.comm.group import Done, Group, Lane
from meshspeed.comm.trace import dtype_name

REDUCE_OPS = ("sum", "avg", "max", "min")
# torch 2.13 renamed the tensor forms (the old names warn); torch 2.11 only has the old ones.
_all_gather_t = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_t = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_TORCH_OP = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def select_algo(group: Group, op: str, nbytes: int, algo: str | None, uneven: bool = False) -> str:
    """Resolve `algo` (None/"auto" = environment, then cost model) to a runnable algorithm."""
    if algo in (None, "auto"):
        forced = group.ctx.forced_algos
        algo = forced.get(op) or (forced["*"] if forced.get("*") in cost_model.ALGOS[op] else None)
        if algo is not None and algo not in cost_model.candidates(op, group.nodes, uneven):
            # MESHSPEED_ALGO names an algorithm for every call of the op; where one call cannot
            # run it (native with uneven chunks, hier on one node) that call is chosen as usual
            # rather than failing a run the user only meant to steer.
            algo = None
    if algo in (None, "auto"):
        if group.algo_params is not group.ctx.link_params:  # new parameters: new choices
            group.algo_choices, group.algo_params = {}, group.ctx.link_params
        key = (op, nbytes, uneven)
        if key not in group.algo_choices:
            group.algo_choices[key] = cost_model.choose(
                op, nbytes, group.nodes, group.backend, group.ctx.link_params, uneven
            )
        return group.algo_choices[key]
    valid = cost_model.ALGOS[op]
    if algo not in valid:
        raise ConfigError(f"algo={algo!r} is not an algorithm for {op}; valid: {', '.join(valid)}")
    if algo not in cost_model.candidates(op, group.nodes, uneven):
        why = (
            "the sizes are uneven and the backend needs equal chunks"
            if algo == "native"
            else "the group does not span several nodes with several ranks each"
        )
        raise ConfigError(f"algo={algo!r} cannot run {op} on group {group.name}: {why}")
    return algo


def _runner(group: Group, async_op: bool, fn):
    """Start function for meshspeed algorithms: on the worker thread when async (CPU), inline
    otherwise (and always on CUDA, where send/recv are already asynchronous on streams)."""

    def start(deadline: float, seq: int):
        lane = Lane(group, seq, deadline)
        if async_op and group.ctx.device.type == "cpu":
            return [group.worker().submit(lambda: fn(lane))]
        fn(lane)
        return []

    return start


def _check_op(op: str, dtype: torch.dtype) -> None:
    if op not in REDUCE_OPS:
        raise ConfigError(f"reduce op {op!r} is not supported; valid: {', '.join(REDUCE_OPS)}")
    if op == "avg" and not dtype.is_floating_point:
        raise ConfigError(
            f"op='avg' needs a floating-point tensor, got {dtype_name(dtype)}; use op='sum' and divide"
        )


def _widen(op: str, dtype: torch.dtype, divides_after_sum: bool) -> bool:
    """An fp16 average summed in fp16 overflows (65504 is its largest value: two ranks holding
    40000 sum to inf), so it is summed in fp32 and divided there. NCCL's native average scales
    before summing and needs no help."""
    return op == "avg" and dtype == torch.float16 and divides_after_sum


def all_reduce(
    tensor: torch.Tensor, group: Group, op: str = "sum", *, async_op: bool = False, algo: str | None = None
):
    """In place over `tensor` (returned too): the elementwise reduction across the group."""
    _check_op(op, tensor.dtype)
    if group.size == 1:
        return Done(tensor) if async_op else tensor
    algo = select_algo(group, "all_reduce", _nbytes(tensor), algo)
    native_avg = group.backend == "nccl"
    if _widen(op, tensor.dtype, not (algo == "native" and native_avg)):
        buf = tensor.float()  # a copy: finish() writes the average back into `tensor`
    else:
        buf = tensor if tensor.is_contiguous() else tensor.contiguous()
    flat = buf.view(-1)

    def finish():
        if op == "avg" and not (algo == "native" and native_avg):
            buf.div_(group.size)
        if buf is not tensor:
            tensor.copy_(buf)
        return tensor

    if algo == "native":
        torch_op = dist.ReduceOp.AVG if (op == "avg" and native_avg) else _TORCH_OP.get(op, dist.ReduceOp.SUM)
        start = lambda deadline, seq: [dist.all_reduce(buf, op=torch_op, group=group.pg, async_op=True)]  # noqa: E731
    else:
        me, members = group.rank, list(range(group.size))
        run = {
            "ring": lambda lane: alg.ring_all_reduce(lane, members, me, flat, op),
            "hd": lambda lane: alg.hd_all_reduce(lane, members, me, flat, op),
            "hier": lambda lane: alg.hier_all_reduce(lane, members, group.nodes, me, flat, op),
        }[algo]
        start = _runner(group, async_op, run)
    sig = signature("all_reduce", tensor.shape, dtype_name(tensor.dtype), f"op={op}")
    return group.issue(sig, algo, _nbytes(tensor), start, finish, async_op)


def broadcast(tensor: torch.Tensor, group: Group, src: int = 0, *, async_op: bool = False):
    """In place: every member gets member `src`'s tensor (src is an index into group.ranks)."""
    if not 0 <= src < group.size:
        raise ConfigError(f"broadcast src={src} is not a member index of {group.name} (0..{group.size - 1})")
    if group.size == 1:
        return Done(tensor) if async_op else tensor
    buf = tensor if tensor.is_contiguous() else tensor.contiguous()

    def finish():
        if buf is not tensor:
            tensor.copy_(buf)
        return tensor

    start = lambda deadline, seq: [dist.broadcast(buf, src=group.ranks[src], group=group.pg, async_op=True)]  # noqa: E731
    sig = signature("broadcast", tensor.shape, dtype_name(tensor.dtype), f"src={src}")
    return group.issue(sig, "native", _nbytes(tensor), start, finish, async_op)


def _to_front(t: torch.Tensor, dim: int) -> torch.Tensor:
    return (t if dim == 0 else t.movedim(dim, 0)).contiguous()


def _out_buffer(out: torch.Tensor | None, shape: tuple, like: torch.Tensor, what: str) -> torch.Tensor:
    """A caller-provided output (reused across calls: on CPU a fresh multi-MB buffer costs page
    faults on every call) or a new one."""
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    if tuple(out.shape) != tuple(shape) or out.dtype != like.dtype or not out.is_contiguous():
        raise ConfigError(
            f"{what} out= must be a contiguous {dtype_name(like.dtype)} tensor of shape {list(shape)}, "
            f"got {dtype_name(out.dtype)} {list(out.shape)}"
        )
    return out


def all_gather(
    tensor: torch.Tensor,
    group: Group,
    dim: int = 0,
    *,
    sizes: list[int] | None = None,
    out: torch.Tensor | None = None,
    async_op: bool = False,
    algo: str | None = None,
):
    """Concatenate every member's tensor along `dim` (member order). `sizes` gives each
    member's extent along `dim` when they differ (every member passes the same list).
    `out` (dim 0 only) receives the result instead of a new tensor."""
    dim = dim % max(tensor.dim(), 1)
    if group.size == 1:
        return Done(tensor) if async_op else tensor
    sizes = list(sizes) if sizes is not None else [tensor.shape[dim]] * group.size
    if len(sizes) != group.size or sizes[group.rank] != tensor.shape[dim]:
        raise ConfigError(
            f"all_gather sizes={sizes} must list {group.size} extents with this member's "
            f"({tensor.shape[dim]}) at index {group.rank}"
        )
    uneven = len(set(sizes)) > 1
    x = _to_front(tensor, dim)  # [n_dim, ...rest]
    inner = math.prod(x.shape[1:])
    if out is not None and dim != 0:
        raise ConfigError("all_gather out= is supported for dim=0 only")
    out = _out_buffer(out, (sum(sizes),) + tuple(x.shape[1:]), x, "all_gather")
    algo = select_algo(group, "all_gather", _nbytes(out), algo, uneven)

    def finish():
        return out if dim == 0 else out.movedim(0, dim).contiguous()

    if algo == "native":
        start = lambda deadline, seq: [_all_gather_t(out, x, group=group.pg, async_op=True)]  # noqa: E731
    else:
        elems = [s * inner for s in sizes]
        flat_out, me, members = out.view(-1), group.rank, list(range(group.size))

        def run(lane):
            if algo == "ring":
                parts = alg.chunks(flat_out, [0] + [sum(elems[: i + 1]) for i in range(len(elems))])
                parts[me].copy_(x.view(-1))
                alg.ring_all_gather(lane, members, me, parts)
            else:
                mine = x.view(-1)
                if mine.untyped_storage().data_ptr() == flat_out.untyped_storage().data_ptr():
                    mine = mine.clone()  # gathered in place (x is out's own chunk): cat cannot alias
                torch.cat(alg.bruck_all_gather(lane, members, me, mine, elems), out=flat_out)

        start = _runner(group, async_op, run)
    key = f"dim={dim}" + (f" sizes={sizes}" if uneven else "")
    shape = list(tensor.shape)
    if uneven:
        shape[dim] = -1  # legitimately differs between members; `sizes` must agree instead
    sig = signature("all_gather", shape, dtype_name(tensor.dtype), key)
    return group.issue(sig, algo, _nbytes(out), start, finish, async_op)


def reduce_scatter(
    tensor: torch.Tensor,
    group: Group,
    op: str = "sum",
    dim: int = 0,
    *,
    out: torch.Tensor | None = None,
    async_op: bool = False,
    algo: str | None = None,
):
    """Reduce across the group, member i keeping chunk i along `dim` (tensor_split chunks, so
    the extent need not divide the group size: the first extent % size members get one more).
    `out` (dim 0 only) receives the result instead of a new tensor."""
    _check_op(op, tensor.dtype)
    dim = dim % max(tensor.dim(), 1)
    if group.size == 1:
        return Done(tensor) if async_op else tensor
    x = _to_front(tensor, dim)
    n = x.shape[0]
    uneven = n % group.size != 0
    algo = select_algo(group, "reduce_scatter", _nbytes(tensor), algo, uneven)
    offs = alg.bounds(n, group.size)
    me = group.rank
    if out is not None and dim != 0:
        raise ConfigError("reduce_scatter out= is supported for dim=0 only")
    shape = (offs[me + 1] - offs[me],) + tuple(x.shape[1:])
    dest = _out_buffer(out, shape, x, "reduce_scatter") if out is not None else None
    wide = _widen(op, x.dtype, True)  # every reduce_scatter path divides after summing
    if wide:
        x, dest_narrow, dest = x.float(), dest, None
    result: list[torch.Tensor] = []

    def finish():
        y = result[0]
        if dest is not None and y is not dest:
            y = dest.copy_(y)
        if op == "avg":
            y.div_(group.size)
        if wide:  # back to fp16, into the caller's buffer when there is one
            y = dest_narrow.copy_(y) if dest_narrow is not None else y.to(tensor.dtype)
        return y if dim == 0 else y.movedim(0, dim).contiguous()

    if algo == "native":
        res = dest if dest is not None else torch.empty(shape, dtype=x.dtype, device=x.device)
        result.append(res)
        torch_op = _TORCH_OP.get(op, dist.ReduceOp.SUM)
        start = lambda deadline, seq: [_reduce_scatter_t(res, x, op=torch_op, group=group.pg, async_op=True)]  # noqa: E731
    else:
        inner = math.prod(x.shape[1:])
        parts = alg.chunks(x.view(-1), [o * inner for o in offs])
        members = list(range(group.size))
        fn = alg.ring_reduce_scatter if algo == "ring" else alg.bruck_reduce_scatter

        def run(lane):
            result.append(fn(lane, members, me, parts, op).view(shape))

        start = _runner(group, async_op, run)
    sig = signature("reduce_scatter", tensor.shape, dtype_name(tensor.dtype), f"op={op} dim={dim}")
    return group.issue(sig, algo, _nbytes(tensor), start, finish, async_op)


def all_to_all(
    tensor: torch.Tensor,
    group: Group,
    in_splits: list[int] | None = None,
    out_splits: list[int] | None = None,
    *,
    out: torch.Tensor | None = None,
    async_op: bool = False,
    algo: str | None = None,
):
    """Exchange rows (dim 0): rows in_splits[j] go to member j; out_splits[j] arrive from j.
    Without splits the rows are divided equally (dim 0 must divide the group size)."""
    p = group.size
    if (in_splits is None) != (out_splits is None):
        raise ConfigError("all_to_all needs both in_splits and out_splits (or neither)")
    if in_splits is None:
        if tensor.shape[0] % p:
            raise ConfigError(
                f"all_to_all of {tensor.shape[0]} rows over {p} members needs in_splits/out_splits "
                f"(rows do not divide evenly)"
            )
        in_splits = out_splits = [tensor.shape[0] // p] * p
    in_splits, out_splits = [int(s) for s in in_splits], [int(s) for s in out_splits]
    if len(in_splits) != p or len(out_splits) != p or sum(in_splits) != tensor.shape[0]:
        raise ConfigError(
            f"all_to_all splits must have {p} entries and in_splits must sum to {tensor.shape[0]} "
            f"rows; got in_splits={in_splits} out_splits={out_splits}"
        )
    if p == 1:
        return Done(tensor) if async_op else tensor
    x = tensor.contiguous()
    out = _out_buffer(out, (sum(out_splits),) + tuple(x.shape[1:]), x, "all_to_all")
    algo = select_algo(group, "all_to_all", _nbytes(x), algo)
    if algo == "native":
        # Equal splits go without split lists: backends then take their all-to-all path
        # rather than the slower all-to-all-v one.
        even = len(set(in_splits)) == 1 and len(set(out_splits)) == 1
        osz, isz = (None, None) if even else (out_splits, in_splits)
        def start(deadline, seq):
            return [dist.all_to_all_single(out, x, osz, isz, group=group.pg, async_op=True)]
    else:
        send, recv, members = list(x.split(in_splits)), list(out.split(out_splits)), list(range(p))
        start = _runner(
            group, async_op, lambda lane: alg.pairwise_all_to_all(lane, members, group.rank, send, recv)
        )
    sig = signature(
        "all_to_all", tensor.shape, dtype_name(tensor.dtype), "", splits={"in": in_splits, "out": out_splits}
    )
    return group.issue(sig, algo, _nbytes(x), start, lambda: out, async_op)


def barrier(group: Group, *, async_op: bool = False):
    """Return when every member has called it (with the usual timeout and diagnosis)."""
    if group.size == 1:
        return Done() if async_op else None
    token = torch.zeros(1, device=group.ctx.device)
    start = lambda deadline, seq: [dist.all_reduce(token, group=group.pg, async_op=True)]  # noqa: E731
    return group.issue(signature("barrier", [], "-"), "native", 0, start, None, async_op)
