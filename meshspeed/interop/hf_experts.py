"""Expert parallelism for a `transformers` MixtralForCausalLM under `meshspeed.parallelize`.

Hugging Face keeps a layer's experts as one module of stacked weights (`mlp.experts`:
gate_up_proj [E, 2I, H], down_proj [E, H, I]) called as experts(x, top_k_index, top_k_weights)
by the sparse MoE block after its router. That call is the seam: each such module is swapped for
ExpertParallelExperts, which holds this ep member's block of experts (Shard(0) over "ep", the
parameter names unchanged, so state_dict keys, gather_for_save and save_pretrained's conversion
to per-expert files stay Hugging Face's) and runs the same computation over the ep group:

  sort the slots by expert -> exchange counts -> all-to-all (uneven splits) -> this member's
  experts on their runs -> all-to-all back -> un-sort -> weight by the router and sum over top-k.

The router, the block and everything else stay the user's modules (so `output_router_logits`
and the balancing loss work as in transformers). Dropless, like Hugging Face. The exchange
primitives are meshspeed's own expert parallelism's (parallel/expert_comm.py); gradient
reduction of the split weights over the expert-data-parallel group is DataParallel's (expert
buckets, parallel/data.py), as for meshspeed's own MoE models.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshspeed.comm.placement import Shard, shard_parameter
from meshspeed.models.moe import grouped_mm_available
from meshspeed.parallel import expert_comm as xc

EXPERT_CLASSES = ("MixtralExperts",)  # stacked-weight expert modules this swap understands

__all__ = ["EXPERT_CLASSES", "ExpertParallelExperts", "expert_modules", "split_experts"]


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every Hugging Face stacked-expert module in `model`."""
    return [(n, m) for n, m in model.named_modules() if type(m).__name__ in EXPERT_CLASSES]


class ExpertParallelExperts(nn.Module):
    """A MixtralExperts split over an ep group: same call, same outputs, and (after the
    data-parallel reduction) the same gradients as the whole module on the ep group's tokens."""

    def __init__(self, experts: nn.Module, group, impl: str = "auto"):
        super().__init__()
        self.group, self.n_experts, self.act_fn = group, experts.num_experts, experts.act_fn
        # "auto": torch._grouped_mm where meshspeed's own experts measured it faster than a loop
        # over experts (models/moe.py: CUDA bf16 on Hopper, the CPU), else the loop; "loop":
        # always Hugging Face's loop over experts
        if impl not in ("auto", "loop"):
            raise ValueError(f"expert impl={impl!r} is not known; valid: 'auto', 'loop'")
        self.impl = impl
        # an ep that leaves a member without experts is shard_tensor's one-line error
        self.gate_up_proj = shard_parameter(experts.gate_up_proj, "ep", Shard(0), group)
        self.down_proj = shard_parameter(experts.down_proj, "ep", Shard(0), group)
        self.bounds = xc.expert_bounds(self.n_experts, group.size)

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        n_tokens, k = top_k_index.shape
        flat = top_k_index.flatten()
        order = flat.argsort(stable=True)  # slots by expert: grouped by destination member too
        counts = torch.bincount(flat, minlength=self.n_experts)
        send, recv, runs = xc.splits(xc.exchange_counts(counts, self.group), self.bounds, self.group.rank)
        received = xc.dispatch(x[order // k], self.group, send, recv)  # source-major
        perm = xc.source_to_expert_order(runs)  # -> one contiguous run per local expert
        y = self._local(received[perm], runs.sum(0))[perm.argsort()]
        y = xc.combine(y, self.group, send, recv)[order.argsort()]  # back in slot order
        y = y.view(n_tokens, k, -1) * top_k_weights.unsqueeze(-1).to(y.dtype)
        return y.sum(dim=1)

    def _local(self, rows: torch.Tensor, runs: torch.Tensor) -> torch.Tensor:
        """This member's experts on their contiguous runs of rows (Hugging Face's expert math).
        An empty run still uses its weights, so every expert gets a (zero) gradient."""
        two_i, h = self.gate_up_proj.shape[1:]
        if self.impl == "auto" and grouped_mm_available(rows, h, two_i, two_i // 2):
            offs = torch.cumsum(runs, 0, dtype=torch.int32)  # run ends, on the device
            gate, up = torch._grouped_mm(rows, self.gate_up_proj.transpose(-2, -1), offs=offs).chunk(2, -1)
            return torch._grouped_mm(self.act_fn(gate) * up, self.down_proj.transpose(-2, -1), offs=offs)
        out, start = [], 0
        for e, n in enumerate(runs.tolist()):
            gate, up = F.linear(rows[start : start + n], self.gate_up_proj[e]).chunk(2, dim=-1)
            out.append(F.linear(self.act_fn(gate) * up, self.down_proj[e]))
            start += n
        return torch.cat(out)


def split_experts(model: nn.Module, group, impl: str = "auto") -> int:
    """Swap every stacked-expert module of `model` for its ExpertParallelExperts over `group`,
    in place; returns how many were swapped."""
    found = expert_modules(model)
    for name, m in found:
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, ExpertParallelExperts(m, group, impl))
    return len(found)
