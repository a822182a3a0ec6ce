"""torch's own implementations meshspeed is measured against, built one way for every benchmark:
DistributedDataParallel, DDP + ZeroRedundancyOptimizer, FSDP2 (fully_shard per block, then the
root) and DTensor tensor parallelism (torchtitan's Llama plan, + DDP over dp), each with torch
AdamW at the harness's settings. They call torch.distributed directly: they are the peers, and
meshspeed itself speaks only through meshspeed.comm.
"""

from __future__ import annotations

import inspect

import torch

from benchmarks.harness import BETAS, EPS, LR, WD, storage_bytes

ADAMW_IMPLS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}


# ------------------------------------------------------------------------------ optimizer
def adamw(model, impl: str | None = "fused") -> torch.optim.AdamW:
    """torch AdamW over the model's trainable parameters: decay on >= 2-D ones only, as meshspeed."""
    return torch.optim.AdamW(adamw_groups(model), **adamw_kwargs(impl))


def adamw_groups(model) -> list[dict]:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}]


def adamw_kwargs(impl: str | None = "fused") -> dict:
    """fused: torch's fastest (its fused CPU/CUDA kernel); foreach; for-loop; None: torch's
    default for the parameters' device."""
    return dict(lr=LR, betas=BETAS, eps=EPS, **(ADAMW_IMPLS[impl] if impl else {}))


def optimizer_state(opt) -> list[torch.Tensor]:
    """The tensors a torch optimizer keeps (ZeroRedundancyOptimizer: its local optimizer's)."""
    inner = getattr(opt, "optim", opt)
    return [v for st in inner.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


def counted_bytes(opt) -> dict:
    """Storage bytes of optimizer state, gradients and parameters, counted from the tensors the
    optimizer trains rather than model.parameters(): after a forward, _pre_dp_module_transform's
    hook has put fresh (grad-less) Parameter objects on the model. (ZeroRedundancyOptimizer's
    param_groups hold every parameter, not only its partition.)"""
    params = [p for g in opt.param_groups for p in g["params"]]
    return {
        "state": storage_bytes(optimizer_state(opt)),
        "grads": storage_bytes(p.grad for p in params),
        "params": storage_bytes(params),
    }


# ------------------------------------------------------------------------------ data parallel
def ddp(model, group, bucket_mb: float = 25.0):
    """DistributedDataParallel at its fastest settings for these models: gradients as bucket
    views, no per-forward buffer broadcast (the only buffers are constant RoPE tables; torch
    2.13 renamed that switch, broadcast_buffers=False is the older spelling). Its first bucket
    is 1 MiB whatever bucket_mb says."""
    from torch.nn.parallel import DistributedDataParallel

    kw = (
        {"forward_sync_buffers": False}
        if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
        else {"broadcast_buffers": False}
    )
    return DistributedDataParallel(
        model, process_group=group, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True, **kw
    )


def zero_redundancy_adamw(model, group, impl: str = "fused"):
    """torch's ZeRO-1: AdamW state partitioned over `group` (put DDP around the model)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(
        adamw_groups(model), optimizer_class=torch.optim.AdamW, process_group=group, **adamw_kwargs(impl)
    )


def fsdp2(model, mesh, reshard_after_forward: bool, param_dtype: torch.dtype | None = None, blocks=None):
    """FSDP2: fully_shard(block) for every block (`blocks`, default meshspeed's `model.layers`),
    then fully_shard(model), over the 1-D DeviceMesh `mesh`. reshard_after_forward=True is
    ZeRO-3's schedule (gather per block in forward and again in backward); False gathers once
    per step (ZeRO-2's traffic). param_dtype: MixedPrecisionPolicy(param_dtype,
    reduce_dtype=float32), torch's bf16 idiom."""
    # torch >= 2.6 exports it from torch.distributed.fsdp
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard

    kw = dict(mesh=mesh, reshard_after_forward=reshard_after_forward)
    if param_dtype is not None and param_dtype != torch.float32:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in model.layers.values() if blocks is None else blocks:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def fsdp2_param_bytes(model) -> int:
    """Parameter storage FSDP2 holds on this rank now: sharded data, all-gather outputs,
    unsharded parameters and in-flight all-gather buffers (its internals, read only)."""
    out = []
    for m in model.modules():
        state = m._get_fsdp_state() if hasattr(m, "_get_fsdp_state") else None
        if state is None:
            continue
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            groups = [g] if (g := getattr(state, "_fsdp_param_group", None)) is not None else []
        for g in groups:
            for fp in g.fsdp_params:
                out += [fp._sharded_param_data, getattr(fp, "_unsharded_param", None), *fp.all_gather_outputs]
            if (r := getattr(g, "_all_gather_result", None)) is not None:
                out.append(r.all_gather_output)
            if (s := getattr(g.comm_ctx, "all_gather_state", None)) is not None:
                out.append(s.all_gather_result.all_gather_output)
    return storage_bytes(out)


# ------------------------------------------------------------------------------ tensor parallel
def dtensor_plan(model, sp: bool, loss_parallel: bool) -> tuple[dict, dict]:
    """(model-level, per-block) parallelize_module plans: torchtitan's Llama plan, on the
    projections meshspeed splits; with sp the sequence is gathered before attention and the
    feed-forward (sequence_parallel_norm does the norms)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    seq = Shard(1) if sp else Replicate()
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(
            input_layouts=seq,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    layer = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=seq),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=seq),
    }
    if sp:
        # PrepareModuleInput needs one layout per positional input: x is gathered over the
        # sequence, the rest (cos, sin, doc_ids, ...) pass through. Counted from the signature,
        # so an input added to Attention.forward cannot break the peer again.
        block = next(iter(model.layers.values()))
        rest = (None,) * (len(inspect.signature(block.attention.forward).parameters) - 1)
        layer["attention"] = PrepareModuleInput(
            input_layouts=(Shard(1), *rest), desired_input_layouts=(Replicate(), *rest)
        )
        layer["feed_forward"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        )
    return plan, layer


def sequence_parallel_norm(norm, tp_mesh) -> None:
    """torch's SequenceParallel for a norm, whichever way the block calls it: norm(x) -> y, or
    the fused residual add norm(x, residual) -> (h, y). SequenceParallel itself takes the first
    input only and one output, so it cannot run the second form. Every tensor input arrives as
    its sequence shard (DTensor Shard(1)), the weight is replicated (its gradient summed over
    the shards, as SequenceParallel's), every output leaves as the local shard."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module

    def replicate(name, module, mesh):
        for p_name, p in module.named_parameters(recurse=False):
            dt = DTensor.from_local(p.detach(), mesh, [Replicate()], run_check=False)
            module.register_parameter(p_name, torch.nn.Parameter(dt))

    def inputs(module, args, mesh):
        def shard(a):
            plain = isinstance(a, torch.Tensor) and not isinstance(a, DTensor)
            return DTensor.from_local(a, mesh, [Shard(1)], run_check=False) if plain else a

        return tuple(shard(a) for a in args)

    def outputs(module, out, mesh):
        return tuple(o.to_local() for o in out) if isinstance(out, tuple) else out.to_local()

    distribute_module(norm, tp_mesh, replicate, inputs, outputs)


def dtensor_tp(model, tp_mesh, sp: bool, loss_parallel: bool = False):
    """DTensor tensor parallelism over the 1-D DeviceMesh `tp_mesh` (dense models only:
    torchtitan shards experts with expert parallelism instead)."""
    from torch.distributed.tensor.parallel import parallelize_module

    if model.config.is_moe:
        raise NotImplementedError(
            "no DTensor plan for MoE layers here (torchtitan shards experts with expert "
            "parallelism instead); use a dense --model"
        )
    top, layer = dtensor_plan(model, sp, loss_parallel)
    parallelize_module(model, tp_mesh, top)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, layer)
    if sp:
        for norm in [model.norm] + [n for b in model.layers.values() for n in (b.attention_norm, b.ffn_norm)]:
            sequence_parallel_norm(norm, tp_mesh)
    return model


def tp_ddp(model, group, bucket_mb: float = 25.0):
    """DDP over dp around a DTensor-parallel model: torch's TP + DDP recipe
    (_pre_dp_module_transform, then DDP)."""
    from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform

    _pre_dp_module_transform(model)
    return ddp(model, group, bucket_mb)
