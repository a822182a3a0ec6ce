"""Tensor-parallel plans as data: ordered (FQN pattern, style) pairs, printable, matched
against a model's module names (torchtitan's `parallelize_plan`, picotron's rules).

Matching: a pattern matches a module FQN when both have the same number of dot-separated
components and each component matches with fnmatch (`layers.*.attention.wq` matches
`layers.7.attention.wq`, not `layers.7.attention.wq.inner`). For each module, the first
entry whose pattern matches and whose style accepts the module's type wins; so one pattern
like `layers.*.feed_forward` can say "moe" and leave the dense layers to `...w1` entries.
Descendants of a module that an entry claimed are not visited. A pattern that matches
nothing is fine (a pipeline stage lacks most layers); one that matches only modules of the
wrong type is an error.

Plans and the family's own styles come from its recipe (comm/recipe.py); the built-in styles are
in tensor.py. Nothing here knows a model class.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from fnmatch import fnmatchcase

from torch import nn

from meshspeed.comm import ConfigError
from meshspeed.comm.recipe import Style


def _matches(pattern: str, fqn: str) -> bool:
    parts, names = pattern.split("."), fqn.split(".")
    return len(parts) == len(names) and all(fnmatchcase(n, p) for p, n in zip(parts, names))


class TensorPlan:
    """Ordered (pattern, style) entries. Build from a dict or a list of pairs."""

    def __init__(self, entries: Mapping[str, str] | Iterable[tuple[str, str]], styles: Mapping[str, Style]):
        items = list(entries.items()) if isinstance(entries, Mapping) else [tuple(e) for e in entries]
        for pattern, style in items:
            if style not in styles:
                raise ConfigError(
                    f"tensor-parallel plan entry {pattern!r}: style {style!r} is "
                    f"unknown; valid: {', '.join(styles)}"
                )
        self.entries: list[tuple[str, str]] = items
        self.styles = dict(styles)

    @classmethod
    def of(
        cls, plan: TensorPlan | Mapping[str, str] | Iterable[tuple[str, str]], styles: Mapping[str, Style]
    ) -> TensorPlan:
        return plan if isinstance(plan, TensorPlan) else cls(plan, styles)

    def to_dict(self) -> dict[str, str]:
        return dict(self.entries)

    def assign(self, model: nn.Module) -> list[tuple[str, str]]:
        """(module FQN, style) for every module of `model` the plan claims, in module order."""
        out: list[tuple[str, str]] = []
        claimed: list[str] = []
        matched_wrong: dict[int, tuple[str, str]] = {}
        used: set[int] = set()
        for fqn, module in model.named_modules():
            if not fqn or any(fqn.startswith(c + ".") for c in claimed):
                continue
            for i, (pattern, style) in enumerate(self.entries):
                if not _matches(pattern, fqn):
                    continue
                if isinstance(module, self.styles[style].applies_to):
                    out.append((fqn, style))
                    claimed.append(fqn)
                    used.add(i)
                    break
                matched_wrong.setdefault(i, (fqn, type(module).__name__))
        for i, (fqn, tname) in matched_wrong.items():
            if i not in used:
                pattern, style = self.entries[i]
                raise ConfigError(
                    f"tensor-parallel plan entry {pattern!r}: {style!r} needs a "
                    f"{self.styles[style].applies_to.__name__} but matched {fqn} ({tname}); point it at "
                    "the module the style applies to"
                )
        return out

    def explain(self, model: nn.Module) -> str:
        """The plan as applied to `model`: one line per claimed module."""
        rows = self.assign(model)
        width = max((len(f) for f, _ in rows), default=0)
        return "\n".join(f"{f:<{width}}  {s}" for f, s in rows)

    def __str__(self) -> str:
        width = max((len(p) for p, _ in self.entries), default=0)
        lines = ["tensor-parallel plan (first matching entry whose style fits the module wins):"]
        lines += [f"  {p:<{width}}  {s:<16} {self.styles[s].doc}" for p, s in self.entries]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"TensorPlan({self.to_dict()!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, TensorPlan) and self.entries == other.entries
