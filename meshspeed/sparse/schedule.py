"""Global sparsity schedule: a pure function of the step, printable as data.

step < warmup                          -> 0 (dense)
warmup <= step < warmup + ramp         -> ramp from `initial` to `target` (constant: target at once)
step >= total_steps - dense_finish     -> 0 (dense finish)
otherwise                              -> target
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshspeed.sparse.config import SparsityConfig


@dataclass(frozen=True)
class SparsitySchedule:
    target: float
    kind: str = "constant"
    initial: float = 0.0
    warmup_steps: int = 0
    ramp_steps: int = 1
    total_steps: int | None = None
    dense_finish_steps: int = 0

    @classmethod
    def from_config(cls, config: SparsityConfig) -> SparsitySchedule:
        return cls(
            target=float(config.target),
            kind=config.schedule,
            initial=config.initial,
            warmup_steps=config.warmup_steps,
            ramp_steps=config.ramp_steps,
            total_steps=config.total_steps,
            dense_finish_steps=config.dense_finish_steps,
        )

    def phase(self, step: int) -> str:
        """'warmup', 'ramp', 'sparse' or 'dense-finish'."""
        if (
            self.total_steps is not None
            and self.dense_finish_steps
            and step >= self.total_steps - self.dense_finish_steps
        ):
            return "dense-finish"
        if step < self.warmup_steps:
            return "warmup"
        if self.kind != "constant" and step < self.warmup_steps + self.ramp_steps:
            return "ramp"
        return "sparse"

    def progress(self, step: int) -> float:
        """Fraction of the ramp done, clipped to [0, 1]."""
        return min(max((step - self.warmup_steps) / self.ramp_steps, 0.0), 1.0)

    def __call__(self, step: int) -> float:
        phase = self.phase(step)
        if phase in ("warmup", "dense-finish"):
            return 0.0
        if phase == "sparse":
            return self.target
        p = self.progress(step)
        if self.kind == "cubic":
            # torch.ao CubicSL / Zhu & Gupta 2017: fast pruning early, slow near the target
            return self.target + (self.initial - self.target) * (1.0 - p) ** 3
        # cosine: half-period from initial to target
        return self.target + (self.initial - self.target) * 0.5 * (1.0 + math.cos(math.pi * p))

    def table(self, steps: list[int]) -> str:
        """A printable step -> sparsity table (schedules are data)."""
        lines = [f"{'step':>8} {'phase':>12} {'sparsity':>9}"]
        lines += [f"{s:>8} {self.phase(s):>12} {self(s):>9.4f}" for s in steps]
        return "\n".join(lines)


def cosine_anneal(value: float, step: int, start: int, end: int | None) -> float:
    """RigL drop-fraction decay: value/2 * (1 + cos(pi * (step - start) / (end - start))); 0 after end."""
    if end is None or end <= start:
        return value
    p = min(max((step - start) / (end - start), 0.0), 1.0)
    return 0.5 * value * (1.0 + math.cos(math.pi * p))
