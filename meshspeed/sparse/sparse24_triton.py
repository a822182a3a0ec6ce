"""The Triton source of the fused transposable-2:4 mask + compression (kernels.py launches it;
imported only when a kernel runs, so importing meshspeed.sparse does not import Triton).

Each program reads a [16 * TG, TC] tile of W once and cuts it into 4x4 blocks, held as four
planes of [2TG, TC/8] blocks, one per (8-row half, 8-column half) of each 16x16 slab. Per block it
picks the pattern with the same float32 addition tree and tie-break as patterns.mask_reference
(so the mask is equal bit for bit), and writes the mask, W's kept values and metadata, and W^T's.
A metadata byte holds the nibbles of two rows eight apart: rows r and r + 8 of a 16-row slab for
W (the two row-half planes), columns c and c + 8 of a 16-column slab for W^T (the two
column-half planes), so each byte is an elementwise n0 | n1 << 4 of two planes' nibbles: no
split, reshape or permute (a compiled kernel's register layout never enters the byte order).
Only core tl builtins are used: the same source runs compiled and through the interpreter (CPU
tensors).
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
    # Tile: 16*TG rows x TC cols. Planes are [2TG, TC/8] blocks: u = (16-row slab, 4-row quarter of
    # its 8-row half), v = (16-col slab, 4-col quarter of its 8-col half); plane p = 2 * h + s
    # holds the blocks of 8-row half h and 8-column half s.
    row0 = tl.program_id(0) * 16 * TG
    col0 = tl.program_id(1) * TC
    u = tl.arange(0, 2 * TG)[:, None]
    v = tl.arange(0, TC // 8)[None, :]
    row_h0 = row0 + 16 * (u // 2) + 4 * (u % 2)  # first row of the block in row half 0
    col_s0 = col0 + 16 * (v // 2) + 4 * (v % 2)  # first column of the block in column half 0
    nib_w = ()  # nib_w[p][r]: W nibble (lo | hi << 2) of row r of plane p's blocks
    nib_t = ()  # nib_t[p][c]: W^T nibble of column c of plane p's blocks
    for p in tl.static_range(4):
        rowb = row_h0 + 8 * (p // 2)  # first row of the 4x4 block
        colb = col_s0 + 8 * (p % 2)  # first column of the 4x4 block
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
            pr = ()  # pr[r][i]: sum of row r's pair i, in ROW_PAIRS order
            for r in tl.static_range(4):
                pi = ()
                for i in tl.static_range(6):
                    pi = pi + (a[4 * r + _PAIRS[i][0]] + a[4 * r + _PAIRS[i][1]],)
                pr = pr + (pi,)
            s01 = ()  # (row 0 pair + row 1 pair) and (row 2 pair + row 3 pair): 36 each, all used
            s23 = ()
            for i in tl.static_range(36):
                s01 = s01 + (pr[0][i // 6] + pr[1][i % 6],)
                s23 = s23 + (pr[2][i // 6] + pr[3][i % 6],)
            best = s01[_PATTERNS[0][0] * 6 + _PATTERNS[0][1]] + s23[_PATTERNS[0][2] * 6 + _PATTERNS[0][3]]
            chosen = tl.full(best.shape, 0, tl.int32)
            for q in tl.static_range(1, 90):
                sq = s01[_PATTERNS[q][0] * 6 + _PATTERNS[q][1]] + s23[_PATTERNS[q][2] * 6 + _PATTERNS[q][3]]
                take = sq > best  # strict: ties keep the first pattern, as torch.argmax
                best = tl.where(take, sq, best)
                chosen = tl.where(take, q, chosen)
            bits = tl.load(tab_ptr + chosen)  # pattern q's kept bits, bit 4 * row + col
            for k in tl.static_range(16):
                bit = ((bits >> k) & 1) != 0
                m = m + (bit,)
                tl.store(m_at + (k // 4) * C + k % 4, bit.to(tl.uint8))
        else:
            for k in tl.static_range(16):
                m = m + (tl.load(m_at + (k // 4) * C + k % 4) != 0,)
        if DO_W:  # groups of four along W's rows
            vals_at = vals_ptr + rowb * (C // 2) + colb // 2
            nw = ()
            for r in tl.static_range(4):
                lo = tl.where(m[4 * r], 0, tl.where(m[4 * r + 1], 1, 2))
                hi = tl.where(m[4 * r + 3], 3, tl.where(m[4 * r + 2], 2, 1))
                v_lo = tl.where(lo == 0, xo[4 * r], tl.where(lo == 1, xo[4 * r + 1], xo[4 * r + 2]))
                v_hi = tl.where(hi == 3, xo[4 * r + 3], tl.where(hi == 2, xo[4 * r + 2], xo[4 * r + 1]))
                tl.store(vals_at + r * (C // 2), v_lo)
                tl.store(vals_at + r * (C // 2) + 1, v_hi)
                nw = nw + (lo | (hi << 2),)
            nib_w = nib_w + (nw,)
        if DO_T:  # groups of four down W's columns (W^T's rows)
            valst_at = valst_ptr + colb * (R // 2) + rowb // 2
            nt = ()
            for c in tl.static_range(4):
                lo = tl.where(m[c], 0, tl.where(m[4 + c], 1, 2))
                hi = tl.where(m[12 + c], 3, tl.where(m[8 + c], 2, 1))
                v_lo = tl.where(lo == 0, xo[c], tl.where(lo == 1, xo[4 + c], xo[8 + c]))
                v_hi = tl.where(hi == 3, xo[12 + c], tl.where(hi == 2, xo[8 + c], xo[4 + c]))
                tl.store(valst_at + c * (R // 2), v_lo)
                tl.store(valst_at + c * (R // 2) + 1, v_hi)
                nt = nt + (lo | (hi << 2),)
            nib_t = nib_t + (nt,)
    # metadata at cslt_layout.meta_index's offsets, addressed by the upper row of each byte's pair
    if DO_W:
        for s in tl.static_range(2):
            g = (col_s0 + 8 * s) // 4  # W group
            meta_at = meta_ptr + (row_h0 // 64) * 8 * C + ((row_h0 % 64) // 16) * 64 + (row_h0 % 8) * 8
            meta_at += (g // 8) * 256 + 2 * (g % 4) + (g % 8) // 4
            for r in tl.static_range(4):  # rows r (low nibble, plane h = 0) and r + 8 (h = 1)
                tl.store(meta_at + 8 * r, (nib_w[s][r] | (nib_w[2 + s][r] << 4)).to(tl.uint8))
    if DO_T:
        for h in tl.static_range(2):
            gt = (row_h0 + 8 * h) // 4  # W^T group = W block row
            metat_at = metat_ptr + (col_s0 // 64) * 8 * R + ((col_s0 % 64) // 16) * 64 + (col_s0 % 8) * 8
            metat_at += (gt // 8) * 256 + 2 * (gt % 4) + (gt % 8) // 4
            for c in tl.static_range(4):  # W^T rows = W columns c (plane s = 0) and c + 8 (s = 1)
                tl.store(metat_at + 8 * c, (nib_t[2 * h][c] | (nib_t[2 * h + 1][c] << 4)).to(tl.uint8))
