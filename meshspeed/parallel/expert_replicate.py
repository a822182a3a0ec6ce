"""Hot experts brought to the data (`--moe.replicate_hot K`).

Under skewed routing the ep member owning a hot expert computes far more rows than the others
and every member waits for it. When a member routes many rows to an expert, the expert's
weights (3 · hidden · dim values) can be cheaper to move than those rows, and they balance the
work: the weights go to the rows instead of the rows to the weights.

- Plan (`plan`): from the [ep, E] routing counts every member already exchanges (so no extra
  collective decides anything), the K most loaded experts are candidates. Repeatedly, the
  busiest member gives away one (hot expert it owns, source member) run: the source then
  computes its own rows for that expert on a copy. Of the runs that lower the busiest member's
  load without making the source as busy, the one leaving the smaller peak is taken (ties:
  lower expert, lower source). Integers only, so every member computes the same plan. A run
  goes to a member whether or not it owns any hot expert; K past the experts that carry rows
  only adds candidates that are never taken.
- Forward: one all-to-all carries the planned experts' (w1, w2, w3) from their owners, posted
  before the token dispatch; the dispatch leaves out the copied runs; each member computes its
  copied runs with the experts' own forward (`functional_call` on the received weights) while
  the combine is in flight.
- Backward: the weights' exchange is differentiable, so each copy's gradient travels back to
  its owner and accumulates into the owner's expert gradient before the data-parallel
  reduction and the optimizer step. Every member joins that exchange, with zero rows if it
  has no copy.

Exact: the same rows meet the same weights; only the member computing them changes (a matmul
over another set of rows may round its last bit differently).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.func import functional_call

WEIGHTS = ("w1", "w2", "w3")


@dataclass
class Replicas:
    """One layer forward's plan and what it moved; every field is the same on every member."""

    entries: list[tuple[int, int, int]]  # (expert, owner, member computing its own rows on a copy)
    counts: torch.Tensor  # [ep, E] rows still dispatched: copied (member, expert) runs zeroed
    before: list[int]  # rows each member's experts compute without copies
    after: list[int]  # ... and with them (own experts' dispatched rows + copied runs)
    weight_bytes: int = 0  # expert weights sent forward (their gradients come back as many)
    rows_kept: int = 0  # routed rows that no longer cross the group

    @property
    def imbalance(self) -> tuple[float, float]:
        """max/mean rows per member, before and after."""
        return ratio(self.before), ratio(self.after)


def ratio(loads: list[int]) -> float:
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean else 1.0


def plan(all_counts: torch.Tensor, bounds: list[int], k: int) -> Replicas:
    """The copies for routing counts `all_counts` [ep, E] (row = source member, experts in the
    blocks `bounds`, expert_comm.expert_bounds), the k most loaded experts as candidates."""
    counts = all_counts.tolist()  # one host sync, as the all-to-all's splits need anyway
    ep, n_experts = len(counts), len(counts[0])
    owner = [j for j in range(ep) for _ in range(bounds[j], bounds[j + 1])]
    total = [sum(counts[s][e] for s in range(ep)) for e in range(n_experts)]
    load = [sum(total[bounds[j] : bounds[j + 1]]) for j in range(ep)]
    before = list(load)
    hot = sorted((e for e in range(n_experts) if total[e] > 0), key=lambda e: (-total[e], e))[:k]
    free = {(e, s) for e in hot for s in range(ep) if s != owner[e] and counts[s][e] > 0}
    entries = []
    while free:
        busiest = max(range(ep), key=lambda j: (load[j], -j))
        best = None
        for e, s in sorted(free):
            if owner[e] != busiest:
                continue
            rows = counts[s][e]
            peak = max(load[busiest] - rows, load[s] + rows)
            if peak < load[busiest] and (best is None or peak < best[0]):
                best = (peak, e, s)
        if best is None:  # the busiest member has nothing left to give away
            break
        _, e, s = best
        free.discard((e, s))
        load[busiest] -= counts[s][e]
        load[s] += counts[s][e]
        entries.append((e, busiest, s))
    dispatched = all_counts.clone()
    for e, _, s in entries:
        dispatched[s, e] = 0
    kept = sum(counts[s][e] for e, _, s in entries)
    return Replicas(sorted(entries), dispatched, before, load, rows_kept=kept)


def send_weights(experts, rep: Replicas, group, bounds: list[int], launch) -> tuple:
    """Post the all-to-all carrying the planned experts' weights from their owners. Returns
    (the posted exchange, (send, recv) splits, the experts copied onto this member in arrival
    order: by owner then expert, which is by expert since owners hold blocks)."""
    me = group.rank
    out = sorted((s, e) for e, o, s in rep.entries if o == me)  # by destination, then expert
    into = sorted((o, e) for e, o, s in rep.entries if s == me)  # by source, then expert
    send = [sum(1 for s, _ in out if s == j) for j in range(group.size)]
    recv = [sum(1 for o, _ in into if o == j) for j in range(group.size)]
    ws = [getattr(experts, n) for n in WEIGHTS]
    idx = torch.tensor([e - bounds[me] for _, e in out], dtype=torch.long, device=ws[0].device)
    rows = torch.cat([w.index_select(0, idx).flatten(1) for w in ws], dim=1)  # [copies out, numel]
    # every member knows every copy and all experts have one shape: the group's total
    rep.weight_bytes = len(rep.entries) * sum(w[0].numel() * w.element_size() for w in ws)
    return launch(rows, group, send, recv), (send, recv), [e for _, e in into]


def compute_copies(experts, received: torch.Tensor, n_copies: int, x: torch.Tensor, counts: torch.Tensor):
    """This member's rows on its copies: x [rows, dim] sorted by expert, counts [copies] rows per
    copy, the copies' weights the rows of `received` [copies, numel] (send_weights' layout)."""
    shapes = [getattr(experts, n).shape[1:] for n in WEIGHTS]
    parts = received.split([s.numel() for s in shapes], dim=1)
    stacked = {n: p.reshape(n_copies, *s) for n, p, s in zip(WEIGHTS, parts, shapes)}
    # the experts' own forward (loop or grouped, as on the owner) on the copies' weights
    return functional_call(experts, stacked, (x, counts))


@dataclass
class ReplicationStats:
    """A layer's copies over a step (summed over its forwards): for the metrics row."""

    forwards: int = 0
    weight_bytes: int = 0
    rows_kept: int = 0
    before: list = field(default_factory=list)  # per member, summed rows
    after: list = field(default_factory=list)

    def add(self, rep: Replicas) -> None:
        self.forwards += 1
        self.weight_bytes += rep.weight_bytes
        self.rows_kept += rep.rows_kept
        self.before = [a + b for a, b in zip(self.before, rep.before)] if self.before else list(rep.before)
        self.after = [a + b for a, b in zip(self.after, rep.after)] if self.after else list(rep.after)


def setting_problem(k: int, expert_ranks: int, capacity_factor: float, dispatcher: str, tp: int):
    """Why moe.replicate_hot=k cannot run with these settings (one line, a str), or None."""
    key = f"moe.replicate_hot={k}"
    if k < 0:
        return f"{key} must be >= 0 (0 = off; K >= 1 = copy among the K most loaded experts)"
    if not k:
        return None
    if expert_ranks < 2:
        return f"{key} needs parallel.ep >= 2: on one expert rank every expert is already with its tokens"
    if capacity_factor > 0:
        return f"{key} needs dropless routing (moe.capacity_factor=0): the owner decides capacity drops"
    if dispatcher != "alltoall":
        return f"{key} needs moe.dispatcher=alltoall (allgather already brings every token to every expert)"
    if tp > 1:
        return f"{key} needs parallel.tp=1 (copies of tp-split or token-split experts are not implemented)"
    return None


METRICS = ("moe_rows_max_mean_before", "moe_rows_max_mean_after", "moe_copy_bytes", "moe_rows_kept")


def step_metrics(layers) -> list[float]:
    """[worst layer's max/mean rows per expert member before, after, expert bytes moved (weights
    out, gradients back), rows computed on copies] over the step's forwards of `layers`, then
    reset; zeros when nothing was planned."""
    stats = [m.replication for m in layers if getattr(m, "replication", None) is not None]
    for m in layers:
        if getattr(m, "replication", None) is not None:
            m.replication = ReplicationStats()
    stats = [s for s in stats if s.forwards]
    if not stats:
        return [0.0, 0.0, 0.0, 0.0]
    return [
        max(ratio(s.before) for s in stats),
        max(ratio(s.after) for s in stats),
        float(2 * sum(s.weight_bytes for s in stats)),
        float(sum(s.rows_kept for s in stats)),
    ]
