"""A sparse target of the trainer seen whole: the full logical weight of a tp- or ep-split
layer, gathered for a mask update and cut back to this rank's piece (train/sparsity.py)."""

from __future__ import annotations

import torch

from meshspeed.comm import ConfigError, placement


def is_split(groups: dict, sharding) -> bool:
    """Whether a tensor laid out as `sharding` is really split (some axis group has > 1 member)."""
    return sharding is not None and any(groups[d].size > 1 for d, _ in sharding.axes)


def gather_mask(mask: torch.Tensor, groups: dict, sharding) -> torch.Tensor:
    if not is_split(groups, sharding):
        return mask.clone()
    # gloo has no bool collectives: move the mask as bytes
    return placement.full_tensor(mask.to(torch.uint8), groups, sharding).bool()


class FullView:
    """A sparse target seen as its full logical weight, with the surface MaskController reads
    (name, weight[.grad], mask, nm, transposable, groups, sr_ste_lambda, set_mask).

    The full weight is gathered over tp at its first access in an update and released when the
    new mask is set, so an update holds one full weight at a time (all of them only with an
    adapter, which scores every layer first). The full mask is kept (bool, 1 byte/weight)."""

    def __init__(self, name: str, local, groups: dict, need_grad: bool):
        """groups: mesh dim -> Group for the splits a weight may have: "tp", and "ep" for the
        stacked experts under expert parallelism (every rank then sees every expert's mask)."""
        self.name, self.local, self.split_groups, self.need_grad = name, local, groups, need_grad
        p = local.weight
        self.sharding = placement.sharding_of(p)
        if self.sharding is not None and any(d not in groups for d, _ in self.sharding.axes):
            raise ConfigError(
                f"{name}: sparse training knows tensor- and expert-parallel splits only, not {self.sharding}"
            )
        self.full_shape = self.sharding.full_shape if self.sharding is not None else p.shape
        self._w: torch.Tensor | None = None
        self.mask = gather_mask(local.mask, groups, self.sharding)
        placement.tag(local.mask, self.sharding)  # checkpoints shard the mask like its weight

    @property
    def groups(self) -> int:
        return self.full_shape[0] if len(self.full_shape) > 2 else 1

    # the pattern lives on the local layer (its set_mask checks it); an elastic change sets both
    @property
    def nm(self):
        return self.local.nm

    @nm.setter
    def nm(self, value) -> None:
        self.local.nm = value

    @property
    def transposable(self) -> bool:
        return self.local.transposable

    @transposable.setter
    def transposable(self, value: bool) -> None:
        self.local.transposable = value

    @property
    def sr_ste_lambda(self) -> float:
        return self.local.sr_ste_lambda

    @sr_ste_lambda.setter
    def sr_ste_lambda(self, value: float) -> None:
        self.local.sr_ste_lambda = float(value)

    def _full(self, t: torch.Tensor) -> torch.Tensor:
        return placement.full_tensor(t, self.split_groups, self.sharding)

    @property
    def weight(self) -> torch.Tensor:
        if self._w is None:
            p = self.local.weight
            w = self._full(p).float()
            if w.data_ptr() == p.data_ptr():
                w = w.clone()  # RigL zeroes regrown entries of this copy; the real reset is ours
            if self.need_grad:
                g = getattr(p, "main_grad", None)  # bf16 parameters keep their fp32 gradient there
                g = g if g is not None else p.grad
                w.grad = None if g is None else self._full(g).float()
            self._w = w
        return self._w

    def local_piece(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's torch.chunk piece of a full-shape tensor (the split of the parameter)."""
        if not is_split(self.split_groups, self.sharding):
            return full
        out = full
        for d, p in self.sharding.axes:  # in split order: tp's piece of ep's piece, ...
            g = self.split_groups[d]
            out = placement.local_piece(out, p, g.rank, g.size)
        return out.contiguous()

    def set_mask(self, mask: torch.Tensor, *, check: bool = True) -> None:
        self.mask = mask.to(torch.bool)
        self.local.set_mask(self.local_piece(self.mask), check=check)
        self._w = None
