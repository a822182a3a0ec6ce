"""The planner against published large-scale layouts: is theirs in our top 3 at the same GPU count?

    python -m benchmarks.planner_published [--only TEXT] [--top 3]

No cluster is involved: every number on our side is the planner's prediction. For each training
run below whose layout and throughput were published (the data, with its source, is in
PUBLISHED), the planner ranks the layouts for the same model, GPU count (nodes of 8 GPUs),
sequence length, global batch and bf16, on device `h100`, exactly as `meshspeed plan` does
(`rank_layouts`, nothing pinned). Their layout is then evaluated on its own: the settings they
published pinned (tp, pp, cp, virtual stages, micro-batch; ZeRO-3 where they used FSDP), the
rest chosen as the planner chooses them (its memory ladder, and schedule or micro-batch where
they did not say).

Printed per run (a markdown table): their layout and reported MFU, our first choice and its
predicted MFU, our predicted MFU for their layout, and whether their layout is among our first
--top. Layouts are compared by structure (tp, pp, cp, virtual stages, micro-batch); ZeRO
level and recompute are the planner's memory rungs and shown, not matched. When theirs is not
in the top: the part of the step where it loses most against our first choice (`why_lost`), the
memory the run plan estimates when it does not fit, or the setting the planner does not search.

Reported MFU is the source's, against the dense bf16 peak (989 TFLOP/s); where a source gives
model TFLOP/s per GPU (marked †) it is that over the peak, and where it gives tokens/s per GPU
only (marked *), it is converted with meshspeed's FLOP count
(models/flops.py, the same 6N + 12·L·H·Q·T convention as the sources). The run plan keeps each
schedule simulation for the process (plan/schedule.py); even so a row at thousands of GPUs takes
minutes of CPU.
"""

from __future__ import annotations

import re
import sys
import time

from benchmarks.harness import parser, require_positive
from meshspeed.models import presets
from meshspeed.models.flops import flops_per_token, param_count
from meshspeed.plan import config
from meshspeed.plan.machine import get_machine
from meshspeed.plan.planner import rank_layouts, why_lost
from meshspeed.plan.run_plan import resolve_model

GPUS_PER_NODE = 8
DEVICE = "h100"

# Llama 3 405B is not a meshspeed preset and the model.* overrides cannot give its FFN width
# (53,248: the llama3-70b rule with dim 16384 gives 57,344), so its published shape (Llama 3
# paper, Table 3: 126 layers, width 16,384, FFN 53,248, 128 heads, 8 KV heads, 128,256-token
# vocabulary) is registered for this process only (a preset of that name, if one is ever added,
# is used instead).
SHAPE_405B = "llama3-405b"
LLAMA3_405B = dict(
    dim=16384,
    n_layers=126,
    n_heads=128,
    n_kv_heads=8,
    vocab_size=128256,
    ffn_hidden=53248,
    norm_eps=1e-5,
    rope_theta=500000.0,
    max_seq_len=8192,
)

SOURCES = {
    "dgxc-8b": "https://github.com/NVIDIA/dgxc-benchmarking/blob/main/llama3.1/README_8b.md",
    "dgxc-70b": "https://github.com/NVIDIA/dgxc-benchmarking/blob/main/llama3.1/README_70b.md",
    "dgxc-405b": "https://github.com/NVIDIA/dgxc-benchmarking/blob/main/llama3.1/README_405b.md",
    "torchtitan": "https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md",
    "llama3": "https://arxiv.org/abs/2407.21783",
}

# One published run each. layout: what the source states (None: not stated, the planner
# chooses); zero=3 marks FSDP. mfu: as reported (bf16, dense peak); tflops: model TFLOP/s per
# GPU as reported (MFU = tflops / 989); tps: tokens/s per GPU where neither is given. machine:
# overrides of the h100 preset for hardware the source describes.
PUBLISHED = [
    dict(
        # NeMo 24.09 recipe, BF16 table: 12.91 s per step, MFU 59.37% at 8 GPUs, GBS 128
        run="NVIDIA DGXC, Llama 3.1 8B",
        preset="llama3-8b",
        gpus=8,
        seq=8192,
        batch=128,
        layout=dict(tp=1, pp=1, cp=2, vpp=1, mbs=1),
        mfu=0.5937,
        source="dgxc-8b",
    ),
    dict(
        # the same recipe weak-scaled: 128 GPUs, GBS 2048, MFU 58.51%
        run="NVIDIA DGXC, Llama 3.1 8B",
        preset="llama3-8b",
        gpus=128,
        seq=8192,
        batch=2048,
        layout=dict(tp=1, pp=1, cp=2, vpp=1, mbs=1),
        mfu=0.5851,
        source="dgxc-8b",
    ),
    dict(
        # BF16 table: TP4 PP4 CP2 VP5 MBS1, 14.72 s per step, MFU 54.10% at 64 GPUs, GBS 128
        run="NVIDIA DGXC, Llama 3.1 70B",
        preset="llama3-70b",
        gpus=64,
        seq=8192,
        batch=128,
        layout=dict(tp=4, pp=4, cp=2, vpp=5, mbs=1),
        mfu=0.5410,
        source="dgxc-70b",
    ),
    dict(
        # Table 1: FSDP on 8 GPUs, local batch 2 (GBS 16), selective AC, no compile: 5,762 tok/s/GPU.
        # Their H100s: 96 GB HBM2e, 2.4 TB/s, 500 W (peak below the SXM figure; unknown)
        run="torchtitan, Llama 3.1 8B",
        preset="llama3-8b",
        gpus=8,
        seq=8192,
        batch=16,
        layout=dict(tp=1, pp=1, cp=1, vpp=1, mbs=2, zero=3),
        tps=5762,
        machine=dict(memory_gib=96, mem_bw_gbs=2400),
        source="torchtitan",
    ),
    dict(
        # Table 3: FSDP on 128 GPUs, local batch 2 (GBS 256), selective AC: 5,605 tok/s/GPU
        run="torchtitan, Llama 3.1 8B",
        preset="llama3-8b",
        gpus=128,
        seq=8192,
        batch=256,
        layout=dict(tp=1, pp=1, cp=1, vpp=1, mbs=2, zero=3),
        tps=5605,
        machine=dict(memory_gib=96, mem_bw_gbs=2400),
        source="torchtitan",
    ),
    dict(
        # NeMo 24.09 BF16: TP8 PP9 CP2 VP7 MBS1 at 576 GPUs, GBS 252, 17.20 s per step, MFU 55.78%
        run="NVIDIA DGXC, Llama 3.1 405B",
        preset=SHAPE_405B,
        gpus=576,
        seq=8192,
        batch=252,
        layout=dict(tp=8, pp=9, cp=2, vpp=7, mbs=1),
        mfu=0.5578,
        source="dgxc-405b",
    ),
    dict(
        # Table 4, first row: TP8 CP1 PP16 DP64, 8K sequences, 16M tokens per batch, 430 TFLOP/s, 43%
        run="Meta, Llama 3 405B",
        preset=SHAPE_405B,
        gpus=8192,
        seq=8192,
        batch=2048,
        layout=dict(tp=8, pp=16, cp=1, vpp=None, mbs=None),
        tflops=430,
        source="llama3",
    ),
    dict(
        # Table 4: TP8 CP1 PP16 DP128 on 16,384 GPUs, 16M tokens per batch, 400 TFLOP/s, 41%
        run="Meta, Llama 3 405B",
        preset=SHAPE_405B,
        gpus=16384,
        seq=8192,
        batch=2048,
        layout=dict(tp=8, pp=16, cp=1, vpp=None, mbs=None),
        tflops=400,
        source="llama3",
    ),
    dict(
        # Table 4, long context: TP8 CP16 PP16 DP8, 131,072-token sequences, 16M tokens, 380 TFLOP/s, 38%
        run="Meta, Llama 3 405B",
        preset=SHAPE_405B,
        gpus=16384,
        seq=131072,
        batch=128,
        layout=dict(tp=8, pp=16, cp=16, vpp=None, mbs=None),
        tflops=380,
        source="llama3",
    ),
]

STRUCTURE = ("tp", "pp", "cp", "vpp", "mbs")
KEYS = {
    "tp": "parallel.tp",
    "pp": "parallel.pp",
    "cp": "parallel.cp",
    "vpp": "parallel.vpp",
    "mbs": "train.micro_batch_size",
}



def register_shapes() -> set[str]:
    """Register the shapes this benchmark needs that are not presets (this process only);
    returns their names."""
    if SHAPE_405B in presets.PRESETS:
        return set()
    presets.PRESETS[SHAPE_405B] = LLAMA3_405B
    return {SHAPE_405B}


def load(row: dict):
    return config.load(
        None,
        [
            ("model.preset", row["preset"]),
            ("train.dtype", "bfloat16"),
            ("train.seq_len", str(row["seq"])),
            ("train.global_batch_size", str(row["batch"])),
        ],
    )


def structure(settings: dict) -> dict:
    return {k: settings[KEYS[k]] for k in STRUCTURE}


def matches(settings: dict, layout: dict) -> bool:
    """Same structure as the published layout, on the settings it states."""
    s = structure(settings)
    return all(layout.get(k) is None or s[k] == layout[k] for k in STRUCTURE)


def short(settings: dict) -> str:
    """tp4 pp4 cp2 vp5 mb1 z1 full: structure, then the memory rung."""
    s = settings
    rc = s["memory.recompute"]
    return (
        f"tp{s['parallel.tp']} pp{s['parallel.pp']} cp{s['parallel.cp']} vp{s['parallel.vpp']} "
        f"mb{s['train.micro_batch_size']} z{s['parallel.zero']}" + ("" if rc == "none" else f" {rc}")
    )


def published_text(row: dict) -> str:
    lay = row["layout"]
    dp = row["gpus"] // (lay["tp"] * lay["pp"] * lay["cp"])
    parts = [f"TP{lay['tp']} PP{lay['pp']} CP{lay['cp']}"]
    if lay.get("vpp") and lay["vpp"] > 1:
        parts.append(f"VP{lay['vpp']}")
    parts.append(f"{'FSDP' if lay.get('zero') == 3 else 'DP'}{dp}")
    if lay.get("mbs"):
        parts.append(f"MBS{lay['mbs']}")
    return " ".join(parts)


def unsearched(lay: dict, model, machine) -> list[str]:
    """The published settings `meshspeed plan` never proposes (layout_space's ranges)."""
    out = []
    if lay["tp"] > machine.gpus_per_node or model.n_heads % lay["tp"]:
        out.append(f"TP {lay['tp']}")
    if lay["cp"] not in (1, 2, 4):
        out.append(f"CP {lay['cp']}")
    if lay.get("vpp") not in (None, 1, 2):
        out.append(f"VP {lay['vpp']}")
    if lay.get("mbs") not in (None, 1, 2, 4):
        out.append(f"micro-batch {lay['mbs']}")
    return out


def evaluate_theirs(cfg, world: int, machine, lay: dict):
    """(best predicted result for the published layout, rejection lines): the planner's own
    search (rank_layouts) with their stated settings pinned, as `meshspeed plan --parallel.tp 4
    ...` pins a user's; the unstated ones (schedule, micro-batch) and the memory rung are chosen
    as the planner chooses them."""
    model, _ = resolve_model(cfg)
    t = cfg.train
    tp, pp, cp = lay["tp"], lay["pp"], lay["cp"]
    pins = {"parallel.tp": tp, "parallel.pp": pp, "parallel.cp": cp, "parallel.ep": 1}
    pins["parallel.sequence_parallel"] = tp > 1
    if lay.get("vpp"):
        pins["parallel.pp_schedule"] = "1f1b" if lay["vpp"] == 1 else "interleaved"
        pins["parallel.vpp"] = lay["vpp"]
    if lay.get("mbs"):
        pins["train.micro_batch_size"] = lay["mbs"]
    if lay.get("zero") is not None:
        pins["parallel.zero"] = lay["zero"]
    ok, rejected = rank_layouts(cfg, world, machine, fixed=pins)
    lines = [r["rejected"] for r in rejected]
    dp = world // (tp * pp * cp)
    if not ok and not lines:
        lines = [f"global batch {t.global_batch_size} does not split into dp {dp} × micro-batches"]
    return (ok[0] if ok else None), lines


def smallest_memory(rejected: list[str]) -> str:
    """The rejection with the least memory (the ladder's last rung), else the first line."""
    mem = [(float(m.group(1)), r) for r in rejected if (m := re.match(r"memory ([\d.]+) GiB", r))]
    if mem:
        return min(mem)[1].split(" (")[0]
    return rejected[0] if rejected else "no layout"


def reported_mfu(row: dict, model, machine) -> tuple[float, str]:
    if row.get("mfu") is not None:
        return row["mfu"], f"{row['mfu']:.1%}"
    if row.get("tflops") is not None:
        mfu = row["tflops"] / machine.peak_tflops
        return mfu, f"{mfu:.1%}†"
    mfu = row["tps"] * flops_per_token(model, row["seq"]) / (machine.peak_tflops * 1e12)
    return mfu, f"{mfu:.1%}*"


def compare(row: dict, top: int) -> dict:
    cfg = load(row)
    machine = get_machine(DEVICE, gpus_per_node=GPUS_PER_NODE, **row.get("machine", {}))
    world, lay = row["gpus"], row["layout"]
    model, _ = resolve_model(cfg)
    ok, _ = rank_layouts(cfg, world, machine)
    theirs, rejected = evaluate_theirs(cfg, world, machine, lay)
    out = {"ok": ok, "theirs": theirs, "machine": machine, "model": model}
    missing = unsearched(lay, model, machine)
    if theirs is None:
        out["rank"], out["verdict"] = None, f"no: {smallest_memory(rejected)}"
        if missing:
            out["verdict"] += f" ({', '.join(missing)} not searched)"
        return out
    step = theirs["predicted"]["step_s"]
    faster = [r for r in ok if not matches(r["settings"], lay) and r["predicted"]["step_s"] < step]
    rank = len(faster) + 1
    out["rank"] = rank
    if missing:
        out["verdict"] = f"no: {', '.join(missing)} not searched (would rank #{rank})"
    elif rank <= top:
        out["verdict"] = f"yes, #{rank}"
    else:
        out["verdict"] = f"no, #{rank}: {why_lost(theirs, ok[0])}"
    return out


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--only", default="", help="run only the rows whose run name or model contains this")
    p.add_argument("--top", type=int, default=3, help="how many of our first layouts count as a match")
    args = p.parse_args()
    require_positive(p, args, "top")
    registered = register_shapes()
    rows = [r for r in PUBLISHED if args.only.lower() in f"{r['run']} {r['preset']}".lower()]
    if not rows:
        p.error(f"--only {args.only!r} matches no run")
    m = get_machine(DEVICE, gpus_per_node=GPUS_PER_NODE)
    print(
        f"machine {m.name}: {m.peak_tflops:g} TFLOP/s bf16, {m.memory_gib:g} GiB, "
        f"NVLink {m.intra_gbs:g} GB/s, {m.inter_gbs:g} GB/s per GPU between nodes, "
        f"{GPUS_PER_NODE} GPUs per node; bf16; "
        f"top {args.top}\n"
    )
    print(
        f"| run | GPUs | seq × batch | their layout | their MFU | our #1 (predicted MFU) "
        f"| their layout, predicted MFU | theirs in our top {args.top}? |"
    )
    print("|---|---:|---|---|---:|---|---|---|")
    used = []
    for row in rows:
        t0 = time.perf_counter()
        res = compare(row, args.top)
        model, machine = res["model"], res["machine"]
        _, their_mfu = reported_mfu(row, model, machine)
        ok, theirs = res["ok"], res["theirs"]
        best = f"{short(ok[0]['settings'])} ({ok[0]['predicted']['mfu']:.1%})" if ok else "nothing fits"
        pred = f"{theirs['predicted']['mfu']:.1%} ({short(theirs['settings'])})" if theirs else "does not fit"
        if row["source"] not in used:
            used.append(row["source"])
        note = []
        if row.get("machine"):
            note.append(f"{machine.memory_gib:g} GiB")
        if row["preset"] in registered:
            note.append("shape not a preset")
        run = f"{row['run']} [{used.index(row['source']) + 1}]" + (f" ({', '.join(note)})" if note else "")
        print(
            f"| {run} | {row['gpus']:,} | {row['seq']:,} × {row['batch']:,} | {published_text(row)} "
            f"| {their_mfu} | {best} | {pred} | {res['verdict']} |",
            flush=True,
        )
        print(
            f"  {row['run']} on {row['gpus']}: {len(ok)} layouts fit, "
            f"{param_count(model) / 1e9:.1f}B parameters, {time.perf_counter() - t0:.0f} s",
            file=sys.stderr,
            flush=True,
        )
    print()
    for i, key in enumerate(used):
        print(f"[{i + 1}] {SOURCES[key]}")
    print(
        "† published model TFLOP/s per GPU over the dense bf16 peak. "
        "* converted from the published tokens/s per GPU with meshspeed's FLOP count. "
        "Layouts: tp pp cp, vp virtual stages per rank, mb micro-batch, z ZeRO stage, recompute."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
