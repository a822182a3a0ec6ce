"""Split one backward into the input-gradient pass (B) and the weight-gradient pass (W).

Zero-bubble schedules run B as soon as the next stage's gradient arrives (the previous stage
waits for it) and defer W into what would be bubble. Both passes walk the same retained
autograd graph and nothing is computed twice:

- The graph from the roots (stage output, or loss) is walked once. A node is *weight-only*
  when everything below it leads only to this chunk's parameters (AccumulateGrad of a weight,
  through views, transposes, dtype casts, copy_to). A *boundary* is a node that is not
  weight-only but has a weight-only child: for a linear layer the matmul, whose other child
  is the activation path.
- B: `torch.autograd.grad(roots, [stage input] + boundary edges, retain_graph=True)`. The
  engine computes only what reaches those: at each matmul the activation-side product, never
  the weight-side one; the gradient flowing into each boundary is captured, not applied.
- W: `torch.autograd.backward(boundary edges, captured gradients, inputs=weights)` re-enters
  the graph at the boundaries and runs only the weight-side products, accumulating into
  `.grad` (so post-accumulate-grad hooks, i.e. data-parallel bucket reduction, fire in W).

The sum over boundaries equals the full backward's weight gradient to rounding (the same
products, accumulated in a possibly different order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd.graph import GradientEdge


@dataclass
class WeightGrad:
    """What W needs: groups of (boundary edges, gradients B captured there, weights below)."""

    groups: list
    full: tuple | None = None  # (roots, grads, params) when the graph could not be cut

    def run(self) -> None:
        for edges, grads, params in self.groups:
            pairs = [(e, g) for e, g in zip(edges, grads) if g is not None]
            if pairs and params:
                torch.autograd.backward([e for e, _ in pairs], [g for _, g in pairs], inputs=params)
        self.groups = []  # drop the graph
        if self.full is not None:  # fallback: the whole weight backward from the roots
            roots, grads, params = self.full
            torch.autograd.backward(roots, grads, inputs=params)
            self.full = None


def _walk(roots: list[torch.Tensor]) -> list:
    """Every autograd node reachable from `roots`, children before parents (iterative DFS:
    a deep model's graph is deeper than Python's recursion limit)."""
    order, seen = [], set()
    stack = [(r.grad_fn, False) for r in roots if r.grad_fn is not None]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        stack.extend(
            (child, False) for child, _ in node.next_functions if child is not None and child not in seen
        )
    return order


def weight_groups(roots: list[torch.Tensor], params: list[torch.Tensor]) -> list | None:
    """W's work for `params` in the graph of `roots`: [(boundary edges, params below them)],
    one entry per *height* (the most boundaries on a path below a boundary, itself included).
    Not one W call over all boundaries: seeded together, an upper boundary's gradient would
    flow down the activation path into a lower boundary that already holds its share,
    counting it twice. A path between two boundaries raises the height, so boundaries of one
    height cannot reach each other; when every boundary above a weight has the same height
    (a weight used once, or expert slices of a stacked weight used side by side), nothing
    flows between the members of an entry either. None when a weight sits below boundaries
    of different heights (a weight used twice in sequence): W then reruns the backward from
    the roots for the weights instead."""
    wanted = {id(p) for p in params}
    weight_only: dict = {}
    below: dict = {}  # node -> ids of the weights under its weight-only subtree
    height: dict = {}  # node -> boundaries on the longest path below it, itself included
    groups: dict[int, tuple[list, dict]] = {}
    owner: dict[int, int] = {}  # weight -> height of the boundaries above it
    for node in _walk(roots):
        var = getattr(node, "variable", None)  # AccumulateGrad nodes carry their leaf
        if var is not None:
            weight_only[node] = id(var) in wanted
            below[node] = {id(var): var} if weight_only[node] else {}
            height[node] = 0
            continue
        children = [c for c, _ in node.next_functions if c is not None]
        h = max((height[c] for c in children), default=0)
        if children and all(weight_only[c] for c in children):
            weight_only[node] = True
            below[node] = {k: v for c in children for k, v in below[c].items()}
            height[node] = h
            continue
        weight_only[node] = False
        mine = {k: v for c in children if weight_only[c] for k, v in below[c].items()}
        height[node] = h + (1 if mine else 0)
        if mine:
            if any(owner.setdefault(k, height[node]) != height[node] for k in mine):
                return None
            edges, ps = groups.setdefault(height[node], ([], {}))
            edges += [GradientEdge(node, i) for i in range(len(node._input_metadata))]
            ps.update(mine)
    # A root that depends on weights alone (e.g. a penalty on a weight) is its own boundary.
    for r in roots:
        node = r.grad_fn
        if node is not None and weight_only[node]:
            top = max(height.values(), default=0) + 1
            if any(owner.setdefault(k, top) != top for k in below[node]):
                return None
            edges, ps = groups.setdefault(top, ([], {}))
            edges.append(GradientEdge(node, r.output_nr))
            ps.update(below[node])
    return [(edges, list(ps.values())) for _, (edges, ps) in sorted(groups.items())]


def split_backward(
    roots: list[torch.Tensor],
    grads: list[torch.Tensor | None],
    inputs: list[torch.Tensor],
    params: list[torch.Tensor],
) -> tuple[list[torch.Tensor | None], WeightGrad]:
    """B: gradients of `roots` (seeded with `grads`) w.r.t. `inputs`, plus the captured state
    W needs to produce (accumulate into .grad) the gradients of `params`."""
    groups = weight_groups(roots, params)
    if groups is None:  # shared weight: B takes the input gradients, W a full weight backward
        out = (
            torch.autograd.grad(roots, inputs, grads, retain_graph=True, allow_unused=True) if inputs else []
        )
        return list(out), WeightGrad([], (roots, grads, params))
    edges = [e for es, _ in groups for e in es]
    targets = list(inputs) + edges
    if not targets:
        return [], WeightGrad([])
    out = torch.autograd.grad(roots, targets, grads, retain_graph=bool(edges), allow_unused=True)
    n, k = len(inputs), len(inputs)
    wgroups = []
    for es, ps in groups:
        wgroups.append((es, list(out[k : k + len(es)]), ps))
        k += len(es)
    return list(out[:n]), WeightGrad(wgroups)
