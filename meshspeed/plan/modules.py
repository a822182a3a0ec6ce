"""Per-module layouts in the run plan: `[modules]` resolved into the encoder's and the decoder's
meshes, checked in one line each before any worker starts, with memory per rank for each
module's ranks and a predicted step time that includes the seam (meshspeed/parallel/seam.py).

    colocated       every rank runs both; the encoder at its own dp x tp over all ranks, the
                    decoder at parallel.*; the seam re-slices the features between the two
    disaggregated   modules.encoder_ranks run only the encoder, the other ranks the decoder
                    (parallel.* over them); the features go point to point, gradients back

The model of the step (a prediction, not a measurement; benchmarks/vlm.py puts it beside the
trainer's measured step): per micro-batch the encoder's and the decoder's compute at the
machine's achievable matmul and attention rates, charged for small tiles as the one-mesh planner
charges them (models/flops.py, planner.predict_step), the seam's transfers by the α-β cost of one message
per producer-consumer pair, the dp gradient reductions of each module over its own group.
Colocated ranks run the two one after the other; disaggregated ones overlap micro-batch k+1's
encoder with micro-batch k's decoder, so the step is m x the slower side, plus one pass of the
faster one (the pipeline's fill and drain) and the seam's exposed transfers.
"""

from __future__ import annotations

import dataclasses
import os

from meshspeed.comm import ConfigError, ParallelDims
from meshspeed.comm.module_mesh import parse_ranks
from meshspeed.comm.recipe import build_on_meta
from meshspeed.memory.estimate import model_activation_bytes
from meshspeed.models.flops import flops_per_token, matmul_params
from meshspeed.models.vlm_config import image_tokens, vision_flops_per_image
from meshspeed.parallel.tensor import check_tp, parallelize
from meshspeed.plan.estimate import BYTES
from meshspeed.plan.machine import Machine, calibration_path, get_machine

ENCODER = ("embed.vision", "embed.projector")  # the vlm recipe's encoder FQN prefixes
VIT_SAVED_PER_PATCH = 18  # ViT block tensors autograd keeps per patch, in units of vision_dim


def active(cfg) -> bool:
    m = cfg.modules
    return bool(m.encoder_ranks) or m.encoder_dp > 0 or m.encoder_tp > 1


def encoder_only_ranks(cfg, world: int) -> tuple[int, ...]:
    """modules.encoder_ranks checked against the world: distinct, in range, leaving the decoder
    at least one rank (so encoder and decoder ranks are disjoint and both non-empty)."""
    m = cfg.modules
    if not m.encoder_ranks:
        return ()
    enc = parse_ranks(m.encoder_ranks)
    if any(not 0 <= r < world for r in enc) or len(set(enc)) != len(enc):
        raise ConfigError(
            f"modules.encoder_ranks={m.encoder_ranks!r}: ranks must be distinct and in 0..{world - 1}"
        )
    if len(enc) == world:
        raise ConfigError(
            f"modules.encoder_ranks={m.encoder_ranks!r} takes every rank; leave ranks to the decoder"
        )
    return enc


def decoder_world(cfg, world: int) -> int:
    """The ranks the decoder's parallel.* degrees cover: the world less the encoder's own ranks."""
    return world - len(encoder_only_ranks(cfg, world))


def resolve(cfg, config, world: int, dec_dims: ParallelDims) -> dict:
    """{mode, encoder: {ranks, dp, tp}, decoder: {ranks, dims}}, or one line naming what to change."""
    m = cfg.modules
    if config.family != "vlm":
        raise ConfigError(
            f"[modules] is set but model family {config.family!r} has no encoder; per-module layouts "
            "are for family vlm (unset modules.encoder_ranks/encoder_dp/encoder_tp)"
        )
    if m.encoder_tp < 1 or m.encoder_dp < 0:
        raise ConfigError(
            f"modules.encoder_tp={m.encoder_tp}, encoder_dp={m.encoder_dp}: use tp >= 1, dp >= 0"
        )
    if m.encoder_ranks:
        enc = encoder_only_ranks(cfg, world)
        dec = tuple(r for r in range(world) if r not in enc)  # disjoint by construction
        mode = "disaggregated"
    else:
        enc = dec = tuple(range(world))
        mode = "colocated"
    if dec_dims.cp > 1:
        raise ConfigError(
            f"[modules] with parallel.cp={dec_dims.cp}: the seam delivers whole sequences; "
            "per-module layouts run with cp = 1 (dp, tp and pp work)"
        )
    if dec_dims.pp > 1 and cfg.parallel.pp_schedule in ("zero-bubble", "dualpipev"):
        # their first stage's embedding backward runs in W, out of micro-batch order, and the
        # seam returns each micro-batch's gradients in order
        raise ConfigError(
            f"parallel.pp_schedule={cfg.parallel.pp_schedule} with [modules]: use 1f1b, gpipe or "
            "interleaved (the seam returns gradients in micro-batch order)"
        )
    dp = m.encoder_dp or len(enc) // m.encoder_tp
    if dp * m.encoder_tp != len(enc):
        raise ConfigError(
            f"modules.encoder_dp={m.encoder_dp} x encoder_tp={m.encoder_tp} must equal the encoder's "
            f"{len(enc)} ranks; e.g. encoder_dp={max(1, len(enc) // m.encoder_tp)} (or 0 for automatic)"
        )
    batch = cfg.train.micro_batch_size * dec_dims.dp  # the images of one global micro-batch
    if dp > batch:
        raise ConfigError(
            f"modules.encoder_dp={dp} is more than the {batch} images of one micro-batch "
            f"(train.micro_batch_size x decoder dp): use encoder_dp <= {batch}"
        )
    return {
        "mode": mode,
        "encoder": {"ranks": list(enc), "dp": dp, "tp": m.encoder_tp},
        "decoder": {"ranks": list(dec), "dims": dataclasses.asdict(dec_dims)},
        "images": batch,
    }


class _Member:  # what a tensor-parallel module reads of its group on the meta device
    def __init__(self, size: int):
        self.name, self.rank, self.size = "tp", 0, size


def _params(recipe, tp: int, encoder: bool) -> int:
    """One rank's parameters of the encoder (or the decoder) split over `tp` (meta build)."""
    check_tp(tp, recipe)
    model = build_on_meta(recipe)
    plan = [(p, s) for p, s in recipe.tp_plan if p.startswith(ENCODER) == encoder]
    parallelize(model, {"tp": _Member(tp)}, recipe, plan=plan)
    return sum(p.numel() for n, p in model.named_parameters() if n.startswith(ENCODER) == encoder)


def _memory(cfg, params: int, acts: int) -> dict:
    elem = BYTES[cfg.train.dtype]
    opt = params * (8 + (4 if elem == 2 else 0))  # AdamW moments (+ fp32 master in bf16)
    out = {"params": params * elem, "grads": params * 4, "optimizer": opt, "activations": acts}
    out["total"] = sum(out.values())
    return out


def memory(cfg, config, recipe, layout: dict) -> dict:
    """Bytes per rank of each module's ranks: parameters, float32 gradients, AdamW state, and the
    activations of one micro-batch (the encoder's: its images' ViT blocks; the decoder's: the
    memory model the run plan uses for every decoder)."""
    e, d = layout["encoder"], layout["decoder"]["dims"]
    elem, t = BYTES[cfg.train.dtype], cfg.train
    n_patch = (config.image_size // config.patch_size) ** 2
    imgs = -(-layout["images"] // e["dp"])  # the fullest encoder rank's images
    enc_acts = imgs * n_patch * config.vision_dim * config.vision_layers * VIT_SAVED_PER_PATCH * elem
    dec_acts = model_activation_bytes(
        config, tokens=t.micro_batch_size * t.seq_len, tp=d["tp"], elem=elem, mode=cfg.memory.recompute
    )
    enc = _memory(cfg, _params(recipe, e["tp"], True), enc_acts)
    # a decoder pipeline: a stage holds about 1/pp of the decoder (the run plan's per-rank table
    # above has each stage's exact count); 1F1B keeps pp micro-batches of a 1/pp stage's activations
    dec = _memory(cfg, -(-_params(recipe, d["tp"], False) // d.get("pp", 1)), dec_acts)
    if layout["mode"] == "colocated":  # one rank holds both
        both = {k: enc[k] + dec[k] for k in enc}
        return {"encoder": enc, "decoder": dec, "rank": both}
    return {"encoder": enc, "decoder": dec}


def _p2p(machine: Machine, nbytes: float) -> float:
    """One message between two ranks: α + bytes / link bandwidth (intra-node)."""
    return machine.alpha_us * 1e-6 + nbytes / (machine.intra_gbs * 1e9)


def _occupancy(machine: Machine, rows: float, width: float) -> float:
    """The fraction of its large-size rate a [rows, width] matmul reaches (planner.predict_step's
    tile term): tiny models run far below the rate a 1024-wide matmul measures."""
    return rows / (rows + machine.tile) * width / (width + machine.tile)


def _compute_s(machine: Machine, rate: float, mm: float, attn: float, occ: float) -> float:
    """Seconds of `mm` matmul FLOPs and `attn` attention-core FLOPs at this machine's achievable
    rates (the one-mesh planner's split: attention reaches less of the peak than a matmul)."""
    return (mm / machine.matmul_eff + attn / machine.attn_eff) / (rate * occ)


def predict(cfg, config, layout: dict, machine: Machine, microbatches: int) -> dict:
    """Predicted seconds per step of the per-module layout and its parts (see the module doc).
    Every blocking exchange between two bursts of compute (a seam message, a tp all-reduce, a
    gradient reduction, the joint gradient norm) also pays the wait `plan --calibrate` measured
    for a group of its size on this machine (Machine.sync_s; none on devices)."""
    e, d = layout["encoder"], layout["decoder"]["dims"]
    t, elem = cfg.train, BYTES[cfg.train.dtype]
    world = len(set(e["ranks"]) | set(layout["decoder"]["ranks"]))
    rate = machine.rank_peak(world)
    imgs = -(-layout["images"] // e["dp"])
    n_patch = (config.image_size // config.patch_size) ** 2
    vit_attn = 12 * config.vision_layers * config.vision_dim * n_patch * n_patch
    vit_mm = vision_flops_per_image(config) - vit_attn
    occ = _occupancy(machine, imgs * n_patch, config.vision_dim / e["tp"])
    t_enc = _compute_s(machine, rate, imgs * vit_mm / e["tp"], imgs * vit_attn / e["tp"], occ)
    tokens = t.micro_batch_size * t.seq_len
    text = flops_per_token(config, t.seq_len) - vision_flops_per_image(config) // t.seq_len
    dec_mm = 6 * matmul_params(config)
    occ = _occupancy(machine, tokens, config.dim / d["tp"])
    t_dec = _compute_s(machine, rate, tokens * dec_mm / d["tp"], tokens * (text - dec_mm) / d["tp"], occ)
    # The seam: the fullest decoder rank receives its micro-batch's features from the encoder
    # ranks holding them (messages in flight together: the largest one's time), the same bytes
    # go back as gradients (spread over the tp peers); each direction a blocking wait.
    feat = t.micro_batch_size * image_tokens(config) * config.dim * elem
    senders = max(1, -(-e["dp"] // d["dp"]))
    seam = _p2p(machine, feat / senders) + _p2p(machine, feat / senders / d["tp"]) + 2 * machine.sync_s(2)
    m, pp = microbatches, d.get("pp", 1)
    # a decoder pipeline: each stage does 1/pp of a micro-batch's decoder work, and 1F1B's
    # fill and drain add pp - 1 of those slots to the m
    t_stage, slots = t_dec / pp, m + pp - 1
    if layout["mode"] == "colocated":
        compute = m * t_enc + slots * t_stage
        seam_exposed = m * seam
    else:
        compute = max(m * t_enc, slots * t_stage) + min(t_enc, t_stage)
        seam_exposed = seam  # behind the other side's work after the first micro-batch

    def allreduce(params: int, dp: int) -> float:  # ring: 2 (p-1)/p of the bytes each way
        if dp < 2:
            return 0.0
        nbytes = params * 4
        ring = 2 * (dp - 1) * (machine.alpha_us * 1e-6 + nbytes / dp / (machine.intra_gbs * 1e9))
        return ring + machine.sync_s(dp)

    dp_s = allreduce(layout.get("enc_params", 0), e["dp"]) + allreduce(layout.get("dec_params", 0), d["dp"])
    dp_s += machine.sync_s(world)  # the one gradient norm over both modules' ranks

    def tp_comm(tp: int, layers: int, rows: int, width: int, extra: int = 0) -> float:
        # Megatron's 2 all-reduces forward and 2 backward per block of [rows, width] activations,
        # each blocking between two computes (+ the wait for peers on shared cores: sync_s);
        # `extra`: small latency-bound ones (the vocab-parallel loss's two)
        if tp < 2:
            return 0.0
        one = 2 * (tp - 1) / tp * rows * width * elem / (machine.intra_gbs * 1e9)
        wait = 2 * machine.alpha_us * 1e-6 + machine.sync_s(tp)
        return 4 * layers * (wait + one) + extra * wait

    tp_s = m * tp_comm(e["tp"], config.vision_layers, imgs * n_patch, config.vision_dim)
    tp_s += m * tp_comm(d["tp"], config.n_layers, tokens, config.dim, extra=2)
    total = compute + seam_exposed + dp_s + tp_s
    return {
        "step_s": total,
        "encoder_s": m * t_enc,
        "decoder_s": m * t_dec,
        "seam_s": m * seam,
        "seam_exposed_s": seam_exposed,
        "dp_s": dp_s,
        "tp_s": tp_s,
        "machine": machine.name,
    }


def attach(plan, cfg, config, recipe, dec_dims: ParallelDims, microbatches: int, starts: bool) -> None:
    """Set RunPlan.modules: the resolved per-module layout with its memory and predicted step
    ({} without [modules]). `starts`: the plan is for a run that starts; what the trainer does
    not run yet with [modules] (train/modules_run.py) is refused here, in one line each."""
    plan.modules = plan_modules(cfg, config, recipe, plan.world_size, dec_dims, microbatches, plan.device)
    if plan.modules and starts:
        check_trainable(cfg, plan.modules)


def check_trainable(cfg, layout: dict) -> None:
    """What `meshspeed train` refuses of a per-module layout (the dry run plans all of it)."""
    e, m = layout["encoder"], cfg.modules
    world = len(set(e["ranks"]) | set(layout["decoder"]["ranks"]))
    last = f"{world - len(e['ranks'])}-{world - 1}" if len(e["ranks"]) > 1 else str(world - 1)
    apart = layout["mode"] == "disaggregated"
    refusals = (
        (e["tp"] > 1 and cfg.checkpoint.export_safetensors,
         f"modules.encoder_tp={m.encoder_tp} and checkpoint.export_safetensors", "the export gathers "
         "over one mesh's tp; use checkpoint.export_hf (converted from the final checkpoint)"),
        (apart and 0 in e["ranks"], f"modules.encoder_ranks={m.encoder_ranks!r}",
         f"rank 0 logs the loss and must run the decoder; give the encoder the last ranks, e.g. '{last}'"),
        (apart and cfg.checkpoint.export_safetensors, "checkpoint.export_safetensors",
         "the decoder's ranks do not hold the encoder when disaggregated; use checkpoint.export_hf "
         "(converted from the final checkpoint)"),
        (cfg.sparsity.pattern != "none", f"sparsity.pattern={cfg.sparsity.pattern}",
         "sparsity is not built for per-module layouts; use sparsity.pattern=none"),
    )  # fmt: skip
    for bad, setting, why in refusals:
        if bad:
            raise ConfigError(f"{setting} with [modules]: {why}")


def plan_modules(
    cfg, config, recipe, world: int, dec_dims: ParallelDims, microbatches: int, device: str
) -> dict:
    """The resolved per-module layout with its memory and predicted step ({} without [modules])."""
    if not active(cfg):
        return {}
    layout = resolve(cfg, config, world, dec_dims)
    check_tp(layout["encoder"]["tp"], recipe)
    layout["memory"] = memory(cfg, config, recipe, layout)
    elem = BYTES[cfg.train.dtype]
    layout["enc_params"] = layout["memory"]["encoder"]["params"] // elem
    layout["dec_params"] = layout["memory"]["decoder"]["params"] // elem
    # this machine's `meshspeed plan --calibrate` when there is one (the CPU defaults know nothing
    # of a shared machine's waits), else the named defaults
    calibrated = device == "cpu" and os.path.exists(calibration_path())
    machine = get_machine("calibrated" if calibrated else "cpu" if device == "cpu" else "h100")
    layout["predicted"] = predict(cfg, config, layout, machine, microbatches)
    return layout


def evaluate(cfg, plan, machine: Machine, settings: dict, headroom: float) -> dict:
    """The planner's verdict on a plan with [modules] (planner.evaluate's contract): its fullest
    module rank against the machine's memory, and the per-module step on this machine."""
    layout, config = plan.modules, plan.model_config()
    fullest = max(m["total"] for m in layout["memory"].values())
    limit = machine.memory_gib * 2**30 * (1 - headroom)
    if fullest > limit:
        return {
            "settings": settings,
            "rejected": f"memory {fullest / 2**30:.1f} GiB per rank > {limit / 2**30:.1f} GiB",
        }
    p = predict(cfg, config, layout, machine, plan.microbatches)
    params = max(layout["enc_params"], layout["dec_params"])
    optimizer = 30 * params / (machine.mem_bw_gbs * 1e9)  # the planner's per-parameter update cost
    step = p["step_s"] + optimizer
    tokens = cfg.train.global_batch_size * cfg.train.seq_len
    flops = flops_per_token(config, cfg.train.seq_len) * tokens
    mfu = flops / (step * plan.world_size * machine.peak_tflops * 1e12)
    comm = {"seam": p["seam_exposed_s"], "dp": p["dp_s"], "tp": p["tp_s"]}
    pred = {
        "step_s": step, "tokens_per_s": tokens / step, "mfu": mfu,
        "compute_s": step - optimizer - sum(comm.values()), "bubble_s": 0.0, "comm_s": comm,
        "optimizer_s": optimizer, "memory_bytes": fullest, "bubble": 0.0, "modules": layout["mode"],
    }  # fmt: skip
    return {"settings": settings, "predicted": pred}


def _gib(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _ranks(rs: list[int]) -> str:
    return (
        f"{rs[0]}-{rs[-1]}"
        if len(rs) > 1 and rs == list(range(rs[0], rs[-1] + 1))
        else ",".join(map(str, rs))
    )


def describe(layout: dict) -> list[str]:
    """The `meshspeed train --dry-run` lines of a per-module layout (none for {})."""
    if not layout:
        return []
    e, dec, mem, p = layout["encoder"], layout["decoder"], layout["memory"], layout["predicted"]
    d = dec["dims"]
    pp = f"pp {d['pp']} × " if d["pp"] > 1 else ""
    lines = [
        f"  modules      {layout['mode']}: encoder ranks {_ranks(e['ranks'])} dp {e['dp']} × tp {e['tp']}; "
        f"decoder ranks {_ranks(dec['ranks'])} {pp}dp {d['dp']} × tp {d['tp']}; seam: parallel/seam.py",
    ]
    if layout["mode"] == "disaggregated":
        lines.append("    (the per-rank table above is the decoder's, its ranks counted from 0)")
    for name in ("encoder", "decoder", "rank"):
        if name in mem:
            m = mem[name]
            who = "each rank (both)" if name == "rank" else f"{name} ranks"
            lines.append(
                f"    {who:<18} {_gib(m['total'])} = {_gib(m['params'])} params + {_gib(m['grads'])} grads + "
                f"{_gib(m['optimizer'])} optimizer + {_gib(m['activations'])} activations"
            )
    lines.append(
        f"    predicted step {p['step_s'] * 1e3:.1f} ms on {p['machine']}: "
        f"encoder {p['encoder_s'] * 1e3:.1f} ms, "
        f"decoder {p['decoder_s'] * 1e3:.1f} ms, seam p2p {p['seam_s'] * 1e3:.2f} ms "
        f"({p['seam_exposed_s'] * 1e3:.2f} exposed), dp reductions {p['dp_s'] * 1e3:.2f} ms, "
        f"tp all-reduces {p['tp_s'] * 1e3:.2f} ms"
    )
    return lines
