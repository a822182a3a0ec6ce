"""Exponential moving average of the parameters, in the parameters' own layout.

Each parameter's average is a plain tensor shaped like the parameter *as this rank holds it*
(a tensor-parallel shard, a ZeRO-3 piece, the whole tensor): the update is elementwise, so
averaging the pieces is averaging the whole, and no collective is ever needed. The average is
kept in float32 whatever the parameters' dtype (a bf16 EMA at decay 0.9999 cannot move: the
step is below bf16's resolution). The state dict holds the averages by parameter name plus the
update count, and load_state_dict restores them bit for bit.

    ema = EMA(model.named_parameters(), decay=0.9999)
    ... optimizer.step(); ema.update(model.named_parameters())
    with ema.swapped(model): evaluate(model)      # or ema.copy_to(model)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn


class EMA:
    def __init__(
        self, named_params: Iterable[tuple[str, torch.Tensor]], decay: float = 0.9999, warmup: bool = False
    ):
        """decay: weight of the old average. warmup: use min(decay, (1 + n) / (10 + n)) at update n
        (the average follows the fast-moving early weights instead of the random init)."""
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA decay={decay} is invalid; use a number in [0, 1) (DiT: 0.9999)")
        self.decay, self.warmup, self.updates = decay, warmup, 0
        self.shadow: dict[str, torch.Tensor] = {
            name: p.detach().to(torch.float32, copy=True)
            for name, p in named_params
            if not (isinstance(p, nn.Parameter) and not p.requires_grad)  # frozen parameters do not move
        }

    def current_decay(self) -> float:
        if not self.warmup:
            return self.decay
        return min(self.decay, (1 + self.updates) / (10 + self.updates))

    @torch.no_grad()
    def update(self, named_params: Iterable[tuple[str, torch.Tensor]]) -> None:
        """shadow = d·shadow + (1 - d)·param for every averaged parameter (after an optimizer step)."""
        d = self.current_decay()
        seen = 0
        for name, p in named_params:
            if name in self.shadow:
                self.shadow[name].lerp_(p.detach().float(), 1.0 - d)
                seen += 1
        if seen != len(self.shadow):
            raise RuntimeError(
                f"EMA.update saw {seen} of its {len(self.shadow)} parameters; pass the same model's "
                "named_parameters() the EMA was built from"
            )
        self.updates += 1

    def _pairs(self, model: nn.Module) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        params = dict(model.named_parameters())
        for name, avg in self.shadow.items():
            if name not in params or params[name].shape != avg.shape:
                raise RuntimeError(
                    f"EMA parameter {name} has no parameter of shape {list(avg.shape)} in the model"
                )
            yield params[name], avg

    @torch.no_grad()
    def copy_to(self, model: nn.Module) -> None:
        """Write the averages into the model's parameters (cast to their dtype)."""
        for p, avg in self._pairs(model):
            p.copy_(avg)

    @contextmanager
    def swapped(self, model: nn.Module):
        """The model holds the averages inside the block, its own weights again after it."""
        saved = {id(p): p.detach().clone() for p, _ in self._pairs(model)}
        self.copy_to(model)
        try:
            yield model
        finally:
            with torch.no_grad():
                for p, _ in self._pairs(model):
                    p.copy_(saved[id(p)])

    def state_dict(self) -> dict:
        return {
            "decay": self.decay,
            "warmup": self.warmup,
            "updates": self.updates,
            "shadow": dict(self.shadow),
        }

    def load_state_dict(self, state: dict) -> None:
        missing = set(self.shadow) ^ set(state["shadow"])
        if missing:
            raise RuntimeError(f"EMA state does not match the model's parameters: {sorted(missing)[:3]}")
        for name, avg in state["shadow"].items():
            if avg.shape != self.shadow[name].shape:
                raise RuntimeError(
                    f"EMA state {name} has shape {list(avg.shape)}, this rank holds "
                    f"{list(self.shadow[name].shape)}"
                )
            self.shadow[name].copy_(avg)
        self.decay, self.warmup, self.updates = state["decay"], state["warmup"], int(state["updates"])
