"""Sparse linear vs nn.Linear, forward + backward, side by side in one run.

On CUDA (sm80+): LLM shapes, 8192 tokens, bf16. Columns:
  dense         nn.Linear
  masked        SparseLinear on dense kernels (use_sparse_kernels=False): the fallback's cost
  2:4 cached    SparseLinear on 2:4 kernels, compression reused (gradient-accumulation micro-batches)
  2:4 +compress same, but the weight changes every step (an optimizer step), so W and W^T are recompressed
  mask          transposable 2:4 mask recomputation + install, paid once per update interval
  2:4 amortized "2:4 +compress" + mask / update_interval: the steady-state cost of dynamic 2:4 training
Ratios are dense / variant (> 1 means faster than nn.Linear).

Without CUDA it says so and times the dense-masked path against nn.Linear on CPU at small shapes.

    python benchmarks/sparse_linear.py [--tokens 8192] [--iters 20] [--update-interval 100]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from meshspeed.sparse import SparseLinear, nm_mask, transposable_2to4_mask  # noqa: E402
from meshspeed.sparse.cuda import sparse_backend  # noqa: E402

CUDA_SHAPES = "4096x4096,4096x14336,14336x4096"
CPU_SHAPES = "512x512,512x1792,1792x512"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device: torch.device, iters: int, warmup: int) -> float:
    """Median milliseconds per call (median resists the odd noisy iteration)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    samples.sort()
    return samples[len(samples) // 2]


def fwd_bwd(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor, touch_weight: bool):
    def run():
        if touch_weight:
            with torch.no_grad():
                layer.weight.mul_(1.0)  # stands in for an optimizer step: bumps weight._version
        layer.weight.grad = None
        x.grad = None
        layer(x).backward(grad)

    return run


def make_sparse(dense: nn.Linear, transposable: bool, use_kernels: bool) -> SparseLinear:
    layer = SparseLinear.from_linear(
        dense, nm=(2, 4), transposable=transposable, use_sparse_kernels=use_kernels
    )
    layer.set_mask(transposable_2to4_mask(layer.weight) if transposable else nm_mask(layer.weight, 2, 4))
    return layer


def parse_shapes(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        a, b = item.lower().split("x")
        out.append((int(a), int(b)))
    return out


def bench_cuda(args) -> None:
    device = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    print(
        f"device: {torch.cuda.get_device_name(device)}  backend: {sparse_backend()}  dtype: {args.dtype}  "
        f"tokens: {args.tokens}  update interval: {args.update_interval}"
    )
    header = (
        f"{'in->out':>12} {'dense':>8} {'masked':>8} {'2:4 cached':>11} {'2:4 +compress':>14} "
        f"{'mask':>8} {'2:4 amortized':>14} {'ratio cached':>13} {'ratio amort.':>13}  path"
    )
    print(header)
    print("-" * len(header))
    for in_f, out_f in parse_shapes(args.shapes or CUDA_SHAPES):
        torch.manual_seed(0)
        dense = nn.Linear(in_f, out_f, bias=False, device=device, dtype=dtype)
        x = torch.randn(args.tokens, in_f, device=device, dtype=dtype, requires_grad=True)
        grad = torch.randn(args.tokens, out_f, device=device, dtype=dtype)
        t_dense = time_ms(fwd_bwd(dense, x, grad, True), device, args.iters, args.warmup)
        masked = make_sparse(nn.Linear(in_f, out_f, bias=False, device=device, dtype=dtype), True, False)
        t_masked = time_ms(fwd_bwd(masked, x, grad, True), device, args.iters, args.warmup)
        sparse = make_sparse(nn.Linear(in_f, out_f, bias=False, device=device, dtype=dtype), True, True)
        t_cached = time_ms(fwd_bwd(sparse, x, grad, False), device, args.iters, args.warmup)
        t_compress = time_ms(fwd_bwd(sparse, x, grad, True), device, args.iters, args.warmup)

        def mask_update(layer=sparse):  # bound now: `sparse` is deleted at the end of the iteration
            layer.set_mask(transposable_2to4_mask(layer.weight), check=False)

        t_mask = time_ms(mask_update, device, max(3, args.iters // 4), 1)
        t_amort = t_compress + t_mask / args.update_interval
        path = sparse.path + ("" if not sparse.path_reason else f" ({sparse.path_reason})")
        print(
            f"{f'{in_f}->{out_f}':>12} {t_dense:8.3f} {t_masked:8.3f} {t_cached:11.3f} {t_compress:14.3f} "
            f"{t_mask:8.3f} {t_amort:14.3f} {t_dense / t_cached:13.2f} {t_dense / t_amort:13.2f}  {path}"
        )
        del dense, masked, sparse, x, grad
        torch.cuda.empty_cache()
    print(
        "times in ms per forward+backward (mask: per recomputation); ratio = dense / variant, > 1 is faster"
    )


def bench_cpu(args) -> None:
    device = torch.device("cpu")
    tokens = args.tokens if args.tokens_set else 512
    print(
        "CUDA is not available: the 2:4 sparse kernels cannot run here. Timing the dense-masked path "
        f"(what SparseLinear runs without CUDA) against nn.Linear on CPU, float32, {tokens} tokens."
    )
    header = f"{'in->out':>12} {'nn.Linear':>10} {'masked':>10} {'overhead':>9} {'mask':>9}  path"
    print(header)
    print("-" * len(header))
    for in_f, out_f in parse_shapes(args.shapes or CPU_SHAPES):
        torch.manual_seed(0)
        dense = nn.Linear(in_f, out_f, bias=False)
        x = torch.randn(tokens, in_f, requires_grad=True)
        grad = torch.randn(tokens, out_f)
        t_dense = time_ms(fwd_bwd(dense, x, grad, True), device, args.iters, args.warmup)
        sparse = make_sparse(nn.Linear(in_f, out_f, bias=False), True, True)
        t_sparse = time_ms(fwd_bwd(sparse, x, grad, True), device, args.iters, args.warmup)
        t_mask = time_ms(
            lambda: sparse.set_mask(transposable_2to4_mask(sparse.weight), check=False), device, 3, 1
        )
        print(
            f"{f'{in_f}->{out_f}':>12} {t_dense:10.3f} {t_sparse:10.3f} {t_sparse / t_dense:8.2f}x "
            f"{t_mask:9.3f}  "
            f"{sparse.path} ({sparse.path_reason})"
        )
    print("times in ms per forward+backward (mask: per recomputation); overhead = masked / nn.Linear")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument(
        "--tokens", type=int, default=None, help="tokens per batch (default 8192 on CUDA, 512 on CPU)"
    )
    parser.add_argument(
        "--shapes",
        default=None,
        help=f"comma-separated INxOUT (default {CUDA_SHAPES} on CUDA, {CPU_SHAPES} on CPU)",
    )
    parser.add_argument(
        "--dtype", default="bfloat16", choices=["bfloat16", "float16"], help="CUDA compute dtype"
    )
    parser.add_argument("--iters", type=int, default=20, help="timed iterations per variant")
    parser.add_argument("--warmup", type=int, default=3, help="untimed iterations per variant")
    parser.add_argument(
        "--update-interval",
        type=int,
        default=100,
        help="steps between mask updates, for the amortized column",
    )
    parser.add_argument(
        "--force-cutlass", action="store_true", help="use the CUTLASS kernels even where cuSPARSELt exists"
    )
    parser.add_argument("--cpu", action="store_true", help="run the CPU comparison even when CUDA is present")
    args = parser.parse_args(argv)
    args.tokens_set = args.tokens is not None
    if args.tokens is None:
        args.tokens = 8192
    if args.force_cutlass:
        from torch.sparse import SparseSemiStructuredTensor

        SparseSemiStructuredTensor._FORCE_CUTLASS = True
    if torch.cuda.is_available() and not args.cpu:
        if torch.cuda.get_device_capability() < (8, 0):
            print(
                f"CUDA device {torch.cuda.get_device_name()} is below sm80: no 2:4 kernels; "
                "running the CPU comparison"
            )
            bench_cpu(args)
        else:
            bench_cuda(args)
    else:
        bench_cpu(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
