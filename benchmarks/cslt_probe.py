"""Which part of the compiled 2:4 compression kernel (meshspeed/sparse/sparse24_triton.py) writes
bytes that differ from torch._cslt_compress, and from what: one GPU run, under 2 minutes.

    python -m benchmarks.cslt_probe            # from the repository root, on a CUDA machine
    OUT=DIR python -m benchmarks.cslt_probe    # the Triton IR of every kernel it compiles in DIR/ir
    python -m benchmarks.cslt_probe            # without CUDA: a dry run of the script (plain torch)

benchmarks/gpu_report.py runs it as its `cslt` section. Each line compares two compressions byte
for byte and says `equal` or where they differ (values or metadata; which rows mod 16, which groups
mod 8, whether lo/hi values or nibbles are swapped, whether the bytes are a permutation within 8,
64 or 256-byte blocks). K is the fused kernel (compiled), R the plain-torch layout
(cslt_layout.compress_reference, what the interpreter writes), C cuSPARSELt:

  self_check       what CsltOps decides at 128x256 ('' = the fused kernel is used)
  1. K vs R, R vs C  W and W^T, positive and signed inputs; `C(w*mask, -0.0) vs C(where, +0)`
                   says whether this cuSPARSELt counts -0.0 at a pruned slot as kept
  2. mask          the kernel's mask (COMPUTE_MASK) against patterns.mask_reference
  3. tile, num_warps  the same comparison at other tiles and warp counts (a layout-dependent
                   miscompile moves with them)
  4. ops           tl.split and tl.reshape/permute/split alone on the kernel's old plane shape:
                   the packing the kernel used before it was rebuilt without them (so a WRONG
                   here names the old kernel's bug, and an `equal` in 1. says the rebuild fixed it)

Not a test (nothing asserted): read its lines, fix, rerun.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from meshspeed.sparse import cslt_layout as L
from meshspeed.sparse import kernels
from meshspeed.sparse.patterns import mask_reference
from meshspeed.sparse.transposable import is_transposable_nm

BF, T0 = torch.bfloat16, time.time()
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def K(*a, tile=None, **k):
    """The fused kernel on CUDA; on the CPU (a dry run of this script) the plain-torch reference."""
    if dev.type == "cuda":
        return kernels.mask_and_compress(*a, **k, **({"tile": tile} if tile else {}))
    return kernels.mask_and_compress_reference(*a, **k)


def cs(x):
    """cuSPARSELt; the plain-torch layout on the CPU."""
    return torch._cslt_compress(x) if dev.type == "cuda" else L.compress_reference(x, x != 0)


def say(msg: str) -> None:
    print(f"[{time.time() - T0:5.1f}s] {msg}", flush=True)


def hist(t):
    return {i: n for i, n in enumerate(torch.bincount(t.cpu()).tolist()) if n}


def diff(tag, got, want, R, C):
    g, w = got.view(torch.uint8).reshape(-1), want.view(torch.uint8).reshape(-1)
    h, bad = R * C, (g != w).nonzero().flatten()
    if not len(bad):
        return say(f"{tag}: equal")
    bv, bm = bad[bad < h], bad[bad >= h] - h
    gv, wv = g[:h].view(-1, 4), w[:h].view(-1, 4)  # one 4-group = 2 values = 4 bytes
    badg = (gv != wv).any(1)
    swapv = int((gv == wv[:, [2, 3, 0, 1]]).all(1)[badg].sum())
    gm, wm = g[h:], w[h:]
    swapn = int((gm == ((wm >> 4) | (wm << 4)))[gm != wm].sum())
    perm = [
        n for n in (8, 64, 256) if torch.equal(gm.view(-1, n).sort(1).values, wm.view(-1, n).sort(1).values)
    ]
    inv = torch.empty(h // 8, dtype=torch.long, device=g.device)
    inv[L.meta_index(R, C, g.device).reshape(-1)] = torch.arange(h // 8, device=g.device)
    i = inv[bm]
    p = i // (C // 4)
    say(
        f"{tag}: VALUES {len(bv)}/{h} B in {int(badg.sum())} groups "
        f"(lo/hi swapped {swapv}) row%16 {hist(bv // C % 16)} grp%8 {hist(bv % C // 4 % 8)} | "
        f"META {len(bm)}/{h // 8} B (nibbles swapped {swapn}; same bytes within {perm or 'no'}-B blocks) "
        f"row%8 {hist(p % 8)} slab {hist(p // 8 % 4)} grp%8 {hist(i % (C // 4) % 8)}"
    )


def make(R, C, signed, seed=0):
    """A transposable mask (torch reference) and distinct exact values, half negative if signed."""
    g = torch.Generator().manual_seed(seed)
    m = mask_reference(torch.rand(R, C, generator=g))
    v = (torch.arange(R * C) % 251 + 1).float().view(R, C)
    if signed:
        v = torch.where(torch.rand(R, C, generator=g) < 0.5, -v, v)
    return v.to(BF).to(dev), m.to(dev)


def layouts() -> None:
    """1. kernel (K) vs torch layout (R) vs cuSPARSELt (C); W and W^T; +0 / -0 at pruned slots."""
    for R, C in ((128, 256), (256, 512)):
        for signed in (False, True):
            w, m = make(R, C, signed)
            wz = torch.where(m, w, torch.zeros_like(w))
            wt, mt = wz.t().contiguous(), m.t().contiguous()
            k = K(w, m, dtype=BF)
            t = f"{R}x{C} {'signed' if signed else 'positive'}"
            rw, rt = L.compress_reference(wz, m), L.compress_reference(wt, mt)
            diff(f"{t} W   K vs R", k.w, rw, R, C)
            diff(f"{t} W^T K vs R", k.wt, rt, C, R)
            diff(f"{t} W   R vs C", rw, cs(wz), R, C)
            diff(f"{t} W^T R vs C", rt, cs(wt), C, R)
            if signed:
                try:
                    diff(f"{t} W   C(w*mask, -0.0) vs C(where, +0)", cs(w * m), cs(wz), R, C)
                except Exception as err:  # noqa: BLE001 - a refusal is an answer too
                    say(f"{t} W   C(w*mask, -0.0) refused: {type(err).__name__}: {err}")
            if R == 128:
                diff(f"{t} W fp32-in K vs R", K(w.float(), m, dtype=BF, want_t=False).w, rw, R, C)


def mask() -> None:
    """2. the mask (COMPUTE_MASK) against the torch reference."""
    x = torch.randn(256, 512, device=dev)
    km, rm = K(x, dtype=BF, want_w=False, want_t=False).mask, mask_reference(x.abs().cpu()).to(dev)
    blocks = int((km != rm).view(64, 4, 128, 4).any(3).any(1).sum())
    say(f"mask: {blocks}/8192 blocks differ, kernel mask transposable 2:4: {is_transposable_nm(km)}")


def tiles() -> None:
    """3. the same kernel at other tiles and warp counts: a layout-dependent miscompile moves."""
    w, m = make(128, 256, True)
    wz = torch.where(m, w, torch.zeros_like(w))
    rw, rt = L.compress_reference(wz, m), L.compress_reference(wz.t().contiguous(), m.t().contiguous())
    for tile in ((4, 64), (2, 128), (1, 128)):
        k = K(w, m, dtype=BF, tile=tile)
        diff(f"tile {tile} W", k.w, rw, 128, 256)
        diff(f"tile {tile} W^T", k.wt, rt, 256, 128)
    if dev.type != "cuda":
        return
    orig = kernels._kernel
    try:
        for nw in (1, 8):

            class _NW:
                def __getitem__(self, grid, nw=nw):
                    f = orig(False)[grid]
                    return lambda *a, **kw: f(*a, **{**kw, "num_warps": nw})

            kernels._kernel = lambda interpret: _NW()
            k = K(w, m, dtype=BF)
            diff(f"num_warps {nw} W", k.w, rw, 128, 256)
            diff(f"num_warps {nw} W^T", k.wt, rt, 256, 128)
    finally:
        kernels._kernel = orig


def ops() -> None:
    """4. tl.split and tl.reshape/permute/split alone, on the old kernel's plane shape and addressing."""
    import triton
    import triton.language as tl

    @triton.jit
    def _ops(src, out_w, out_t, C, TG: tl.constexpr, TC: tl.constexpr):
        u = tl.arange(0, 2 * TG)[:, None, None]
        j = tl.arange(0, TC // 4)[None, :, None]
        h = tl.arange(0, 2)[None, None, :]
        v = tl.load(src + (16 * (u // 2) + 8 * h + 4 * (u % 2)) * C + 4 * j)
        a, b = tl.split(v)
        i2 = tl.arange(0, 2 * TG)[:, None] * (TC // 4) + tl.arange(0, TC // 4)[None, :]
        tl.store(out_w + 2 * i2, a)
        tl.store(out_w + 2 * i2 + 1, b)
        top, bot = tl.split(tl.permute(tl.reshape(v, [2 * TG, TC // 16, 2, 2, 2]), (0, 1, 3, 4, 2)))
        i4 = (
            tl.arange(0, 2 * TG)[:, None, None, None] * (TC // 4)
            + tl.arange(0, TC // 16)[None, :, None, None] * 4
            + tl.arange(0, 2)[None, None, :, None] * 2
            + tl.arange(0, 2)[None, None, None, :]
        )
        tl.store(out_t + 2 * i4, top)
        tl.store(out_t + 2 * i4 + 1, bot)

    for TC in (128, 64):
        TG = 4
        src = torch.arange(16 * TG * TC, dtype=torch.int32, device=dev).view(16 * TG, TC)
        u = torch.arange(2 * TG, device=dev)[:, None, None]
        j = torch.arange(TC // 4, device=dev)[None, :, None]
        h = torch.arange(2, device=dev)[None, None, :]
        vv = src[16 * (u // 2) + 8 * h + 4 * (u % 2), 4 * j]
        ow = torch.empty(TG * TC, dtype=torch.int32, device=dev)
        ot = torch.empty_like(ow)
        _ops[(1,)](src, ow, ot, TC, TG=TG, TC=TC, num_warps=4)
        et = vv.reshape(2 * TG, TC // 16, 2, 2, 2).permute(0, 1, 3, 4, 2).reshape(-1)
        split_ok = "ok" if torch.equal(ow, vv.reshape(-1)) else "WRONG"
        permuted_ok = "ok" if torch.equal(ot, et) else "WRONG"
        say(f"ops TC={TC}: split {split_ok}, reshape+permute+split {permuted_ok}")


def main() -> int:
    # Triton reads these when it compiles: the IR of every kernel compiled here goes to $OUT/ir
    os.environ.setdefault("TRITON_KERNEL_DUMP", "1")
    os.environ.setdefault("TRITON_DUMP_DIR", os.path.join(os.environ.get("OUT", "."), "ir"))
    say(f"device {torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu (dry run: K is R, C is R)'}")
    if dev.type == "cuda":
        from meshspeed.sparse.cslt_ops import self_check

        say(f"self_check: {self_check((128, 256), BF, dev)!r}")  # '' = fused; else names W or W^T
    for part in (layouts, mask, tiles) + ((ops,) if dev.type == "cuda" else ()):
        try:
            part()
        except Exception as err:  # noqa: BLE001 - one part failing leaves the others to say theirs
            say(f"{part.__name__}: {type(err).__name__}: {err}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
