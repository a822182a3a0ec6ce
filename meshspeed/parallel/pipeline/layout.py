"""Which layers each pipeline stage holds: parse `parallel.pp_layout`, or split evenly.

Layout string: stages separated by '|', each a comma list of
    E      the embedding (first stage only, before its layers)
    t      one transformer layer;  t*8  eight of them
    L      the final norm + output head + loss (last stage only, after its layers)
e.g. "E,t*8|t*8|t*8|t*7,L". E and L may be left out; they then go to the first and last
stage. A plain list of layer counts, "8,8,8,7", means the same thing.

There are pp * vpp stages; stage s lives on rank s % pp as its chunk s // pp (Megatron's
interleaved placement, "loop"), or for a "v" placement (DualPipeV) on the rank actions.holder_of
names. Layers are numbered 0.. in stage order.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from meshspeed.parallel.pipeline.actions import ScheduleError, holder_of

KEY = "parallel.pp_layout"


@dataclass(frozen=True)
class StageLayout:
    stage: int  # virtual stage index
    rank: int
    chunk: int
    layers: tuple[int, ...]  # global transformer-layer indices held by this stage
    embedding: bool
    head: bool


_TOKEN = re.compile(r"^(?:(E)|(L)|t(?:\*(\d+))?)$", re.IGNORECASE)


def _stage_counts(spec: str) -> list[tuple[bool, int, bool]]:
    """(has E, layer count, has L) per stage, from either accepted form."""
    parts = [p.strip() for p in spec.split("|")]
    if len(parts) == 1 and re.fullmatch(r"\s*\d+(\s*,\s*\d+)*\s*", spec):
        counts = [int(x) for x in spec.split(",")]
        return [(i == 0, n, i == len(counts) - 1) for i, n in enumerate(counts)]
    stages = []
    for s, part in enumerate(parts):
        emb = head = False
        count = 0
        for tok in [t.strip() for t in part.split(",")] if part else []:
            m = _TOKEN.match(tok)
            if not m:
                raise ScheduleError(
                    f"{KEY}={spec!r}: stage {s} has token {tok!r}; use E, L, t or t*N "
                    "(e.g. 'E,t*8|t*8,L') or layer counts ('8,8')"
                )
            if m.group(1):
                if count or head or emb:
                    raise ScheduleError(
                        f"{KEY}={spec!r}: E must come first in its stage (stage {s}) and appear once"
                    )
                emb = True
            elif m.group(2):
                if head:
                    raise ScheduleError(f"{KEY}={spec!r}: L appears twice in stage {s}")
                head = True
            else:
                if head:
                    raise ScheduleError(
                        f"{KEY}={spec!r}: layers after L in stage {s}; L (norm + head + loss) ends the model"
                    )
                count += int(m.group(3)) if m.group(3) is not None else 1
        stages.append((emb, count, head))
    return stages


def parse_layout(
    spec: str, pp: int, vpp: int = 1, n_layers: int | None = None, placement: str = "loop"
) -> list[StageLayout]:
    """Parse a layout string into pp * vpp StageLayouts (see module docstring)."""
    if not spec or not spec.strip():
        raise ScheduleError(
            f"{KEY} is empty; give e.g. 'E,t*8|t*8|t*8|t*7,L' or '8,8,8,7', "
            "or leave it unset for an even split"
        )
    stages = _stage_counts(spec.strip())
    want = pp * vpp
    if len(stages) != want:
        raise ScheduleError(
            f"{KEY}={spec!r} has {len(stages)} stages but pp*vpp = {want} (pp={pp}, vpp={vpp}); "
            f"give {want} stages separated by '|'"
        )
    for s, (emb, _, head) in enumerate(stages):
        if emb and s != 0:
            raise ScheduleError(f"{KEY}={spec!r}: E (embedding) is in stage {s}; it must be in stage 0")
        if head and s != want - 1:
            raise ScheduleError(
                f"{KEY}={spec!r}: L (head + loss) is in stage {s}; it must be in the last stage ({want - 1})"
            )
    # E and L are implied on the first and last stage when the string leaves them out.
    stages = [(emb or s == 0, n, head or s == want - 1) for s, (emb, n, head) in enumerate(stages)]
    total = sum(n for _, n, _ in stages)
    if n_layers is not None and total != n_layers:
        raise ScheduleError(
            f"{KEY}={spec!r} places {total} layers but the model has n_layers={n_layers}; "
            f"make the counts sum to {n_layers} "
            f"(even split: {format_layout(even_layout(n_layers, pp, vpp)) if n_layers >= want else 'n/a'})"
        )
    return _build(stages, pp, spec, placement)


def even_layout(n_layers: int, pp: int, vpp: int = 1, placement: str = "loop") -> list[StageLayout]:
    """Split n_layers as evenly as possible over pp * vpp stages.

    The remainder goes one layer each to the stages just before the last, walking back towards
    stage 0 and never to the last stage: the last stage already carries the output head and loss
    (a vocab-sized matmul), and the first stages hold the most in-flight activations under 1F1B,
    so the middle-to-late stages take the extra. 31 layers over 4 stages: 8,8,8,7."""
    want = pp * vpp
    if pp < 1 or vpp < 1:
        raise ScheduleError(f"pipeline layout: pp={pp}, vpp={vpp}; both must be >= 1")
    if n_layers < want:
        raise ScheduleError(
            f"pipeline layout: n_layers={n_layers} cannot fill pp*vpp = {want} stages (pp={pp}, vpp={vpp}); "
            f"use fewer stages or set {KEY} explicitly (e.g. put only E or L on a stage)"
        )
    base, extra = divmod(n_layers, want)
    counts = [base] * want
    for s in range(want - 2, want - 2 - extra, -1):
        counts[s] += 1
    return _build([(s == 0, n, s == want - 1) for s, n in enumerate(counts)], pp, "even split", placement)


def _build(stages: list[tuple[bool, int, bool]], pp: int, spec: str, placement: str) -> list[StageLayout]:
    out, next_layer = [], 0
    for s, (emb, n, head) in enumerate(stages):
        if n == 0 and not emb and not head:
            raise ScheduleError(
                f"{KEY}={spec!r}: stage {s} is empty (no layers, no E or L); give it at least one layer"
            )
        rank, chunk = holder_of(s, pp, placement)
        out.append(StageLayout(s, rank, chunk, tuple(range(next_layer, next_layer + n)), emb, head))
        next_layer += n
    return out


def format_layout(stages: list[StageLayout]) -> str:
    """The layout string for `stages` (round-trips through parse_layout)."""
    parts = []
    for st in stages:
        toks = (
            (["E"] if st.embedding else [])
            + ([f"t*{len(st.layers)}"] if len(st.layers) > 1 else ["t"] if st.layers else [])
            + (["L"] if st.head else [])
        )
        parts.append(",".join(toks))
    return "|".join(parts)
