"""2:4 sparse linear against dense, forward + backward, product by product, in one run.

On CUDA (sm80+ with cuSPARSELt), bf16, per shape in -> out at a token count:
  dense       nn.Linear forward + backward (y = x W^T, dX = dY W, dW = dY^T x)
  y, dX       each product dense (on W~ = W * mask) and on 2:4 (torch._cslt_sparse_mm with the
              algorithm from _cslt_sparse_mm_search); dW is dense on both sides
  2:4 auto    SparseLinear, --sparsity.kernels auto: each product where it measured faster,
              compressed operands reused (what every micro-batch after the first pays)
  2:4 forced  SparseLinear, kernels=sparse: both products on 2:4 whatever they cost
  amortized   2:4 auto + its per-step preparation / --micro-batches + mask and compression of
              an update / --update-interval (the steady state of dynamic 2:4 training)
  mask+comp   the fused Triton kernel: transposable mask from |W| and W~, W~^T compressed, one
              pass; 'before' is transposable_2to4_mask in torch + _cslt_compress(W~) +
              _cslt_compress(a transposed copy of W~)
Ratios are dense / variant (> 1: faster than nn.Linear). Rows: the FFN projections of
Llama-3-8B and -70B at 8192 tokens, a Mixtral-8x7B expert (8192 tokens x top-2 / 8 experts =
2048 per expert) and, in their own table, the attention projections (q/o and k/v) of both Llamas.

Without CUDA it says so and runs what CPU runs at small shapes: nn.Linear, SparseLinear on the
dense-masked fallback, and the torch reference of mask + compression (the same table headings).

    python -m benchmarks.sparse_linear [--iters 10] [--update-interval 100] [--micro-batches 1]
                                       [--shapes 4096x14336@8192,...] [--json out.json]
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from torch import nn

from benchmarks import harness
from meshspeed.sparse import SparseLinear, choice, cslt_layout, cslt_ops, kernels, transposable_2to4_mask

FFN = [  # (label, in, out, tokens)
    ("8B w1/w3", 4096, 14336, 8192),
    ("8B w2", 14336, 4096, 8192),
    ("70B w1/w3", 8192, 28672, 8192),
    ("70B w2", 28672, 8192, 8192),
    ("Mixtral w1/w3", 4096, 14336, 2048),
    ("Mixtral w2", 14336, 4096, 2048),
]
ATTENTION = [
    ("8B q/o", 4096, 4096, 8192),
    ("8B k/v", 4096, 1024, 8192),
    ("70B q/o", 8192, 8192, 8192),
    ("70B k/v", 8192, 1024, 8192),
]
CPU_SHAPES = [("small w1", 256, 896, 512), ("small w2", 896, 256, 512), ("small q", 256, 256, 512)]


def cslt_available() -> bool:
    return torch.backends.cusparselt.is_available()


def parse_shapes(text: str) -> list[tuple]:
    """'INxOUT@TOKENS,...' -> [(label, in, out, tokens)]."""
    out = []
    for item in text.split(","):
        dims, _, tokens = item.partition("@")
        a, b = dims.lower().split("x")
        out.append((item, int(a), int(b), int(tokens or 8192)))
    return out


def fwd_bwd(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor):
    def run():
        layer.weight.grad = x.grad = None
        layer(x).backward(grad)

    return run


def timer(iters: int):
    return lambda name, fn, device: choice.time_ms(name, fn, device, iters=iters, warmup=2)


def bench_cuda_shape(label, in_f, out_f, tokens, args) -> dict:
    dtype, t = torch.bfloat16, timer(args.iters)
    dev = torch.device("cpu" if args.stand_in else "cuda")
    ops = cslt_ops.ReferenceCsltOps() if args.stand_in else cslt_ops.default_ops()
    torch.manual_seed(0)
    dense = nn.Linear(in_f, out_f, bias=False, device=dev, dtype=dtype)
    x = torch.randn(tokens, in_f, device=dev, dtype=dtype, requires_grad=True)
    g = torch.randn(tokens, out_f, device=dev, dtype=dtype)
    row = {"shape": label, "in": in_f, "out": out_f, "tokens": tokens}
    row["dense"] = t("dense", fwd_bwd(dense, x, g), dev)
    w = dense.weight.detach()
    mask = transposable_2to4_mask(w)
    row["fused_misfit"] = "" if args.stand_in else ops.why_not_fused(tuple(w.shape), dtype, dev)
    times, _, _ = choice.measure(ops, w, mask, tokens, dtype, False, True, t)
    row["products"] = dataclasses.asdict(times)
    for mode in ("auto", "sparse"):
        layer = SparseLinear.from_linear(copy.deepcopy(dense), transposable=True)
        layer.set_mask(mask)
        layer.kernel_mode, layer.uses_per_step = mode, args.micro_batches
        layer.cslt_ops = ops if args.stand_in else None
        layer(x)  # the first forward measures (auto) and compresses
        row[mode] = t(mode, fwd_bwd(layer, x, g), dev)
        if mode == "auto":
            c = layer.kernel_choice
            row["choice"] = f"y {'2:4' if c.fwd else 'dense'}, dX {'2:4' if c.dgrad else 'dense'}"
            row["prep"] = choice.prep_ms(times, c.fwd, c.dgrad)
    fused = kernels.mask_and_compress_reference if args.stand_in else kernels.mask_and_compress
    row["mask_compress"] = t("mask_compress", lambda: fused(w, dtype=dtype), dev)
    def compress(a):
        return cslt_layout.compress_reference(a, a != 0) if args.stand_in else torch._cslt_compress(a)

    def before():
        m = transposable_2to4_mask(w, fused=False)
        wm = w * m
        compress(wm), compress(wm.t().contiguous())

    row["before"] = t("before", before, dev)
    # the plain-torch layout: CsltOps' other fallback where the fused kernel misfits (cslt_ops.py)
    row["reference_compress"] = t(
        "reference_compress", lambda: cslt_ops.fallback_compress("reference", w, mask, dtype, True, True), dev
    )
    row["fallback"] = "" if args.stand_in else ops.fallback.get((tuple(w.shape), dtype, dev), "")
    row["amortized"] = (
        row["auto"] + row["prep"] / args.micro_batches + row["mask_compress"] / args.update_interval
    )
    return row


def print_cuda(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    head = (
        f"{'shape':>14} {'in->out':>12} {'tokens':>6} {'dense':>7} {'y dense':>8} {'y 2:4':>7} "
        f"{'dX dense':>8} {'dX 2:4':>7} {'2:4 auto':>8} {'forced':>7} {'amort.':>7} "
        f"{'mask+comp':>9} {'before':>7} {'auto/d':>6} {'amort/d':>7}  choice"
    )
    print(head + "\n" + "-" * len(head))
    for r in rows:
        p = r["products"]
        print(
            f"{r['shape']:>14} {r['in']:>5}->{r['out']:<6} {r['tokens']:>6} {r['dense']:7.3f} "
            f"{p['dense_fwd']:8.3f} {p['sparse_fwd']:7.3f} {p['dense_dgrad']:8.3f} {p['sparse_dgrad']:7.3f} "
            f"{r['auto']:8.3f} {r['sparse']:7.3f} {r['amortized']:7.3f} {r['mask_compress']:9.3f} "
            f"{r['before']:7.3f} {r['dense'] / r['auto']:6.2f} {r['dense'] / r['amortized']:7.2f}  "
            f"{r['choice']}"
        )
        if r["fused_misfit"]:
            print(
                f"{'':>14} fused kernel not used ({r['fused_misfit']}); fallback chosen: "
                f"{r['fallback'] or 'not yet'} (reference layout {r['reference_compress']:.3f} ms, "
                f"mask + _cslt_compress {r['before']:.3f} ms, W and W^T)"
            )


def bench_cpu(args) -> list[dict]:
    """What runs without CUDA: the dense-masked fallback and the torch reference compression."""
    dev, t, rows = torch.device("cpu"), timer(args.iters), []
    for label, in_f, out_f, tokens in parse_shapes(args.shapes) if args.shapes else CPU_SHAPES:
        torch.manual_seed(0)
        dense = nn.Linear(in_f, out_f, bias=False)
        x, g = torch.randn(tokens, in_f, requires_grad=True), torch.randn(tokens, out_f)
        layer = SparseLinear.from_linear(copy.deepcopy(dense), transposable=True)
        layer.set_mask(transposable_2to4_mask(layer.weight))
        layer.kernel_mode = "auto"
        w = dense.weight.detach()
        row = {"shape": label, "in": in_f, "out": out_f, "tokens": tokens}
        row["dense"] = t("dense", fwd_bwd(dense, x, g), dev)
        row["masked"] = t("masked", fwd_bwd(layer, x, g), dev)
        row["mask_compress"] = t(
            "mask_compress", lambda: kernels.mask_and_compress_reference(w, dtype=torch.bfloat16), dev
        )
        row["path"] = f"{layer.path} ({layer.path_reason})"
        rows.append(row)
    head = f"{'shape':>10} {'in->out':>10} {'tokens':>6} {'nn.Linear':>9} {'masked':>8} {'ratio':>6}"
    head += f" {'mask+comp':>9}  path"
    print(head + "\n" + "-" * len(head))
    for r in rows:
        print(
            f"{r['shape']:>10} {r['in']:>4}->{r['out']:<5} {r['tokens']:>6} {r['dense']:9.3f} "
            f"{r['masked']:8.3f} {r['dense'] / r['masked']:6.2f} {r['mask_compress']:9.3f}  {r['path']}"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__)
    p.add_argument("--iters", type=int, default=10, help="timed iterations per variant (default 10)")
    p.add_argument("--update-interval", type=int, default=100, help="steps between mask updates (100)")
    p.add_argument("--micro-batches", type=int, default=1, help="forwards per optimizer step (default 1)")
    p.add_argument("--shapes", default="", help="INxOUT@TOKENS,... instead of the default rows")
    p.add_argument("--cpu", action="store_true", help="the CPU table even where CUDA is present")
    p.add_argument(
        "--stand-in",
        action="store_true",
        help="run the CUDA table's code on CPU through the plain-torch stand-in of cuSPARSELt "
        "(checks the script; its times mean nothing); give small --shapes",
    )
    p.add_argument("--json", default="", help="also write the rows to this file")
    args = p.parse_args(argv)
    harness.require_positive(p, args, "iters", "update_interval", "micro_batches")
    try:
        shapes = parse_shapes(args.shapes) if args.shapes else []
    except ValueError:
        p.error(f"--shapes {args.shapes!r}: write INxOUT@TOKENS,... (e.g. 128x256@64)")
    bad = [s[0] for s in shapes if s[1] % 4 or s[2] % 4 or s[3] < 1]
    if bad:
        p.error(f"--shapes {', '.join(bad)}: IN, OUT multiples of 4 (2:4 in 4 × 4 blocks), TOKENS > 0")
    cuda = (torch.cuda.is_available() and not args.cpu) or args.stand_in
    if cuda and not args.stand_in and (torch.cuda.get_device_capability() < (8, 0) or not cslt_available()):
        print(f"{torch.cuda.get_device_name()}: no cuSPARSELt 2:4 kernels here; the CPU table instead")
        cuda = False
    if not cuda:
        print(
            "CUDA with cuSPARSELt is not available: 2:4 kernels cannot run here. Timing what CPU "
            "runs (float32): nn.Linear against SparseLinear's dense-masked fallback, and the "
            "torch reference of mask + compression (ms; ratio = nn.Linear / masked)."
        )
        rows = bench_cpu(args)
    else:
        name = "CPU, stand-in for cuSPARSELt (times mean nothing)"
        name = name if args.stand_in else torch.cuda.get_device_name()
        print(
            f"device: {name}  torch {torch.__version__}  bf16  update interval "
            f"{args.update_interval}  micro-batches {args.micro_batches}  (ms per forward + backward)"
        )
        groups = [("FFN", FFN), ("attention", ATTENTION)]
        if args.shapes:
            groups = [("custom", parse_shapes(args.shapes))]
        rows = []
        for title, shapes in groups:
            got = [bench_cuda_shape(*s, args) for s in shapes]
            print_cuda(f"{title} projections", got)
            rows += got
            if not args.stand_in:
                torch.cuda.empty_cache()
        print("auto/d, amort/d = dense / variant: > 1 is faster than nn.Linear")
    if args.json:
        harness.write_json(args.json, "rows", args, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
