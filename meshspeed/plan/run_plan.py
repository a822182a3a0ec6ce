"""The run plan: the whole run resolved once, before any worker starts, and handed to them.

    plan = make_plan(cfg, world_size)      # every check; a ConfigError line when one fails
    print(describe(plan))                  # `meshspeed train --dry-run`
    Trainer(cfg, ctx, plan)                # the workers build what the plan says

This is the only place that derives the layout (dp from the world size), the micro-batch count
(global batch / (micro batch × dp)) and the model config (preset + overrides, or the config a
`model.init_from` directory records). Everything that can be wrong with the settings is found
here, in the parent process (or, under torchrun, in each rank before it joins the job), so a bad
value costs one line and no spawned worker. The per-rank table (parameters, estimated memory)
comes from the same meta-device build and tensor-parallel plan the workers run, not from a
formula kept beside them: one build on the meta device, its tensor-parallel pieces tagged, then
each rank's count read off the tags and the pipeline stages it holds.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field

import torch

from meshspeed.comm import ConfigError, ParallelDims
from meshspeed.comm.placement import chunk_sizes, sharding_of
from meshspeed.comm.recipe import build_on_meta
from meshspeed.data.loader import accumulation_steps
from meshspeed.interop.model_source import preset_config
from meshspeed.models import ModelConfig, recipe_for
from meshspeed.models.hf import check_exportable
from meshspeed.parallel.context import check_cp
from meshspeed.parallel.tensor import check_tp, parallelize
from meshspeed.parallel.zero3 import check_zero3
from meshspeed.plan import config as config_mod
from meshspeed.plan import modules as per_module
from meshspeed.plan.describe import describe  # noqa: F401 - the plan's text, beside the plan
from meshspeed.plan.device import plan_device
from meshspeed.plan.estimate import estimate_memory
from meshspeed.plan.experts import apply_expert_parallel, check_experts, with_moe_settings
from meshspeed.plan.flow import check_flow, check_image_data
from meshspeed.plan.vlm import check_vlm, check_vlm_data


@dataclass
class RunPlan:
    """Plain data (JSON-able): what every worker receives."""

    config: dict  # the Config, as Config.to_dict()
    world_size: int
    dims: dict  # {"dp", "pp", "cp", "tp", "ep", "etp", "tp_extend_ep"}
    microbatches: int  # micro-batches per rank per optimizer step (accumulation / pipeline)
    model: dict  # the ModelConfig, as dataclasses.asdict
    weights: str | None = None  # a meshspeed checkpoint to load after building (init_from one)
    stages: list = field(default_factory=list)  # pipeline stages: rank, chunk, layers, embedding, head
    bubble: float = 0.0  # idle fraction of the pipeline schedule (equal-cost actions)
    peak_microbatches: list = field(default_factory=list)  # per pp rank: forwards awaiting backward
    total_params: int = 0
    ranks: list = field(default_factory=list)  # per rank: rank, coords, params, memory
    warnings: list = field(default_factory=list)
    modules: dict = field(default_factory=dict)  # [modules]: per-module layout (plan/modules.py)
    device: str = "cpu"  # cpu | cuda: run.device resolved for this node's GPUs (workers follow it)
    device_info: dict = field(default_factory=dict)  # backend, local_ranks, local_gpus, why

    def model_config(self) -> ModelConfig:
        return ModelConfig(**self.model)

    def parallel_dims(self) -> ParallelDims:
        return ParallelDims(**self.dims)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> RunPlan:
        return cls(**d)


# --- the layout ------------------------------------------------------------------------------


def resolve_layout(cfg, world_size: int) -> tuple[ParallelDims, int]:
    """(degrees, micro-batches per rank per step) for this world size, or one line saying what
    to change."""
    p, t = cfg.parallel, cfg.train
    rest = p.tp * p.pp * p.cp
    cp = f" × parallel.cp={p.cp}" if p.cp > 1 else ""
    if world_size % rest:
        raise ConfigError(
            f"parallel.tp={p.tp} × parallel.pp={p.pp}{cp} = {rest} does not divide the world size "
            f"{world_size}; use --nproc {rest * max(1, world_size // rest)} or smaller degrees"
        )
    dp = p.dp or world_size // rest
    if dp * rest != world_size:
        raise ConfigError(
            f"parallel.dp={p.dp} × tp={p.tp} × pp={p.pp}{cp.replace('parallel.', '')} = {dp * rest} ranks, "
            f"but the world size is {world_size}; set parallel.dp={world_size // rest} (or 0 for automatic)"
        )
    # the one rule for micro-batches per step (the loader applies the same function)
    microbatches = accumulation_steps(t.global_batch_size, t.micro_batch_size, dp)
    dims = ParallelDims(
        dp=dp, pp=p.pp, cp=p.cp, tp=p.tp, ep=p.ep, etp=p.etp, tp_extend_ep=cfg.moe.tp_extend_ep
    )
    return dims, microbatches


def _model(cfg):
    """(ModelConfig, recipe, checkpoint to load weights from or None)."""
    if cfg.model.init_from:
        from meshspeed.interop.hf_import import init_from

        return init_from(cfg)
    config = preset_config(cfg.model.preset, cfg.model.overrides(), cfg.train.seq_len)
    return config, recipe_for(config), None


def resolve_model(cfg):
    """(ModelConfig with the [moe] settings applied, recipe): the model a plan is made for."""
    config, recipe, _ = _model(cfg)
    return with_moe_settings(cfg, config), recipe


def _check_model(cfg, config: ModelConfig, recipe) -> None:
    p, t = cfg.parallel, cfg.train
    check_tp(p.tp, recipe)
    if cfg.data.packing and p.pp > 1:
        raise ConfigError(f"data.packing=true with parallel.pp={p.pp} is not supported yet; use pp=1")
    if p.cp > 1 and not recipe.cp_tokens:  # a family cutting its own tokens checks them (plan/flow.py)
        check_cp(p.cp_impl, p.cp, config.n_heads // p.tp, t.seq_len, p.cp_ulysses, recipe.causal)
    if p.sequence_parallel and p.tp > 1 and t.seq_len % p.tp:
        good = (t.seq_len // p.tp + 1) * p.tp
        raise ConfigError(
            f"train.seq_len={t.seq_len} is not divisible by parallel.tp={p.tp}, which sequence "
            f"parallelism needs; use train.seq_len={good} or parallel.sequence_parallel=false"
        )
    if cfg.checkpoint.export_hf:  # refused now, not after training
        check_exportable(config, "checkpoint.export_hf=true: ")
    check_experts(cfg, config)
    if p.zero == 3:
        check_zero3(sparsity=cfg.sparsity.pattern, prefetch=p.zero_prefetch)
    m = cfg.memory
    if m.loss_chunk < 1:
        raise ConfigError(f"memory.loss_chunk={m.loss_chunk} must be ≥ 1 (sequence positions per chunk)")
    _check_memory_features(cfg)


def _check_memory_features(cfg) -> None:
    """memory.reuse_fp32_param / offload_optimizer / swap_activations against the rest."""
    m, p, t = cfg.memory, cfg.parallel, cfg.train
    if m.reuse_fp32_param and t.dtype != "bfloat16":
        raise ConfigError(
            f"memory.reuse_fp32_param=true needs train.dtype=bfloat16 (it is {t.dtype}: the parameters "
            f"are the fp32 masters already); set one or the other"
        )
    if m.reuse_fp32_param and p.zero not in (0, 1, 2):
        raise ConfigError(f"memory.reuse_fp32_param=true works with parallel.zero 0, 1 or 2, not {p.zero}")
    if m.reuse_fp32_param and m.offload_optimizer:
        raise ConfigError(
            "memory.reuse_fp32_param=true with memory.offload_optimizer=true: the offloaded masters "
            "take no device memory to share; turn one of them off"
        )
    if m.offload_optimizer and p.zero not in (0, 1, 2):
        raise ConfigError(f"memory.offload_optimizer=true works with parallel.zero 0, 1 or 2, not {p.zero}")
    if m.swap_activations and m.recompute in ("selective", "full"):
        raise ConfigError(
            f"memory.swap_activations=true with memory.recompute={m.recompute}: the attention core is "
            f"recomputed, not kept, so there is nothing to swap; use recompute none or activation"
        )


def _check_run_dir(cfg) -> None:
    d = cfg.run.dir
    if os.path.exists(d) and not os.path.isdir(d):
        raise ConfigError(f"run.dir={d!r} is a file; give a directory (it is created if missing)")
    parent = os.path.dirname(os.path.abspath(d))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ConfigError(f"run.dir={d!r} is inside {parent!r}, which is a file; give a directory")


def _check_data(cfg, config: ModelConfig, need: bool = True) -> str | None:
    """Refuse data the run cannot read; with `need=False` (a dry run, the planner: they plan,
    they read no tokens) a missing data file or tokenizer is returned as a note instead."""
    from meshspeed.data.loader import check_token_data
    from meshspeed.data.tokenizer import check_vocab, load_tokenizer

    if cfg.train.objective == "flow":  # images, not tokens: no tokenizer or token file to check
        return check_image_data(cfg, need)
    if config.family == "vlm":  # images and captions (the byte tokenizer's ids)
        return check_vlm_data(cfg, config, need)
    d = cfg.data
    if not need:
        missing = [
            f"{k}={v!r}"
            for k, v in (("data.path", d.path), ("data.tokenizer", d.tokenizer))
            if v and v != "bytes" and not os.path.exists(v)
        ]
        if missing:
            it = "them" if len(missing) > 1 else "it"
            return f"{' and '.join(missing)} not found here; planned without {it} (training needs {it})"
    if d.path and not os.path.exists(d.path):
        raise ConfigError(
            f"data.path={d.path!r} does not exist; give a text file or directory, or a token file "
            f"from `meshspeed data prepare` (empty = the Python standard library's sources)"
        )
    tok = load_tokenizer(cfg.data.tokenizer)
    check_vocab(tok, config.vocab_size)
    # token files: format/tokenizer/vocabulary against the sidecar, every id < vocab_size
    check_token_data(d.path, d.format, config.vocab_size, tok)
    return None


# --- per-rank parameter counts -----------------------------------------------------------------


class _Member:
    """What building a tensor-parallel module reads of its group: its rank and size."""

    def __init__(self, name: str, rank: int, size: int):
        self.name, self.rank, self.size = name, rank, size


class _Shapes:
    """A mesh of `_Member`s for one rank: enough to build pieces on the meta device."""

    def __init__(self, dims: ParallelDims, rank: int):
        self.dims, self.coords = dims, dims.coords(rank)

    def __getitem__(self, dim: str) -> _Member:
        return _Member(dim, self.coords[dim], self.dims.size(dim))


def _local_numel(p: torch.Tensor, coords: dict, dims: ParallelDims) -> int:
    s = sharding_of(p)
    if s is None:
        return p.numel()
    shape = list(s.full_shape)
    for dim, placement in s.axes:
        d = getattr(placement, "dim", None)
        if d is not None:
            shape[d] = chunk_sizes(shape[d], dims.size(dim))[coords[dim]]
    return math.prod(shape)


def _owner(fqn: str, units) -> tuple[str, int | None]:
    """('layer', index) | ('embedding', None) | ('head', None) | ('other', None)."""
    prefix = units.layers + "."
    if fqn.startswith(prefix):
        return "layer", int(fqn[len(prefix) :].split(".")[0])
    if units.embedding and any(fqn.startswith(e + ".") for e in units.first_modules()):
        return "embedding", None
    if any(fqn.startswith(h + ".") for h in units.head):
        return "head", None
    return "other", None


def rank_params(recipe, dims: ParallelDims, layouts, cfg, only=None) -> tuple[int, list[int]]:
    """(the model's parameters, those each rank holds: tied ones once per rank), from one meta
    build. `only`: count just these ranks (the others read 0; the planner's representatives)."""
    model = build_on_meta(recipe)
    total = sum(p.numel() for p in model.parameters())
    parallelize(model, _Shapes(dims, 0), recipe, sequence_parallel=cfg.parallel.sequence_parallel)
    apply_expert_parallel(model, _Shapes(dims, 0), cfg)  # the experts' tags: the trainer's own call
    units = recipe.pipeline
    params = list(model.named_parameters(remove_duplicate=False))
    out = [0] * dims.world_size
    for rank in range(dims.world_size) if only is None else sorted(only):  # the planner: few of 10^5
        coords = dims.coords(rank)
        mine = [s for s in layouts if s.rank == coords["pp"]] if layouts else None
        layers = {i for s in mine for i in s.layers} if mine is not None else None
        seen, n = set(), 0
        for fqn, p in params:
            if id(p) in seen:
                continue
            kind, index = _owner(fqn, units)
            if mine is not None and (
                (kind == "layer" and index not in layers)
                or (kind == "embedding" and not any(s.embedding for s in mine))
                or (kind == "head" and not any(s.head for s in mine))
            ):
                continue
            seen.add(id(p))
            n += _local_numel(p, coords, dims)
        out[rank] = n
    return total, out


# --- the plan ---------------------------------------------------------------------------------


def world_size(cfg) -> int:
    """The world the plan is for: torchrun's WORLD_SIZE under torchrun, else `nproc` workers."""
    from meshspeed.comm import launched

    return int(os.environ.get("WORLD_SIZE", cfg.nproc)) if launched() else cfg.nproc


def make_plan(
    cfg,
    world_size: int,
    *,
    ranks: bool = True,
    local_gpus: int | None = None,
    local_ranks: int | None = None,
    need_data: bool = True,
) -> RunPlan:
    """Resolve and check the whole run for `world_size` ranks. `ranks=False` skips the per-rank
    table (a worker that was handed no plan needs only the layout and the model). `local_gpus`,
    `local_ranks`: this node's GPUs and ranks for the device choice (default: counted here)."""
    from meshspeed.plan.schedule import check as check_pipeline

    config_mod.validate(cfg)
    _check_run_dir(cfg)
    dims, microbatches = resolve_layout(cfg, per_module.decoder_world(cfg, world_size))  # [modules]
    device = plan_device(cfg, world_size, local_gpus, local_ranks)
    config, recipe, weights = _model(cfg)
    config = with_moe_settings(cfg, config)
    check_flow(cfg, config)  # dit with objective flow, and what dit runs with so far
    check_vlm(cfg, config)  # vlm with objective sft, the layouts built for it, its data
    _check_model(cfg, config, recipe)
    layouts, sim = check_pipeline(cfg, recipe, microbatches)
    data_note = _check_data(cfg, config, need_data)
    plan = RunPlan(
        config=cfg.to_dict(),
        world_size=world_size,
        dims=dataclasses.asdict(dims),
        microbatches=microbatches,
        model=dataclasses.asdict(config),
        weights=weights,
        stages=[dataclasses.asdict(s) for s in layouts],
        bubble=float(sim.bubble) if sim else 0.0,
        peak_microbatches=list(sim.peak_activations) if sim else [],
        device=device.device,
        device_info={
            "backend": device.backend,
            "local_ranks": device.local_ranks,
            "local_gpus": device.local_gpus,
            "why": device.why,
        },
    )
    if device.notice:
        plan.warnings.append(device.notice)
    if data_note:
        plan.warnings.append(data_note)
    p = cfg.parallel
    if p.pp > 1 and microbatches < p.pp:
        plan.warnings.append(
            f"{microbatches} micro-batch(es) per step on {p.pp} pipeline stages: the pipeline idles "
            f"{plan.bubble:.0%} of the step; raise train.global_batch_size to ≥ "
            f"{p.pp * cfg.train.micro_batch_size * dims.dp} (≥ pp micro-batches)"
        )
    per_module.attach(plan, cfg, config, recipe, dims, microbatches, need_data)  # [modules], if set
    if ranks:
        plan.total_params, counts = rank_params(recipe, dims, layouts if p.pp > 1 else None, cfg)
        for rank, n in enumerate(counts):
            coords = dims.coords(rank)
            plan.ranks.append(
                {
                    "rank": rank,
                    "coords": {k: coords[k] for k in ("pp", "dp", "cp", "tp", "ep")},
                    "params": n,
                    "memory": estimate_memory(cfg, config, dims, plan, coords, n),
                }
            )
    return plan
