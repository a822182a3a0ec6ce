"""Capture what torch._cslt_compress writes on this GPU, so that meshspeed's compressed 2:4 layout
(meshspeed/sparse/cslt_layout.py) can be checked against the real thing on a CPU, byte for byte.

The fused compression kernel writes the layout that cslt_layout.py describes; where the GPU's
cuSPARSELt writes another one, the kernel's self-check fails and compression falls back to
_cslt_compress (correct, but a second pass). This saves, per shape and dtype, a masked dense
matrix whose kept values are all distinct (value i encodes its own position) and cuSPARSELt's
compressed bytes of it, into one .pt file a CPU test or session can read; and the fused
kernel's own bytes of the same matrix, compiled, with a line saying where they differ.

    python -m benchmarks.cslt_capture --out DIR      # writes DIR/cslt_capture.pt (needs CUDA)
"""

from __future__ import annotations

import os
import sys

import torch

from benchmarks.harness import parser
from meshspeed.sparse import kernels

SHAPES = [(64, 64), (64, 128), (128, 64), (128, 256), (256, 512)]


def coded(rows: int, cols: int, seed: int) -> torch.Tensor:
    """A 2:4 matrix: two kept of every four along a row, the pair chosen at random, the kept
    values 1..251 in row-major order, repeating (integers up to 256 are exact in bf16 and fp16):
    a value and its group's order tell where each compressed byte came from."""
    g = torch.Generator().manual_seed(seed)
    groups = rows * cols // 4
    choices = torch.tensor([(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)])
    pairs = choices[torch.randint(0, 6, (groups,), generator=g)]
    dense = torch.zeros(groups, 4)
    kept = (torch.arange(groups * 2) % 251 + 1).float().view(groups, 2)
    dense.scatter_(1, pairs, kept)
    return dense.view(rows, cols)


def _diff(case: dict, numel: int) -> str:
    """Where the compiled kernel's bytes differ from cuSPARSELt's: values, metadata, or none."""
    if "w" not in case or "kernel_w" not in case:
        return case.get("kernel_error", "")
    want, got = case["w"].reshape(-1), case["kernel_w"]
    values = numel  # the kept values' bytes: numel / 2 elements of 2 bytes; then the metadata
    bad_v = int((want[:values] != got[:values]).sum())
    bad_m = int((want[values:] != got[values:]).sum())
    if not bad_v + bad_m:
        return "kernel: equal"
    return f"kernel: {bad_v} value bytes, {bad_m} metadata bytes differ"


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("cslt_capture: no CUDA device here; nothing to capture")
        return 0
    out = {"device": torch.cuda.get_device_name(), "torch": str(torch.__version__), "cases": []}
    for dtype in (torch.bfloat16, torch.float16):
        for i, (r, c) in enumerate(SHAPES):
            dense = coded(r, c, i)
            w = dense.to(dtype).cuda()
            case = {"shape": (r, c), "dtype": str(dtype), "dense": dense.to(dtype)}
            try:
                case["w"] = torch._cslt_compress(w).view(torch.uint8).cpu()
            except Exception as err:  # noqa: BLE001 - a shape cuSPARSELt refuses is recorded as such
                case["error"] = f"{type(err).__name__}: {err}"
            # the fused kernel, compiled, on the same matrix and mask: where its bytes differ
            # from cuSPARSELt's (the H200 run of 2026-11-27 found they do, while the interpreter
            # writes cuSPARSELt's bytes) says which part of the kernel the compiler changed
            try:
                got = kernels.mask_and_compress(w.float(), w != 0, dtype=dtype, want_t=False)
                case["kernel_w"] = got.w.view(torch.uint8).cpu().reshape(-1)
            except Exception as err:  # noqa: BLE001 - recorded, the capture goes on
                case["kernel_error"] = f"{type(err).__name__}: {err}"
            out["cases"].append(case)
            print(r, c, dtype, case.get("error") or f"{case['w'].numel()} bytes", _diff(case, r * c))
    os.makedirs(a.out, exist_ok=True)
    torch.save(out, os.path.join(a.out, "cslt_capture.pt"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
