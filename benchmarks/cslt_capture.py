"""Capture what torch._cslt_compress writes on this GPU, so that meshspeed's compressed 2:4 layout
(meshspeed/sparse/cslt_layout.py) can be checked against the real thing on a CPU, byte for byte.

The fused compression kernel writes the layout that cslt_layout.py describes; where the GPU's
cuSPARSELt writes another one, the kernel's self-check fails and compression falls back to
_cslt_compress (correct, but a second pass). This saves, per shape and dtype, a masked dense
matrix whose kept values are all distinct (value i encodes its own position) and cuSPARSELt's
compressed bytes of it, into one .pt file a CPU test or session can read.

    python -m benchmarks.cslt_capture --out DIR      # writes DIR/cslt_capture.pt (needs CUDA)
"""

from __future__ import annotations

import os
import sys

import torch

from benchmarks.harness import parser

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
            out["cases"].append(case)
            print(r, c, dtype, case.get("error") or f"{case['w'].numel()} bytes")
    os.makedirs(a.out, exist_ok=True)
    torch.save(out, os.path.join(a.out, "cslt_capture.pt"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
