"""Batches of records (conversations, preference pairs, images), independent of the layout.

A record set is a dict of tensors sharing their first dimension (`tokens`/`labels` [N, S],
`chosen_tokens` …, `images` [N, C, H, W], `labels` [N]). It is the batch-dict form of
DESIGN.md ("A batch is a dict of named tensors"): every key is sliced the same way, so one
loader serves every objective and family.

**Global batch.** The records are read in epochs, each a permutation drawn from (seed, epoch)
— without replacement inside an epoch, as TRL and the Hugging Face Trainer shuffle. Step t's
global batch is positions [t·G, (t+1)·G) of that endless stream: a pure function of (seed, t),
the same for every dp/tp/pp/cp layout and micro-batch size, and after a resume.

Every micro-batch also carries `sample_id` [micro]: each sample's position in the stream of all
steps (step·G + its row), from which per-sample randomness is seeded.

**Who gets what.** As for tokens (loader.py): dp rank r's a-th micro-batch holds global rows
[(a·dp + r)·micro, (a·dp + r + 1)·micro).

The validation loader walks the validation records in order: batch b holds records
[b·G, (b+1)·G), the same at every evaluation and for every layout (a split smaller than G is
read cyclically).
"""

from __future__ import annotations

import torch

from meshspeed.data.corpus import DataError
from meshspeed.data.loader import accumulation_steps

Batch = dict[str, torch.Tensor]


def check_records(records: Batch, what: str = "records") -> int:
    """The number of records, after checking every value is a tensor with that first dimension."""
    if not records:
        raise DataError(f"the {what} hold no fields")
    sizes = {k: (v.shape[0] if isinstance(v, torch.Tensor) and v.dim() else None) for k, v in records.items()}
    bad = [k for k, n in sizes.items() if n is None]
    if bad:
        raise DataError(f"the {what}' field {bad[0]!r} is not a tensor with a record dimension")
    if len(set(sizes.values())) != 1:
        raise DataError(f"the {what}' fields disagree on the record count: {sizes}")
    return next(iter(sizes.values()))


def take(records: Batch, rows: torch.Tensor) -> Batch:
    return {k: v[rows] for k, v in records.items()}


class _RecordBatches:
    split = "train"

    def __init__(
        self, records: Batch, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int
    ):
        self.accum_steps = accumulation_steps(global_batch_size, micro_batch_size, dp_size)
        if not 0 <= dp_rank < dp_size:
            raise DataError(f"dp_rank={dp_rank} is outside parallel.dp={dp_size}; use 0..{dp_size - 1}")
        self.records = records
        self.n = check_records(records, f"{self.split} records")
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size

    def rows(self, step: int) -> torch.Tensor:
        """Record indices of the global batch at `step`, in global order."""
        raise NotImplementedError

    def global_batch(self, step: int) -> Batch:
        """The whole global batch: the single-device reference."""
        return take(self.records, self.rows(step))

    def batches(self, step: int) -> list[Batch]:
        """This dp rank's `accum_steps` micro-batches at `step`, in accumulation order."""
        rows, m, g = self.rows(step), self.micro_batch_size, self.global_batch_size
        out = []
        for a in range(self.accum_steps):
            first = (a * self.dp_size + self.dp_rank) * m
            mb = take(self.records, rows[first : first + m])
            # each sample's place in the stream of all steps: what per-sample randomness (noise,
            # timesteps, label dropout) is seeded by, so it is the same in every layout
            mb["sample_id"] = torch.arange(step * g + first, step * g + first + m)
            out.append(mb)
        return out


class RecordLoader(_RecordBatches):
    """Training batches of records: epochs of seeded permutations (see the module docstring)."""

    def __init__(
        self,
        records: Batch,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
    ):
        super().__init__(records, global_batch_size, micro_batch_size, dp_rank, dp_size)
        self.seed = int(seed)
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            if len(self._perms) > 2:  # steps move forward: old epochs are not read again
                self._perms.pop(min(self._perms))
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms[epoch] = torch.randperm(self.n, generator=g)
        return self._perms[epoch]

    def rows(self, step: int) -> torch.Tensor:
        start = step * self.global_batch_size
        pos = torch.arange(start, start + self.global_batch_size)
        epochs = pos // self.n
        return torch.cat([self._perm(int(e))[pos[epochs == e] % self.n] for e in epochs.unique()])

    def epoch(self, step: int) -> float:
        """Epochs read after `step` steps (for the progress line)."""
        return step * self.global_batch_size / self.n


class RecordValidation(_RecordBatches):
    """Fixed validation batches: batch b holds records [b·G, (b+1)·G)."""

    split = "validation"

    def __init__(
        self,
        records: Batch,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        max_batches: int | None = None,
    ):
        super().__init__(records, global_batch_size, micro_batch_size, dp_rank, dp_size)
        # A split smaller than one global batch is read cyclically (its records repeated to fill
        # one batch): small fine-tuning sets keep a held-out figure at any batch size.
        self.num_batches = max(1, self.n // global_batch_size)
        if max_batches is not None:
            self.num_batches = max(1, min(self.num_batches, max_batches))

    def rows(self, step: int) -> torch.Tensor:
        if not 0 <= step < self.num_batches:
            raise IndexError(f"validation batch {step} is outside 0..{self.num_batches - 1}")
        g = self.global_batch_size
        return torch.arange(step * g, (step + 1) * g) % self.n
