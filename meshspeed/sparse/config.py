"""SparsityConfig: every knob of dynamic sparse training in one typed, validated dataclass."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

PATTERNS_HELP = "'2:4', 'unstructured' or any 'N:M' with 0 < N < M (e.g. '1:4', '4:8')"
SCHEDULES = ("constant", "cosine", "cubic")
METHODS = ("magnitude", "rigl", "set", "sr-ste")
DISTRIBUTIONS = ("uniform", "erk")
ADAPTERS = ("none", "magnitude", "gradient", "sensitivity")

# SR-STE paper (Zhou et al. 2021) default decay; used when method is sr-ste and no lambda is given.
DEFAULT_SR_STE_LAMBDA = 2e-4


def parse_pattern(pattern: str) -> tuple[int, int] | None:
    """'N:M' -> (N, M); 'unstructured' -> None. Raises ValueError naming the value otherwise."""
    if pattern == "unstructured":
        return None
    match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", pattern)
    if not match:
        raise ValueError(f"sparsity.pattern={pattern!r} is not valid; use {PATTERNS_HELP}")
    n, m = int(match.group(1)), int(match.group(2))
    if not 0 < n < m:
        raise ValueError(f"sparsity.pattern={pattern!r} needs 0 < N < M; use {PATTERNS_HELP}")
    return n, m


def _bad(key: str, value, valid: str) -> ValueError:
    return ValueError(f"sparsity.{key}={value!r} is not valid; expected {valid}")


@dataclass
class SparsityConfig:
    pattern: str = "2:4"
    """'2:4', 'unstructured', or any 'N:M': keep N of every M consecutive weights along the input dim."""

    target: float | None = None
    """Global sparsity (fraction of zeros, parameter-weighted over all sparsified weights) at the end of
    the ramp. Default: 1 - N/M for N:M patterns, 0.9 for unstructured. For N:M it must not exceed
    1 - N/M; a lower value means only that parameter fraction of layers is made N:M."""

    initial: float = 0.0
    """Sparsity s_i where the cosine/cubic ramp starts (right after warmup)."""

    schedule: str = "constant"
    """How the global target evolves: 'constant' (target right after warmup), 'cosine', or 'cubic'
    (torch.ao CubicSL / Zhu & Gupta: s_t = s_f + (s_i - s_f) * (1 - (t - t0) / ramp_steps)^3)."""

    ramp_steps: int = 1000
    """Length n*dt of the cosine/cubic ramp in steps, starting at warmup_steps."""

    total_steps: int | None = None
    """Training length; needed by dense_finish_steps and to anneal the RigL drop fraction."""

    update_interval: int = 100
    """Masks are recomputed every this many steps (RigL's delta T)."""

    method: str = "magnitude"
    """'magnitude' (recompute masks from |W|), 'rigl' (drop small |W|, grow large |grad|), 'set'
    (drop small |W|, grow random), 'sr-ste' (recompute from |W| with SR-STE decay on pruned weights)."""

    layers: str = "*"
    """Glob (fnmatch) over nn.Linear fully-qualified names to sparsify, e.g. '*.mlp.*'. Prefix with
    're:' for a regular expression (matched with re.search)."""

    sr_ste_lambda: float | None = None
    """SR-STE decay: grad += lambda * (1 - mask) * W. Default 2e-4 for method 'sr-ste', else 0."""

    warmup_steps: int = 0
    """Steps trained fully dense before any mask applies."""

    dense_finish_steps: int = 0
    """Last steps of training run dense again (needs total_steps)."""

    distribution: str = "uniform"
    """Per-layer sparsity before adapters: 'uniform' (every layer at the global value) or 'erk'
    (Erdos-Renyi-Kernel, RigL paper; only meaningful for unstructured)."""

    adapter: str = "none"
    """Per-layer adapter that moves sparsity between layers within the global budget from each
    layer's own statistics: 'none', 'magnitude' (mean |W|), 'gradient' (mean |grad|), 'sensitivity'
    (mean |W * grad|, first-order Taylor saliency). Low score -> more sparsity."""

    max_layer_sparsity: float = 0.99
    """Upper clamp of any single layer's unstructured sparsity when distributing the budget."""

    drop_fraction: float = 0.3
    """RigL/SET: fraction of active weights dropped (and regrown) at an update, annealed by cosine."""

    update_end_step: int | None = None
    """RigL/SET: step where the drop fraction reaches 0. Default 0.75 * total_steps (RigL paper);
    without total_steps the drop fraction stays constant."""

    transposable: bool = True
    """For '2:4': make the mask 2:4 along both dims so the input-gradient matmul (W^T) can also
    use the sparse kernels. Costs a little kept magnitude versus a row-only 2:4 mask."""

    use_sparse_kernels: bool = True
    """Use the 2:4 sparse tensor-core kernels when the layer qualifies (CUDA sm80+, bf16/fp16)."""

    seed: int = 0
    """Seed of SET's random growth."""

    pattern_schedule: str = ""
    """Elastic N:M: 'step:N:M,...' (e.g. '0:1:4,200:2:4'), steps increasing, the first 0 with
    `pattern`. At each step the pattern changes and the masks are re-derived (phase_config gives
    the config in force). The target follows each pattern (1 - N/M) unless set, then it must fit
    every pattern. '' keeps `pattern` for the whole run."""

    def __post_init__(self) -> None:
        nm = parse_pattern(self.pattern)
        self.target_auto = self.target is None
        if self.pattern_schedule:
            self._check_pattern_schedule()
        if self.target is None:
            self.target = 1.0 - nm[0] / nm[1] if nm else 0.9
        if not 0.0 <= self.target < 1.0:
            raise _bad("target", self.target, "a sparsity in [0, 1)")
        if nm and self.target > 1.0 - nm[0] / nm[1] + 1e-9:
            raise _bad("target", self.target, f"<= {1 - nm[0] / nm[1]:g} for pattern {self.pattern}")
        if not 0.0 <= self.initial <= self.target:
            raise _bad("initial", self.initial, f"a sparsity in [0, target={self.target}]")
        if self.schedule not in SCHEDULES:
            raise _bad("schedule", self.schedule, f"one of {SCHEDULES}")
        if self.method not in METHODS:
            raise _bad("method", self.method, f"one of {METHODS}")
        if self.method in ("rigl", "set") and nm:
            raise _bad(
                "method",
                self.method,
                f"'magnitude' or 'sr-ste' with pattern {self.pattern} (rigl/set need 'unstructured')",
            )
        if self.distribution not in DISTRIBUTIONS:
            raise _bad("distribution", self.distribution, f"one of {DISTRIBUTIONS}")
        if self.distribution == "erk" and nm:
            raise _bad(
                "distribution",
                self.distribution,
                f"'uniform' with pattern {self.pattern} (ERK needs 'unstructured')",
            )
        if self.adapter not in ADAPTERS:
            raise _bad("adapter", self.adapter, f"one of {ADAPTERS}")
        for key in ("ramp_steps", "update_interval"):
            if int(getattr(self, key)) < 1:
                raise _bad(key, getattr(self, key), "an integer >= 1")
        for key in ("warmup_steps", "dense_finish_steps"):
            if int(getattr(self, key)) < 0:
                raise _bad(key, getattr(self, key), "an integer >= 0")
        if self.dense_finish_steps and self.total_steps is None:
            raise _bad("dense_finish_steps", self.dense_finish_steps, "0 unless total_steps is set")
        if self.total_steps is not None and self.total_steps <= self.warmup_steps + self.dense_finish_steps:
            raise _bad(
                "total_steps",
                self.total_steps,
                f"> warmup_steps + dense_finish_steps = {self.warmup_steps + self.dense_finish_steps}",
            )
        if self.sr_ste_lambda is None:
            self.sr_ste_lambda = DEFAULT_SR_STE_LAMBDA if self.method == "sr-ste" else 0.0
        if self.sr_ste_lambda < 0:
            raise _bad("sr_ste_lambda", self.sr_ste_lambda, "a value >= 0")
        if not 0.0 < self.max_layer_sparsity <= 1.0:
            raise _bad("max_layer_sparsity", self.max_layer_sparsity, "a value in (0, 1]")
        if not 0.0 <= self.drop_fraction < 1.0:
            raise _bad("drop_fraction", self.drop_fraction, "a fraction in [0, 1)")
        if not self.layers:
            raise _bad("layers", self.layers, "a glob such as '*' or 're:<regex>'")

    @property
    def pattern_steps(self) -> list[tuple[int, str]]:
        """[(step, 'N:M'), ...] of the pattern schedule; [(0, pattern)] without one."""
        if not self.pattern_schedule:
            return [(0, self.pattern)]
        out = []
        for item in self.pattern_schedule.split(","):
            step, _, pattern = item.strip().partition(":")
            out.append((int(step), pattern.replace(" ", "")))
        return out

    def pattern_at(self, step: int) -> str:
        """The pattern in force at `step` (after the changes at steps <= step)."""
        return [p for s, p in self.pattern_steps if s <= step][-1]

    def phase_config(self, pattern: str) -> SparsityConfig:
        """This config with `pattern` in force (the target follows the pattern unless it was set)."""
        return replace(
            self, pattern=pattern, pattern_schedule="", target=None if self.target_auto else self.target
        )

    def _check_pattern_schedule(self) -> None:
        want = "'step:N:M,...' with steps increasing from 0 and 0 < N < M, e.g. '0:1:4,200:2:4'"
        try:
            steps = self.pattern_steps
            nms = [parse_pattern(p) for _, p in steps]
        except ValueError:
            raise _bad("pattern_schedule", self.pattern_schedule, want) from None
        if steps[0][0] != 0 or any(b <= a for (a, _), (b, _) in zip(steps, steps[1:])):
            raise _bad("pattern_schedule", self.pattern_schedule, want)
        if None in nms or parse_pattern(steps[0][1]) != parse_pattern(self.pattern):
            raise _bad(
                "pattern_schedule",
                self.pattern_schedule,
                f"N:M patterns only, the first one (step 0) equal to sparsity.pattern={self.pattern!r}",
            )
        if self.target is not None:
            most = min(1 - n / m for n, m in nms)
            if self.target > most + 1e-9:
                raise _bad("target", self.target, f"<= {most:g} for every pattern of the schedule, or unset")

    @property
    def nm(self) -> tuple[int, int] | None:
        """(N, M) for N:M patterns, None for unstructured."""
        return parse_pattern(self.pattern)

    @property
    def use_transposable(self) -> bool:
        """Transposable masks exist (and matter for the kernels) only for 2:4."""
        return self.transposable and self.nm == (2, 4)
