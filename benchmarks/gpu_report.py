"""One command for a CUDA machine: run the CUDA tests and time training steps, write
gpu_report.json and gpu_report.md. Without CUDA it says so in one line and exits 0.

On CUDA, in one run:
- the kernel tests (tests/kernels) compiled on the GPU: pass/fail counts;
- one-device training steps (bf16, torch fused AdamW) of the `small` preset and of a ~1B Llama
  (dim 2048, 16 layers, 16 heads, seq 2048), fused kernels off / on and torch.compile per block:
  tokens/s, MFU (train/metrics.py's device table) and peak memory;
- Liger-Kernel's RMSNorm / SwiGLU against ours where `liger_kernel` is installed.

Not in this version (listed in the report as not run): 2:4 sparse vs dense linear
(benchmarks/sparse_linear.py does it) and the collectives' bus bandwidth (`meshspeed bench comm`).

    python benchmarks/gpu_report.py [--out DIR] [--steps 10]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from meshspeed.kernels.fused import rms_norm_fused, rms_norm_ref, swiglu_fused, swiglu_ref  # noqa: E402
from meshspeed.models import build_model, cross_entropy_loss, get_preset  # noqa: E402
from meshspeed.models.flops import flops_per_token  # noqa: E402
from meshspeed.models.layers import set_fused_kernels  # noqa: E402
from meshspeed.train.metrics import mfu, peak_flops  # noqa: E402

ONE_B = dict(
    dim=2048, n_layers=16, n_heads=16, n_kv_heads=8, ffn_hidden=5632, vocab_size=32000, max_seq_len=2048
)


def run_tests() -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "tests/kernels"], capture_output=True, text=True, timeout=1800
    )
    return {"returncode": out.returncode, "summary": out.stdout.strip().splitlines()[-1:]}


def time_steps(config, seq: int, batch: int, steps: int, fused: bool, compiled: bool) -> dict:
    torch.cuda.reset_peak_memory_stats()
    model = build_model(config, seed=0).to("cuda", torch.bfloat16)
    set_fused_kernels(model, fused)
    if compiled:
        for block in model.layers.values():  # each transformer block compiled on its own
            block.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=gen).cuda()
    times = []
    for i in range(steps + 2):  # two warmup steps (compilation, allocator)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    tps = batch * seq / (sum(times) / len(times))
    return {
        "tokens_per_s": tps,
        "mfu": mfu(tps, flops_per_token(config, seq), peak_flops("cuda", 1)),
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
    }


def time_kernel(fn, *args, reps: int = 50) -> float:
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn(*args)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def kernels_vs_liger() -> dict:
    x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    res = {
        "rms_norm": {
            "torch": time_kernel(rms_norm_ref, x, w),
            "meshspeed": time_kernel(rms_norm_fused, x, w),
        },
        "swiglu": {"torch": time_kernel(swiglu_ref, x, x), "meshspeed": time_kernel(swiglu_fused, x, x)},
    }
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction

        res["rms_norm"]["liger"] = time_kernel(lambda a, b: LigerRMSNormFunction.apply(a, b, 1e-5), x, w)
        res["swiglu"]["liger"] = time_kernel(LigerSiLUMulFunction.apply, x, x)
    except ImportError:
        res["liger"] = "not installed"
    return res


def markdown(rep: dict) -> str:
    lines = [f"# meshspeed GPU report: {rep['device']}", "", f"kernel tests: {rep['tests']['summary']}", ""]
    lines += ["| model | fused | compile | tokens/s | MFU | peak GiB |", "|---|---|---|---|---|---|"]
    for r in rep["steps"]:
        m = "n/a" if r["mfu"] is None else f"{r['mfu']:.1%}"
        lines.append(
            f"| {r['model']} | {r['fused']} | {r['compile']} | {r['tokens_per_s']:,.0f} | {m} | "
            f"{r['peak_mem_gib']:.1f} |"
        )
    lines += [
        "",
        "kernel times (s): " + json.dumps(rep["kernels"]),
        "",
        "not run: " + ", ".join(rep["not_run"]),
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_report: no CUDA device here (torch.cuda.is_available() is False); nothing to report")
        return 0
    rep = {"device": torch.cuda.get_device_name(), "tests": run_tests(), "steps": []}
    for name, config, seq, batch in (
        ("small", get_preset("small"), 512, 8),
        ("llama-1b", get_preset("tiny", **ONE_B), 2048, 2),
    ):
        for fused, compiled in ((False, False), (True, False), (False, True)):
            r = time_steps(config, seq, batch, args.steps, fused, compiled)
            rep["steps"].append({"model": name, "fused": fused, "compile": compiled, **r})
    rep["kernels"] = kernels_vs_liger()
    rep["not_run"] = [
        "2:4 sparse vs dense (benchmarks/sparse_linear.py)",
        "bus bandwidth (meshspeed bench comm)",
    ]
    with open(os.path.join(args.out, "gpu_report.json"), "w") as f:
        json.dump(rep, f, indent=1)
    with open(os.path.join(args.out, "gpu_report.md"), "w") as f:
        f.write(markdown(rep))
    print(markdown(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
