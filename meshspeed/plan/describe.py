"""The run plan as `meshspeed train --dry-run` prints it (split from run_plan.py along its
printing seam; run_plan re-exports `describe`)."""

from __future__ import annotations

from meshspeed.comm import ParallelDims
from meshspeed.plan import modules as per_module

# --- printing ---------------------------------------------------------------------------------


def _expert_tp(d: dict) -> str:
    """How the tp ranks hold experts, for the layout line (nothing when tp = 1)."""
    if d["tp"] == 1:
        return ""
    mode = ParallelDims(tp=d["tp"], etp=d.get("etp", 0), tp_extend_ep=d.get("tp_extend_ep", False)).expert_tp
    return {
        "split": f", etp {d['tp']}",
        "tokens": ", etp 1",
        "fold": f", tp-extend-ep: {d['ep'] * d['tp']} expert ranks",
    }[mode]


def _gib(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def describe(plan) -> str:
    """The plan as `meshspeed train --dry-run` prints it."""
    c, d, m = plan.config, plan.dims, plan.model
    t, p = c["train"], c["parallel"]
    src = c["model"]["init_from"] or c["model"]["preset"]
    lines = [
        f"meshspeed train --dry-run: {src}, {plan.total_params:,} parameters, {plan.world_size} ranks",
        f"  layout       pp {d['pp']} × dp {d['dp']} × cp {d['cp']} × tp {d['tp']} "
        f"(ep {d['ep']}{_expert_tp(d) if m.get('n_experts') else ''}), "
        f"zero {p['zero']}, sequence parallel {'on' if p['sequence_parallel'] else 'off'}, {t['dtype']}",
        f"  model        {m['n_layers']} layers, dim {m['dim']}, heads {m['n_heads']}/{m['n_kv_heads']} kv, "
        f"vocab {m['vocab_size']}"
        + (f", {m['n_experts']} experts top {m['top_k']}" if m["n_experts"] else ""),
        f"  device       {plan.device} ({plan.device_info.get('backend', 'gloo')}): "
        f"{plan.device_info.get('why', '')}",
        f"  batch        {t['global_batch_size']} sequences × {t['seq_len']} tokens per step; "
        f"{plan.microbatches} micro-batch(es) of {t['micro_batch_size']} per rank",
    ]
    if d["pp"] > 1:
        lines.append(
            f"  pipeline     {p['pp_schedule']}, vpp {p['vpp']}, bubble {plan.bubble:.1%} of the step"
        )
        for s in plan.stages:
            extra = "E " if s["embedding"] else ""
            extra += f"layers {s['layers'][0]}-{s['layers'][-1]}" if s["layers"] else "no layers"
            extra += " L" if s["head"] else ""
            lines.append(f"    stage {s['stage']} (pp rank {s['rank']}, chunk {s['chunk']}): {extra}")
    if plan.ranks:
        lines.append(
            "  per rank     params          memory estimate = params + grads + optimizer + activations"
            " + buffers"
        )
        groups: dict = {}
        for r in plan.ranks:  # ranks with the same figures on one line
            key = (r["params"], r["memory"]["total"])
            groups.setdefault(key, []).append(r["rank"])
        for (n, total), members in groups.items():
            mem = next(r["memory"] for r in plan.ranks if r["rank"] == members[0])
            who = _ranges(members)
            lines.append(
                f"    ranks {who:<12} {n:>14,}  {_gib(total)} = {_gib(mem['params'])} + "
                f"{_gib(mem['grads'])} + "
                f"{_gib(mem['optimizer'])} + {_gib(mem['activations'])} + {_gib(mem['buffers'])}"
            )
            extra = [f"{_gib(mem['host'])} in host memory"] if mem.get("host") else []
            if mem.get("saved"):  # [memory] features: the device bytes each takes off
                saves = ", ".join(f"memory.{k} {_gib(v)} ({v:,} B)" for k, v in mem["saved"].items())
                extra.append(f"saved on the device: {saves}")
            if extra:
                lines.append("      " + "; ".join(extra))
    lines += per_module.describe(plan.modules)  # none without [modules]
    for w in plan.warnings:
        lines.append(f"  warning      {w}")
    return "\n".join(lines)


def _ranges(xs: list[int]) -> str:
    out, start = [], xs[0]
    for a, b in zip(xs, xs[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ",".join(out)
