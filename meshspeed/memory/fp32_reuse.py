"""fp32/bf16 parameter storage sharing (`memory.reuse_fp32_param`, MindSpeed's reuse-fp32-param).

In bf16 mixed precision a rank holds every parameter as bf16 (2 bytes, what forward and backward
read) and, for the part its optimizer updates, an fp32 master (4 bytes). The master's top 16
bits are nearly its bf16 value, so it is kept as that bf16 value, which *is* the parameter, plus
a 16-bit residual: 2 bytes per master weight less, and the same numbers.

Exactness. The plain run's parameter is hi = bf16(x), x's round-to-nearest-even, so the
residual is the integer difference d = bits(x) - bits(hi)·2^16, which lies in [-2^15, 2^15] for
every non-NaN x: 2^16 + 1 values, one more than 16 bits hold (an even hi is the rounding of both
of its two neighbouring ties). The rare d = +2^15 (x exactly halfway, rounded down to an even hi:
about one master in 2^17) is stored as -2^15 and its position is listed, so x is rebuilt bit for
bit; a NaN stays a NaN. The optimizer therefore updates the very fp32 values the plain run does
and publishes the same bf16 parameters: losses are bit-identical.

Layout, per bucket of N elements whose [lo, hi) slice (M elements: N at zero=0, N/dp at ZeRO-1/2)
this rank updates: one int16 buffer of N + M elements. Its first N are the bucket's bf16
parameter buffer (every parameter's .data is a view into it, contiguous, so the ZeRO all-gather
writes into it unchanged) and its last M the residuals of the rank's slice; the master's high
halves are the bucket's own [lo, hi). MindSpeed interleaves the halves as an int32 master and
reshuffles the buffer around each step; keeping them apart needs no reshuffle, and the update
decodes one bucket's master at a time instead (a transient of about 9 bytes per element of one
bucket's slice, freed before the next bucket's).
"""

from __future__ import annotations

import torch

from meshspeed.comm import ConfigError

_TIE = 1 << 15  # the residual 16 bits cannot hold: stored as -2^15, its positions listed


def encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 x -> (hi: bf16 round-to-nearest-even of x, lo: int16 residual, ties: int64
    positions where the residual is +2^15, stored as -2^15)."""
    hi = x.to(torch.bfloat16)
    # d = bits(x) - bits(hi)·2^16, in place: same signs and |d| <= 2^15 (non-NaN), so neither the
    # product (within [-2^31, 2^31 - 2^16]) nor the difference leaves int32
    d = hi.view(torch.int16).to(torch.int32).mul_(65536)
    torch.sub(x.view(torch.int32), d, out=d)
    tie = d == _TIE
    ties = tie.nonzero().flatten()
    lo = d.masked_fill_(tie, -_TIE).to(torch.int16)
    return hi, lo, ties


def decode(hi: torch.Tensor, lo: torch.Tensor, ties: torch.Tensor) -> torch.Tensor:
    """Inverse of encode: the fp32 values, bit for bit."""
    # x's low 16 bits are lo's pattern; its high 16 bits are hi's, less one where d < 0 (a borrow)
    borrow = lo < 0
    if ties.numel():
        borrow[ties] = False  # d = +2^15: the same pattern, no borrow
    bits = hi.view(torch.int16).to(torch.int32).sub_(borrow.to(torch.int32)).mul_(65536)
    return bits.add_(lo.to(torch.int32).bitwise_and_(0xFFFF)).view(torch.float32)


class SharedMasterShard:
    """A ZeroAdamW shard (optim._Shard's interface) whose fp32 master lives in the bucket's bf16
    parameters plus a residual in the same storage. Between open() and close() `master` is the
    decoded fp32 slice, changed in place; close() encodes it back, writing the parameters' slice
    too. Outside, reading `master` decodes a fresh copy."""

    owns_master = True
    writes_params = True  # close() writes the rounded master into the parameters' slice itself

    def __init__(self, storage: torch.Tensor, data: torch.Tensor, lo: int, hi: int, st):
        self.storage = storage  # int16 [N + M]: the bf16 bucket, then the residuals
        self.hi = data[lo:hi]  # bf16 [M]: this rank's slice of the parameters
        self.lo = storage[data.numel() :]  # int16 [M]
        self.ties = torch.empty(0, dtype=torch.int64, device=storage.device)
        self.exp_avg, self.exp_avg_sq, self.decay = st.exp_avg, st.exp_avg_sq, st.decay
        self._open: torch.Tensor | None = None
        self._store(st.master)

    @property
    def master(self) -> torch.Tensor:
        return self._open if self._open is not None else decode(self.hi, self.lo, self.ties)

    def open(self) -> None:
        if self._open is None:
            self._open = decode(self.hi, self.lo, self.ties)

    def close(self, changed: bool = True) -> None:
        if changed and self._open is not None:
            self._store(self._open)
        self._open = None

    @torch.no_grad()
    def _store(self, x: torch.Tensor) -> None:
        hi, lo, self.ties = encode(x.float())
        # The parameters' slice gets the value the optimizer's publish writes anyway (ZeRO: its
        # all-gather, maybe later with zero_prefetch), so the master decodes right at any time.
        self.hi.copy_(hi)
        self.lo.copy_(lo)

    def nbytes(self) -> int:
        """Optimizer state outside the parameters' storage: the moments and the tie list (the
        residuals are in that storage, counted with the parameters: 2·(N + M) bytes)."""
        return self.exp_avg.nbytes + self.exp_avg_sq.nbytes + self.ties.nbytes


@torch.no_grad()
def share_fp32_masters(opt) -> None:
    """Switch a freshly built ZeroAdamW (bf16 parameters, ZeRO 0/1/2) to shared storage: each
    bucket's parameter buffer is moved into a buffer with room for the residuals, the
    parameters re-pointed into it, and the separate fp32 masters freed. Call it before anything
    else holds the parameter buffers (ZeRO prefetch, sparsity)."""
    dp = opt.dp
    if dp.param_dtype != torch.bfloat16:
        raise ConfigError(
            f"memory.reuse_fp32_param=true needs bf16 parameters, not {dp.param_dtype}; "
            f"use train.dtype=bfloat16"
        )
    if dp.zero not in (0, 1, 2):
        raise ConfigError(f"memory.reuse_fp32_param=true works with ZeRO 0, 1 and 2, not zero={dp.zero}")
    for i, (b, st) in enumerate(zip(dp.buckets, opt.shards)):
        lo, hi = dp.opt_range(i)
        n = b.spec.numel
        storage = torch.empty(n + (hi - lo), dtype=torch.int16, device=b.data.device)
        data = storage[:n].view(torch.bfloat16)
        data.copy_(b.data)
        for s in b.spec.slots:
            dp.params[s.name].data = data[s.offset : s.offset + s.numel].view(s.shape)
        b.data = data
        opt.shards[i] = SharedMasterShard(storage, data, lo, hi, st)


def fp32_reuse_saved_bytes(master_weights: int) -> int:
    """Device bytes the sharing saves for `master_weights` fp32 masters (the estimate's figure;
    the tie list, ~8 bytes per 2^17 masters, is left out)."""
    return 2 * master_weights
