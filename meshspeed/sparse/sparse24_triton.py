"""The Triton source of the fused transposable-2:4 mask + compression (kernels.py launches it;
imported only when a kernel runs, so importing meshspeed.sparse does not import Triton).

Each program reads a [16 * TG, TC] tile of W once (4x4 blocks as sixteen [rows, cols/4, 2]
planes), picks each block's pattern with the same float32 addition tree and tie-break as
patterns.mask_reference (so the mask is equal bit for bit), and writes the mask, W's kept values
and metadata, and W^T's: its groups of four run down W's columns, so the W^T metadata byte pairs
columns c and c + 8 of a 16-column slab (the reshape/permute below). Only core tl builtins are
used: the same source runs compiled and through the interpreter (CPU tensors).
"""

from __future__ import annotations

import triton.language as tl

from meshspeed.sparse.patterns import PATTERN_PAIRS, ROW_PAIRS

_PATTERNS = tl.constexpr(PATTERN_PAIRS)
_PAIRS = tl.constexpr(ROW_PAIRS)
_INF = tl.constexpr(float("inf"))


def sparse24_kernel(
    w_ptr, stride_w, m_ptr, tab_ptr, vals_ptr, meta_ptr, valst_ptr, metat_ptr, R, C,
    COMPUTE_MASK: tl.constexpr, DO_W: tl.constexpr, DO_T: tl.constexpr, TG: tl.constexpr, TC: tl.constexpr,
):  # fmt: skip
    # Tile: 16*TG rows x TC cols. Planes are [2TG, TC/4, 2]: u = (16-row slab, 4-row half), j = 4-col
    # group, h = which 8-row half of the 16-row slab (the two rows whose W nibbles share a byte).
    row0 = tl.program_id(0) * 16 * TG
    col0 = tl.program_id(1) * TC
    u = tl.arange(0, 2 * TG)[:, None, None]
    j = tl.arange(0, TC // 4)[None, :, None]
    h = tl.arange(0, 2)[None, None, :]
    rowb = row0 + 16 * (u // 2) + 8 * h + 4 * (u % 2)  # first row of the 4x4 block
    colb = col0 + 4 * j  # first column of the 4x4 block
    w_at = w_ptr + rowb * stride_w + colb
    m_at = m_ptr + rowb * C + colb
    x = ()
    for k in tl.static_range(16):
        x = x + (tl.load(w_at + (k // 4) * stride_w + k % 4),)
    xo = ()  # the values in the output dtype
    for k in tl.static_range(16):
        if x[k].dtype == tl.float32 and vals_ptr.dtype.element_ty == tl.bfloat16:
            # round to nearest even by hand, as torch and the GPU do: the interpreter truncates
            b = x[k].to(tl.uint32, bitcast=True)
            b = tl.where(x[k] != x[k], 0x7FC0, (b + 0x7FFF + ((b >> 16) & 1)) >> 16)
            xo = xo + (b.to(tl.uint16).to(tl.bfloat16, bitcast=True),)
        else:
            xo = xo + (x[k].to(vals_ptr.dtype.element_ty),)
    m = ()  # kept bits, index 4 * row + col within the block
    if COMPUTE_MASK:
        a = ()  # |W| in float32, NaN as +inf (patterns.py does the same)
        for k in tl.static_range(16):
            ak = tl.abs(x[k].to(tl.float32))
            a = a + (tl.where(ak != ak, _INF, ak),)
        p = ()  # p[r][i]: sum of row r's pair i, in ROW_PAIRS order
        for r in tl.static_range(4):
            pr = ()
            for i in tl.static_range(6):
                pr = pr + (a[4 * r + _PAIRS[i][0]] + a[4 * r + _PAIRS[i][1]],)
            p = p + (pr,)
        s01 = ()  # (row 0 pair + row 1 pair) and (row 2 pair + row 3 pair): 36 each, all used
        s23 = ()
        for i in tl.static_range(36):
            s01 = s01 + (p[0][i // 6] + p[1][i % 6],)
            s23 = s23 + (p[2][i // 6] + p[3][i % 6],)
        best = s01[_PATTERNS[0][0] * 6 + _PATTERNS[0][1]] + s23[_PATTERNS[0][2] * 6 + _PATTERNS[0][3]]
        chosen = tl.full(best.shape, 0, tl.int32)
        for q in tl.static_range(1, 90):
            s = s01[_PATTERNS[q][0] * 6 + _PATTERNS[q][1]] + s23[_PATTERNS[q][2] * 6 + _PATTERNS[q][3]]
            take = s > best  # strict: ties keep the first pattern, as torch.argmax
            best = tl.where(take, s, best)
            chosen = tl.where(take, q, chosen)
        bits = tl.load(tab_ptr + chosen)  # pattern q's kept bits, bit 4 * row + col
        for k in tl.static_range(16):
            bit = ((bits >> k) & 1) != 0
            m = m + (bit,)
            tl.store(m_at + (k // 4) * C + k % 4, bit.to(tl.uint8))
    else:
        for k in tl.static_range(16):
            m = m + (tl.load(m_at + (k // 4) * C + k % 4) != 0,)
    if DO_W:
        u2 = tl.arange(0, 2 * TG)[:, None]
        g = col0 // 4 + tl.arange(0, TC // 4)[None, :]
        rl = row0 + 16 * (u2 // 2) + 4 * (u2 % 2)  # row 0 of the block, upper 8-row half
        meta_at = meta_ptr + (rl // 64) * 8 * C + ((rl % 64) // 16) * 64 + (rl % 8) * 8
        meta_at += (g // 8) * 256 + 2 * (g % 4) + (g % 8) // 4
        vals_at = vals_ptr + rowb * (C // 2) + colb // 2
        for r in tl.static_range(4):
            lo = tl.where(m[4 * r], 0, tl.where(m[4 * r + 1], 1, 2))
            hi = tl.where(m[4 * r + 3], 3, tl.where(m[4 * r + 2], 2, 1))
            v_lo = tl.where(lo == 0, xo[4 * r], tl.where(lo == 1, xo[4 * r + 1], xo[4 * r + 2]))
            v_hi = tl.where(hi == 3, xo[4 * r + 3], tl.where(hi == 2, xo[4 * r + 2], xo[4 * r + 1]))
            tl.store(vals_at + r * (C // 2), v_lo)
            tl.store(vals_at + r * (C // 2) + 1, v_hi)
            n_top, n_bot = tl.split(lo | (hi << 2))  # rows r and r + 8 of the 16-row slab
            tl.store(meta_at + 8 * r, (n_top | (n_bot << 4)).to(tl.uint8))
    if DO_T:
        u4 = tl.arange(0, 2 * TG)[:, None, None, None]
        jg = tl.arange(0, TC // 16)[None, :, None, None]
        t4 = tl.arange(0, 2)[None, None, :, None]
        h4 = tl.arange(0, 2)[None, None, None, :]
        gt = (row0 + 16 * (u4 // 2) + 8 * h4 + 4 * (u4 % 2)) // 4  # W^T group = W block row
        rt = col0 + 16 * jg + 4 * t4  # W^T row = W column (c = 0, upper 8-row half)
        metat_at = metat_ptr + (rt // 64) * 8 * R + ((rt % 64) // 16) * 64 + (rt % 8) * 8
        metat_at += (gt // 8) * 256 + 2 * (gt % 4) + (gt % 8) // 4
        valst_at = valst_ptr + colb * (R // 2) + rowb // 2
        for c in tl.static_range(4):
            lo = tl.where(m[c], 0, tl.where(m[4 + c], 1, 2))
            hi = tl.where(m[12 + c], 3, tl.where(m[8 + c], 2, 1))
            v_lo = tl.where(lo == 0, xo[c], tl.where(lo == 1, xo[4 + c], xo[8 + c]))
            v_hi = tl.where(hi == 3, xo[12 + c], tl.where(hi == 2, xo[8 + c], xo[4 + c]))
            tl.store(valst_at + c * (R // 2), v_lo)
            tl.store(valst_at + c * (R // 2) + 1, v_hi)
            # W^T rows colb + c and colb + c + 8 (groups j and j + 2 of a 16-column slab) share a byte
            nib = tl.reshape(lo | (hi << 2), [2 * TG, TC // 16, 2, 2, 2])  # [u, slab, half, t, h]
            n_top, n_bot = tl.split(tl.permute(nib, (0, 1, 3, 4, 2)))
            tl.store(metat_at + 8 * c, (n_top | (n_bot << 4)).to(tl.uint8))
