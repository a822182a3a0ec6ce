"""What torch.compile did so far in this process, from dynamo's own records: graph breaks,
recompilations, frames compiled and graphs made. `train.compile`'s claim (blocks compile whole;
nothing recompiles once the first steps and an evaluation have run) is checked by differences
of these counts; the benchmarks print them per side."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class CompileStats:
    """graph_breaks: graphs cut short (every break dynamo records a reason for: unsupported
    calls, a Python branch on a tensor, a disabled function); unsupported: the subset dynamo
    counts in counters["graph_break"]; recompiles: compilations of code already compiled
    (a guard failed: grad mode, a shape, an object); frames: compilations of any kind;
    graphs: graphs made."""

    graph_breaks: int = 0
    unsupported: int = 0
    recompiles: int = 0
    frames: int = 0
    graphs: int = 0

    def __sub__(self, other: CompileStats) -> CompileStats:
        return CompileStats(*(a - b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    def __add__(self, other: CompileStats) -> CompileStats:
        return CompileStats(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    def line(self) -> str:
        return f"graph breaks {self.graph_breaks}, recompiles {self.recompiles}, graphs {self.graphs}"


def compile_stats() -> CompileStats:
    """The counts since the process started (or since torch._dynamo.reset / utils.counters.clear,
    which clear parts of them: take differences within one run)."""
    from torch._dynamo.utils import counters, get_compilation_metrics, graph_break_reasons

    metrics = get_compilation_metrics()
    return CompileStats(
        graph_breaks=sum(1 for r in graph_break_reasons if r.graph_break),
        unsupported=sum(counters["graph_break"].values()),
        recompiles=sum(1 for m in metrics if m.recompile_reason is not None),
        frames=counters["frames"]["total"],
        graphs=counters["stats"]["unique_graphs"],
    )
