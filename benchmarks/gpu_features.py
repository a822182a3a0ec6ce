"""The features section of benchmarks/gpu_report.py, in a process of its own: each [memory]
feature (and 2:4 sparsity, fused kernels, torch.compile, accumulation 8) as one trainer on one
device, built, stepped and timed one after another; the allocator's peak against the run plan's
estimate. Prints one `FEATURE {json}` line per setting as it finishes, so a timeout keeps what
was done.

    python -m benchmarks.gpu_features '{"device": "cuda", "base": [...], "cases": [...], "steps": 8}'
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import tempfile
import time

import torch

# On the GPU llama3-8b's shapes at dim 2048 and 4 layers (vocabulary 128k, so the loss's logits
# weigh what they do in the real model), 2 x 2048 tokens in bf16: big enough for each feature's
# cost to show, small enough to build a dozen times inside the report's budget. Toy sizes on the
# CPU (--cpu-smoke), where only the script itself is checked.
FEATURE_BASE = {
    "cuda": [
        ("model.preset", "llama3-8b"),
        ("model.dim", "2048"),
        ("model.n_layers", "4"),
        ("model.n_heads", "16"),
        ("model.n_kv_heads", "8"),
        ("train.seq_len", "2048"),
        ("train.global_batch_size", "2"),
        ("train.dtype", "bfloat16"),
        ("data.max_mb", "2"),
        ("train.eval_batches", "1"),  # at 16 x 2048 tokens a batch the validation split holds one
    ],
    "cpu": [
        ("train.seq_len", "32"),
        ("train.global_batch_size", "2"),
        ("train.dtype", "float32"),
        ("data.max_mb", "0.2"),
    ],
}
COMMON = [("nproc", "1"), ("parallel.tp", "1"), ("train.micro_batch_size", "2"), ("train.steps", "100")]
ACC8 = ("train.global_batch_size", "16")  # micro 2 x 8
FEATURES = [
    ("plain", []),
    ("recompute activation", [("memory.recompute", "activation")]),
    ("recompute selective", [("memory.recompute", "selective")]),
    ("recompute full", [("memory.recompute", "full")]),
    ("chunked_loss", [("memory.chunked_loss", "true")]),
    ("offload_optimizer", [("memory.offload_optimizer", "true")]),
    ("swap_activations", [("memory.swap_activations", "true")]),
    ("zero 3 at dp 1", [("parallel.zero", "3")]),
    ("reuse_fp32_param", [("memory.reuse_fp32_param", "true")]),
    ("2:4 sparsity", [("sparsity.pattern", "2:4")]),
    ("fused kernels", [("train.fused_kernels", "true")]),
    ("plain, accumulation 8", [ACC8]),
    ("offload_optimizer, accumulation 8", [("memory.offload_optimizer", "true"), ACC8]),
    ("torch.compile", [("train.compile", "true")]),  # last: its compilation may not fit the budget
]


def run(spec: dict) -> None:
    """Each case in this process, one after another: build the trainer, time steps, read the
    allocator's peak; one `FEATURE {json}` line per case as it finishes."""
    from meshspeed.comm.context import init
    from meshspeed.comm.launch import headline
    from meshspeed.plan import config
    from meshspeed.plan.run_plan import make_plan
    from meshspeed.train.trainer import Trainer

    cuda = spec["device"] == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    ctx = init(device=spec["device"])
    for name, extra in spec["cases"]:
        res, trainer = {"name": name, "settings": [f"--{k} {v}" for k, v in extra]}, None
        with tempfile.TemporaryDirectory() as d:
            try:
                over = [tuple(x) for x in spec["base"] + extra] + [
                    ("run.dir", d),
                    ("run.device", spec["device"]),
                ]
                cfg = config.load(None, over)
                plan = make_plan(cfg, 1)
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                trainer = Trainer(cfg, ctx, plan)
                times = []
                for step in range(spec["steps"]):
                    sync()
                    t0 = time.perf_counter()
                    row = trainer.train_step(step)
                    sync()
                    times.append(time.perf_counter() - t0)
                res.update(
                    step_ms=1e3 * statistics.median(times[2:] or times),
                    loss=row["loss"],
                    estimate=plan.ranks[0]["memory"]["total"],
                    peak=torch.cuda.max_memory_allocated() if cuda else None,
                )
                trainer.metrics.close()
            # a failed setting (a refused combination, out of memory, a kernel error) is a row
            # saying why, and the next setting still runs
            except (RuntimeError, ValueError, TypeError, AssertionError, OSError) as err:
                res["error"] = headline(err)
            trainer = None
            gc.collect()
        print("FEATURE " + json.dumps(res), flush=True)


if __name__ == "__main__":
    run(json.loads(sys.argv[1]))
