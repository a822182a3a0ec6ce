"""Which collective algorithm each side of a benchmark used, and runs under both link-parameter
sets (issue 45: a saved `meshspeed bench comm` fit once made tp 1.4× slower, and no benchmark
said which algorithms it had run).

- `used(ctx, fn)`: run `fn` (one training step) and return meshspeed's collectives it issued,
  per group kind and op, with the algorithms they ran — read from the flight recorder, so it
  costs the step nothing. Peers call torch.distributed directly: always the backend's own.
- `param_sets()`: the link-parameter settings to run a benchmark under — the saved file (when
  one exists and would be used) and the built-in defaults, so a calibration that makes a run
  slower shows up as two tables side by side.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re

from meshspeed.comm import cost_model


def _kind(group_name: str) -> str:
    """"tp[0,1]" / "dp_cp[2,3]" / "world" -> "tp" / "dp_cp" / "world"."""
    return re.split(r"[\[(]", group_name, maxsplit=1)[0]


def used(ctx, fn) -> dict[str, str]:
    """{"tp all_gather": "ring", "dp reduce_scatter": "native,ring", ...} for one call of fn."""
    mark = ctx.recorder.mark()
    fn()
    seen: dict[str, collections.Counter] = {}
    for e in ctx.recorder.since(mark):
        seen.setdefault(f"{_kind(e['group'])} {e['op']}", collections.Counter())[e["algo"]] += 1
    return {k: ",".join(f"{a}×{n}" for a, n in sorted(c.items())) for k, c in sorted(seen.items())}


def describe(algos: dict[str, str]) -> str:
    return "; ".join(f"{k}: {v}" for k, v in algos.items()) or "no meshspeed collectives"


def param_sets() -> list[tuple[str, str]]:
    """[(label, MESHSPEED_LINK_PARAMS value)]: the saved file first when it would be used here
    (it exists and was measured on this machine), then the built-in defaults."""
    path = cost_model.params_path()
    if path.lower() != "none" and os.path.exists(path):
        saved = cost_model.load("gloo")
        if saved.path:
            return [(f"saved link parameters ({path})", path), ("built-in defaults", "none")]
        print(f"note: {saved.note}")
    return [("built-in defaults" if path.lower() == "none" else "link parameters: built-in", "none")]


@contextlib.contextmanager
def link_params(value: str):
    """MESHSPEED_LINK_PARAMS=value for the workers spawned inside (they inherit the env)."""
    old = os.environ.get("MESHSPEED_LINK_PARAMS")
    os.environ["MESHSPEED_LINK_PARAMS"] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("MESHSPEED_LINK_PARAMS", None)
        else:
            os.environ["MESHSPEED_LINK_PARAMS"] = old
