"""`meshspeed plan`: the parallel layouts for a model on a machine, ranked by predicted step time.

Every candidate goes through the run plan (`make_plan`: every check `meshspeed train` makes, one
line when one fails) and the run plan's own memory estimate, so a layout proposed here is one
`meshspeed train` accepts and its memory is the figure `--dry-run` prints. What the run plan
does not have is a clock; this file adds one, per optimizer step and per rank:

    compute   the model's FLOPs (models/flops.py, recompute's extra forward added) over the
              world, at the machine's achievable matmul / attention rate, each charged for the
              occupancy a small tile loses (a short micro-batch, a wide tp split);
    bubble    the compute stretched by the schedule's idle fraction (its simulation: the same
              number the run plan prints);
    comm      each collective the layout issues, from the α-β cost model (comm/cost_model.py)
              on the links its group spans (tp innermost, pp outermost: mesh.py's rank order):
              tp/SP all-gather + reduce-scatter per layer, cp ring exchange behind the attention
              blocks, ep all-to-all per MoE layer, pp activations at stage boundaries, dp
              gradient reduce-scatter (hidden behind the last micro-batch's backward) and the
              parameter all-gather (ZeRO-3: per micro-batch, behind the forward);
    optimizer the AdamW step's bytes (about 30 per parameter it updates) at memory bandwidth.

A model with a separate encoder (family vlm) is also planned with per-module layouts
([modules], plan/modules.py: its own memory per module and step with the seam's transfers):
colocated, the encoder at dp = world (and at its own tp where heads allow) beside the decoder at
tp > 1; disaggregated, the encoder on the last k ranks for a few k, the decoder's parallel.*
over the rest. A candidate `meshspeed train` would refuse is rejected by the run plan's own
refusals (modules.check_trainable, called here), so the planner follows what the trainer runs.

The model is coarse on purpose — its job is the order of layouts, not the last percent — and is
validated against measured steps by benchmarks/planner.py.
"""

from __future__ import annotations

import copy
import itertools
import shlex

from meshspeed.comm import ConfigError, ParallelDims
from meshspeed.comm.cost_model import predict
from meshspeed.comm.mesh import divisors
from meshspeed.models.flops import flops_per_token, matmul_params
from meshspeed.parallel.pipeline.layout import StageLayout
from meshspeed.plan import config as config_mod
from meshspeed.plan import modules as per_module
from meshspeed.plan.estimate import BYTES, estimate_memory
from meshspeed.plan.machine import Machine
from meshspeed.plan.planner_modules import module_groups
from meshspeed.plan.run_plan import make_plan, rank_params, resolve_model

RECOMPUTE_FACTOR = {"none": 0.0, "activation": 0.01, "selective": 0.0, "full": 1.0}  # extra forwards


# The settings the planner chooses (the rest come from the config and stay as they are).
SEARCHED = (
    "parallel.tp",
    "parallel.pp",
    "parallel.cp",
    "parallel.ep",
    "parallel.zero",
    "parallel.sequence_parallel",
    "parallel.pp_schedule",
    "parallel.vpp",
    "train.micro_batch_size",
    "memory.recompute",
    "modules.encoder_ranks",
    "modules.encoder_dp",
    "modules.encoder_tp",
)

# Memory ladder: each structure is tried with the cheapest memory settings first; the first that
# fits is kept. ZeRO-2 moves the bytes ZeRO-1 moves (reduce-scatter, all-gather) with a 1/dp of
# the float32 gradients, so it is the second rung; recompute costs compute and ZeRO-3 costs a
# gather per micro-batch: both only when memory asks.
LADDER = (
    ("none", 1),
    ("none", 2),
    ("selective", 2),
    ("full", 2),
    ("none", 3),
    ("selective", 3),
    ("full", 3),
)


def layout_space(cfg, world: int, machine: Machine, fixed: dict | None = None) -> list[list[dict]]:
    """Groups of layouts (settings: section.key -> value) worth predicting: each group one
    structure (tp, pp, cp, ep, schedule, micro-batch) in LADDER order. `fixed` pins keys."""
    fixed = fixed or {}
    model, _ = resolve_model(cfg)
    t = cfg.train
    tps = [d for d in divisors(world) if d <= max(machine.gpus_per_node, 1) and model.n_heads % d == 0]
    groups = []
    reset = model.family == "vlm" and per_module.active(cfg)
    pinned = {k: v for k, v in fixed.items() if k.startswith("modules.")}
    one_mesh = {**ONE_MESH, **pinned} == ONE_MESH  # pinned [modules] settings: per-module only
    for tp, pp, cp in itertools.product(tps, divisors(world) if one_mesh else (), (1, 2, 4)):
        if world % (tp * pp * cp) or pp > model.n_layers or (cp > 1 and t.seq_len % (2 * cp)):
            continue
        dp = world // (tp * pp * cp)
        eps = [e for e in divisors(dp * cp) if model.n_experts % e == 0] if model.n_experts else [1]
        scheds = [("1f1b", 1)] + ([("interleaved", 2)] if pp > 1 and model.n_layers % (2 * pp) == 0 else [])
        for ep, (sched, vpp), mbs in itertools.product(eps, scheds, (1, 2, 4)):
            if t.global_batch_size % dp or (t.global_batch_size // dp) % mbs:
                continue
            group = []
            for rc, zero in LADDER:
                s = {
                    "parallel.tp": tp,
                    "parallel.pp": pp,
                    "parallel.cp": cp,
                    "parallel.ep": ep,
                    "parallel.zero": zero,
                    "parallel.sequence_parallel": tp > 1,
                    "parallel.pp_schedule": sched,
                    "parallel.vpp": vpp,
                    "train.micro_batch_size": mbs,
                    "memory.recompute": rc,
                }
                if reset:  # the config's [modules] would turn this into a per-module layout
                    s.update(ONE_MESH)
                s.update(fixed)
                if s not in group and not any(s in g for g in groups):
                    group.append(s)
            if group:
                groups.append(group)
    if model.family == "vlm":
        groups += module_groups(cfg, model, world, machine, fixed, groups, LADDER)
    return groups


ONE_MESH = {"modules.encoder_ranks": "", "modules.encoder_dp": 0, "modules.encoder_tp": 1}


def apply_settings(cfg, settings: dict, world: int):
    """A copy of `cfg` with `settings` applied and validated (ConfigError names a bad one)."""
    c = copy.deepcopy(cfg)
    c.nproc = world
    for key, value in settings.items():
        section, _, name = key.partition(".")
        if not hasattr(c, section) or not hasattr(getattr(c, section), name):
            raise ConfigError(f"{key!r} is not a setting (see meshspeed train --help)")
        setattr(getattr(c, section), name, value)
    config_mod.validate(c)
    return c


def representatives(dims: ParallelDims) -> list[int]:
    """One rank per distinct (pp, tp, ep) coordinate: the ranks whose parameter counts differ."""
    # Closed form (a loop over the world took seconds at 10^5 ranks): ranks differ in the ep
    # coordinate through their place j in the dp·cp line modulo ep, so the lowest rank of each
    # (pp, j, tp) is member j of pp stage p's first line.
    line = dims.dp * dims.cp
    return sorted(
        (p * line + j) * dims.tp + t for p in range(dims.pp) for j in range(dims.ep) for t in range(dims.tp)
    )


_COUNTS: dict = {}  # the meta build is the slow part; zero, recompute and micro-batch do not change it


def rank_counts(cfg, plan) -> dict[int, int]:
    """Parameters held by each representative rank (from the run plan's own meta build)."""
    key = (str(plan.model), str(plan.dims), str(plan.stages), cfg.parallel.sequence_parallel)
    if key not in _COUNTS:
        _COUNTS[key] = _rank_counts(cfg, plan)
    return _COUNTS[key]


def _rank_counts(cfg, plan) -> dict[int, int]:
    dims = plan.parallel_dims()
    layouts = [StageLayout(**s) for s in plan.stages] if dims.pp > 1 else None
    reps = representatives(dims)
    _, counts = rank_params(resolve_model(cfg)[1], dims, layouts, cfg, only=set(reps))
    return {r: counts[r] for r in reps}


def plan_memory(cfg, plan, counts: dict[int, int]) -> int:
    """The run plan's per-rank estimate (bytes on the device), maximum over the representative
    ranks (the rest hold the same parameters and activations)."""
    config, dims = plan.model_config(), plan.parallel_dims()
    return max(
        estimate_memory(cfg, config, dims, plan, dims.coords(r), n)["total"] for r, n in counts.items()
    )


def _group_nodes(dims: ParallelDims, name: str, gpus_per_node: int) -> list[int]:
    """The node of each member of rank 0's `name` group (tp innermost, pp outermost)."""
    # closed form: partitions() builds every group of the world, seconds at 10^5 ranks
    return [r // max(gpus_per_node, 1) for r in dims.members(name, 0)]


def predict_step(cfg, plan, machine: Machine, params: int) -> dict:
    """Predicted seconds per optimizer step (and its parts) for a checked run plan whose ranks
    hold at most `params` parameters."""
    c, d, t = plan.model_config(), plan.parallel_dims(), cfg.train
    world, m, mbs = plan.world_size, plan.microbatches, t.micro_batch_size
    elem = BYTES[t.dtype]
    peak = machine.rank_peak(world)
    tokens = t.global_batch_size * t.seq_len
    tok_mb = mbs * t.seq_len / d.cp  # tokens of one micro-batch on one rank
    # compute: matmuls and attention, each at its achievable rate; recompute adds forwards
    mm = 6 * matmul_params(c) * tokens / world
    attn = (flops_per_token(c, t.seq_len) - 6 * matmul_params(c)) * tokens / world
    extra = RECOMPUTE_FACTOR[cfg.memory.recompute] / 3
    if cfg.memory.recompute == "selective":
        attn *= 1 + 1 / 3  # the attention core's forward again
    tile = tok_mb / (tok_mb + machine.tile) * (c.dim / d.tp) / (c.dim / d.tp + machine.tile)
    t_mm = mm * (1 + extra) / (peak * machine.matmul_eff * tile)
    t_attn = attn * (1 + extra) / (peak * machine.attn_eff * tile)
    compute = t_mm + t_attn
    stretched = compute / max(1 - plan.bubble, 1e-3)
    cores = machine.shared_cores
    if cores and world > cores:
        # Ranks sharing cores: a rank idle in the bubble gives its core to another, so the
        # bubble costs time only once fewer ranks have work than there are cores (each rank's
        # compute already runs at its cores/world share of a core).
        stretched = compute * max(1.0, cores / world / max(1 - plan.bubble, 1e-3))
    links, backend, g = machine.links(), machine.backend, machine.gpus_per_node
    layers = c.n_layers / d.pp
    act = tok_mb * c.dim * elem  # one layer input of one micro-batch: [mbs, s/cp, dim]

    def cost(op, n, dim):  # + the wait a blocking collective between computes pays here
        nodes = _group_nodes(d, dim, g)
        if len(nodes) < 2:
            return 0.0
        return predict(op, "native", n, nodes, backend, links) + machine.sync_s(len(nodes))

    comm = {}
    if d.tp > 1:
        per = 2 * (1 + RECOMPUTE_FACTOR[cfg.memory.recompute])  # fwd + bwd (+ recomputed fwd)
        if cfg.parallel.sequence_parallel:
            one = cost("all_gather", act, "tp") + cost("reduce_scatter", act, "tp")
        else:
            one = cost("all_reduce", act, "tp")
        comm["tp"] = 2 * per * one * layers * m  # two blocks (attention, ffn) per layer
        if machine.sync_us:  # latency-bound all-reduces that only count where each pays a wait: the
            # vocab-parallel loss's two per micro-batch and, under SP, each norm's weight gradient
            norms = (2 * layers + 1) if cfg.parallel.sequence_parallel else 0
            comm["tp"] += (2 + norms) * m * cost("all_reduce", 8 * tok_mb, "tp")
    if d.cp > 1:  # K and V around the ring, dK dV back; hidden behind the block attention
        kv = 2 * tok_mb * c.num_kv_heads * c.head_dim * elem / d.tp
        ring = 3 * (d.cp - 1) * cost("all_gather", kv * d.cp, "cp") / max(d.cp - 1, 1) * layers * m
        comm["cp"] = max(0.0, ring - t_attn)
    if c.n_experts and d.ep > 1:
        moe_layers = (c.n_layers - c.first_k_dense) / d.pp
        n = tok_mb * c.dim * elem * c.top_k
        comm["ep"] = 4 * cost("all_to_all", n, "ep") * moe_layers * m
    if d.pp > 1:  # one activation forward and one gradient back per boundary and micro-batch
        hop = 2 if g and d.world_size // d.pp >= g else 1
        a = machine.alpha_us * 1e-6 * hop + machine.sync_s(2)
        bw = (machine.inter_gbs if hop == 2 else machine.intra_gbs) * 1e9
        comm["pp"] = 2 * m * (a + act / (d.tp if cfg.parallel.sequence_parallel else 1) / bw)
    dpcp = d.dp * d.cp
    if dpcp > 1:
        rs = cost("reduce_scatter", params * 4, "dp_cp")
        ag = cost("all_gather", params * elem, "dp_cp")
        bwd_last = 2 / 3 * compute / m
        dp_t = max(0.0, rs - bwd_last) + ag
        if cfg.parallel.zero >= 3:  # gathered per micro-batch, behind the forward
            dp_t += max(0.0, 2 * m * ag - compute / 3)
        comm["dp"] = dp_t
    shard = params / (dpcp if cfg.parallel.zero >= 1 else 1)
    optimizer = 30 * shard / (machine.mem_bw_gbs * 1e9)
    total = stretched + sum(comm.values()) + optimizer
    flops = flops_per_token(c, t.seq_len) * tokens
    return {
        "step_s": total,
        "tokens_per_s": tokens / total,
        "mfu": flops / (total * world * machine.peak_tflops * 1e12),
        "compute_s": compute,
        "bubble_s": stretched - compute,
        "comm_s": comm,
        "optimizer_s": optimizer,
    }


def evaluate(cfg, world: int, machine: Machine, settings: dict, headroom: float = 0.1) -> dict:
    """{'settings', 'predicted'} for a layout that passes the run plan and fits in memory, else
    {'settings', 'rejected': the run plan's line, or the memory that does not fit}."""
    try:
        c = apply_settings(cfg, settings, world)
        # planning reads no tokens: a data file that is not here yet is no reason to refuse
        plan = make_plan(c, world, ranks=False, local_gpus=0, local_ranks=0, need_data=False)
    except ConfigError as err:
        return {"settings": settings, "rejected": str(err)}
    if plan.modules:  # [modules]: per-module memory and step (plan/modules.py), on this machine
        try:  # what `meshspeed train` refuses of a per-module layout, as it refuses it today
            per_module.check_trainable(c, plan.modules)
        except ConfigError as err:
            return {"settings": settings, "rejected": str(err)}
        return per_module.evaluate(c, plan, machine, settings, headroom)
    counts = rank_counts(c, plan)
    memory = plan_memory(c, plan, counts)
    limit = machine.memory_gib * 2**30 * (1 - headroom)
    if memory > limit:
        return {
            "settings": settings,
            "rejected": f"memory {memory / 2**30:.1f} GiB per rank > {limit / 2**30:.1f} GiB "
            f"({machine.memory_gib:g} GiB less {headroom:.0%} headroom)",
        }
    pred = predict_step(c, plan, machine, max(counts.values()))
    pred["memory_bytes"] = memory
    pred["bubble"] = plan.bubble
    return {"settings": settings, "predicted": pred}


def rank_layouts(
    cfg, world: int, machine: Machine, fixed: dict | None = None, headroom: float = 0.1, progress=None
):
    """(ranked layouts, best first; rejected ones with their reason). Within a structure's
    ladder the first layout that fits is kept and the rest are not tried."""
    ok, rejected = [], []
    groups = layout_space(cfg, world, machine, fixed)
    for i, group in enumerate(groups):
        if progress:
            progress(i, len(groups))
        for s in group:
            r = evaluate(cfg, world, machine, s, headroom)
            if "predicted" in r:
                ok.append(r)
                break
            rejected.append(r)
            if not r["rejected"].startswith("memory"):
                break  # the run plan refused the structure itself: the ladder cannot help
    ok.sort(key=lambda r: r["predicted"]["step_s"])
    return ok, rejected


def why_lost(r: dict, best: dict) -> str:
    """The part of the step where a layout loses most against the best one."""
    p, b = r["predicted"], best["predicted"]
    parts = {
        "compute": p["compute_s"] - b["compute_s"],
        "bubble": p["bubble_s"] - b["bubble_s"],
        "optimizer": p["optimizer_s"] - b["optimizer_s"],
    }
    for k in set(p["comm_s"]) | set(b["comm_s"]):
        parts[f"{k} communication"] = p["comm_s"].get(k, 0.0) - b["comm_s"].get(k, 0.0)
    k = max(parts, key=parts.get)
    return f"{k} +{parts[k] * 1e3:.1f} ms"


def settings_args(settings: dict) -> str:
    """The `meshspeed train` flags of a layout (quoted for a shell: an empty rank list is '')."""
    return " ".join(
        f"--{k} {str(v).lower() if isinstance(v, bool) else shlex.quote(str(v))}" for k, v in settings.items()
    )


def train_command(config_file: str | None, overrides: list, world: int, settings: dict) -> str:
    """The whole `meshspeed train` command line of a planned layout: the config and the settings
    the planner was given (less the ones it chose), the world, the layout's own."""
    given = [(k, v) for k, v in overrides if k != "nproc" and k not in settings]
    parts = ["meshspeed train"] + ([f"--config {shlex.quote(config_file)}"] if config_file else [])
    parts += [f"--nproc {world}"] + [settings_args({k: v}) for k, v in given]
    return " ".join(parts + [settings_args(settings)])


__all__ = [
    "SEARCHED",
    "apply_settings",
    "evaluate",
    "layout_overrides",
    "layout_space",
    "plan_memory",
    "predict_step",
    "rank_counts",
    "rank_layouts",
    "settings_args",
    "train_command",
    "why_lost",
]


def layout_overrides(path: str, index: int = 0) -> list[tuple[str, str]]:
    """The `--section.key value` pairs of layout `index` in a `meshspeed plan --json` file, with
    the world size it was planned for as nproc; ConfigError names the file and what is wrong.
    The file is read with bounds (config.read_input: a size cap, a pipe's writer waited on for
    a while, no device), and each value must have its setting's type as the planner writes it."""
    import json
    from typing import get_type_hints

    what = f"--layout-from {path}"
    raw = config_mod.read_input(path, what)
    try:
        data = json.loads(raw)
    except RecursionError:
        raise ConfigError(f"{what}: not a readable JSON file (nested too deeply)") from None
    except ValueError as err:  # UnicodeDecodeError among them
        raise ConfigError(f"{what}: not a readable JSON file ({err})") from None
    layouts = data.get("layouts") if isinstance(data, dict) else None
    if not isinstance(layouts, list) or not layouts:
        raise ConfigError(f"{what}: no layouts (write it with `meshspeed plan --json > {path}`)")
    settings = layouts[index].get("settings") if isinstance(layouts[index], dict) else None
    if not isinstance(settings, dict) or not all(isinstance(k, str) and k in SEARCHED for k in settings):
        raise ConfigError(
            f"{what}: layout {index}'s settings must map the planner's keys "
            f"({', '.join(SEARCHED)}) to numbers, booleans or names"
        )
    out = []
    for key, value in settings.items():
        section, _, name = key.partition(".")
        typ = get_type_hints(type(getattr(config_mod.Config(), section)))[name]
        # exact types: 2.0 for tp, "2" or true for a count is a file not written by the planner
        if type(value) is not typ:
            kind = {bool: "true or false", int: "a whole number", str: "a name"}[typ]
            raise ConfigError(f"{what}: layout {index}'s {key}={json.dumps(value)} must be {kind}")
        out.append((key, str(value).lower() if typ is bool else str(value)))
    if "world_size" in data:  # the world it was planned for; absent: --nproc decides
        world = data["world_size"]
        if type(world) is not int or world < 1:
            raise ConfigError(
                f"{what}: world_size={json.dumps(world)} must be a whole number ≥ 1 (the ranks the "
                "layouts were planned for)"
            )
        out.insert(0, ("nproc", str(world)))
    return out
