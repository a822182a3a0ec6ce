"""Mixture-of-experts feed-forward: top-k router, stacked experts, optional shared expert.

Dropless: every token reaches its k experts (no capacity factor), so the result never depends
on batch composition. Expert weights are stacked [n_experts, ...] so expert parallelism can
shard dim 0 and pass this module the local slice; nothing here assumes all experts are local
except the router, which the parallel layer wraps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshspeed import comm
from meshspeed.comm.placement import Shard, shard_parameter
from meshspeed.comm.recipe import Style

from .config import ModelConfig
from .layers import FeedForward


class TopKRouter(nn.Module):
    """Scores tokens against experts and picks the top k."""

    def __init__(
        self, dim: int, n_experts: int, top_k: int, softmax: str = "after_topk", bias_rate: float = 0.0
    ):
        super().__init__()
        self.gate = nn.Linear(dim, n_experts, bias=False)
        self.top_k = top_k
        self.softmax = softmax
        self.bias_rate = bias_rate
        # DeepSeek-V3's balancing bias [E]: chooses, never weighs. A buffer (no gradient), saved
        # with checkpoints; only present when used, so other checkpoints keep their keys.
        self.register_buffer("bias", torch.zeros(n_experts, dtype=torch.float32) if bias_rate > 0 else None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [tokens, dim] -> weights [tokens, k], expert ids [tokens, k], logits [tokens, E]."""
        # At least fp32: the softmax and z-loss are sensitive to bf16, and this matrix is tiny.
        logits = self.gate(x)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        scores = logits if self.softmax == "after_topk" else logits.softmax(dim=-1)
        if self.bias is None:
            top, experts = scores.topk(self.top_k, dim=-1)
        else:  # the bias picks the experts; the weights come from the unbiased scores
            experts = (scores + self.bias).topk(self.top_k, dim=-1).indices
            top = scores.gather(-1, experts)
        weights = top.softmax(dim=-1) if self.softmax == "after_topk" else top
        return weights, experts, logits

    @torch.no_grad()
    def update_bias(self, counts: torch.Tensor) -> None:
        """counts [E]: tokens routed to each expert over the whole step's batch (every data-parallel
        rank's, so every rank moves its bias the same way): overloaded experts' bias down by the
        rate, underloaded ones' up (DeepSeek-V3, sign rule)."""
        self.bias += self.bias_rate * torch.sign(counts.float().mean() - counts.float())


def grouped_mm_available(x: torch.Tensor, *sizes: int) -> bool:
    """Whether 'auto' should use torch._grouped_mm for activations like x.

    Where it is known to beat the loop: CUDA bf16 on Hopper or newer, and the CPU in float32 or
    bf16 (benchmarks/moe.py measured 1.2x at 8 experts to 11.7x at 64 against the loop, forward
    and backward; no host sync for the split sizes either). Every matrix size must be a multiple
    of 8: the kernel needs 16-byte aligned rows. Elsewhere, the loop.
    """
    if not hasattr(torch, "_grouped_mm") or not all(s % 8 == 0 for s in sizes):
        return False
    if x.device.type == "cpu":
        return x.dtype in (torch.float32, torch.bfloat16)
    if not x.is_cuda or x.dtype != torch.bfloat16:
        return False
    return torch.cuda.get_device_capability(x.device)[0] >= 9


class GroupedExperts(nn.Module):
    """n_experts SwiGLU MLPs with stacked weights, each laid out like nn.Linear.weight.

    w1 (gate), w3 (up): [n_experts, hidden, dim]; w2 (down): [n_experts, dim, hidden].
    """

    def __init__(self, dim: int, hidden: int, n_experts: int, impl: str = "auto", init_std: float = 0.02):
        super().__init__()
        self.impl = impl
        self.init_std = init_std
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Never leave torch.empty garbage in a directly constructed model; init_weights()
        # replaces this with the seeded, layout-independent init.
        for w in (self.w1, self.w2, self.w3):
            nn.init.normal_(w, std=self.init_std)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [tokens, dim] sorted by expert, counts [n_experts] -> [tokens, dim]."""
        n_experts, hidden, dim = self.w1.shape
        use_grouped = self.impl == "grouped_mm" or (
            self.impl == "auto" and grouped_mm_available(x, dim, hidden)
        )
        if use_grouped:
            if not hasattr(torch, "_grouped_mm"):
                raise RuntimeError(
                    f"moe_impl='grouped_mm' but torch {torch.__version__} has no "
                    "torch._grouped_mm; use moe_impl='auto' or 'loop'"
                )
            return self._grouped(x, counts)
        return self._loop(x, counts)

    def _grouped(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # offs are cumulative group ends, kept on the device: no host sync, unlike the loop.
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        w1, w2, w3 = (w.to(x.dtype) for w in (self.w1, self.w2, self.w3))
        # The kernel wants B column-major: the transposed nn.Linear layout is exactly that.
        h = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs))
        h = h * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs)  # [tokens, hidden]
        return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)

    def _loop(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (w.to(x.dtype) for w in (self.w1, self.w2, self.w3))
        out = []
        for e, chunk in enumerate(torch.split(x, counts.tolist())):  # one host sync per layer
            h = F.silu(chunk @ w1[e].t()) * (chunk @ w3[e].t())  # [tokens_e, hidden]
            out.append(h @ w2[e].t())
        return torch.cat(out)


class MoE(nn.Module):
    """Routed SwiGLU experts plus optional always-on shared expert(s).

    After each forward the layer holds, from that forward: `load_balance_loss`, `z_loss`
    (both with gradients to the router) and `tokens_per_expert` (detached counts for metrics).
    `aux_loss()` weights the two losses by their coefficients. With gradient accumulation or
    pipelining, read `aux_loss()` after every micro-batch forward: the next one overwrites it.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        hidden = config.moe_ffn_dim
        self.n_experts = config.n_experts
        self.top_k = config.top_k
        self.aux_loss_coef = config.aux_loss_coef
        self.z_loss_coef = config.z_loss_coef
        self.router = TopKRouter(
            config.dim, config.n_experts, config.top_k, config.router_softmax, config.router_bias_rate
        )
        self.experts = GroupedExperts(config.dim, hidden, config.n_experts, config.moe_impl, config.init_std)
        # Several shared experts are one wider SwiGLU: same function, one matmul each (DeepSeek).
        self.shared_expert = (
            FeedForward(config.dim, config.n_shared_experts * hidden) if config.n_shared_experts else None
        )
        self.load_balance_loss: torch.Tensor | None = None
        self.z_loss: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None
        self.step_counts: torch.Tensor | None = None  # [E] summed over this step's training forwards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [tokens, dim]
        weights, experts, logits = self.router(x)
        counts = torch.bincount(experts.flatten(), minlength=self.n_experts)  # [n_experts]
        self._record_router(logits, counts)
        out = self.routed(x, weights, experts, counts)
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return out.view(shape)

    def routed(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        """x [tokens, dim], weights/experts [tokens, k], counts [E] -> [tokens, dim]."""
        n_tokens, k = experts.shape
        # Sort the tokens*k (token, expert) slots by expert so each expert sees one contiguous run;
        # a stable sort keeps token order inside a run, so results are reproducible.
        order = experts.flatten().argsort(stable=True)  # [tokens*k]
        y_sorted = self.experts(x[order // k], counts)  # [tokens*k, dim]
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        y = y_sorted[inverse].view(n_tokens, k, -1)  # back to [tokens, k, dim]
        # Summing over k (rather than index_add into tokens) is deterministic on every backend.
        return (y * weights.unsqueeze(-1).to(y.dtype)).sum(dim=1)

    def _record_router(self, logits: torch.Tensor, counts: torch.Tensor) -> None:
        n_tokens = logits.shape[0]
        probs = logits.softmax(dim=-1)  # [tokens, E], over all experts whatever router_softmax is
        # Switch/GShard: f_e = share of routed slots (no gradient), P_e = mean router prob.
        # Equals 1 when perfectly balanced. (Hugging Face's Mixtral loss is top_k times this.)
        f = counts.to(probs.dtype) / max(n_tokens * self.top_k, 1)
        self.load_balance_loss = self.n_experts * (f * probs.mean(dim=0)).sum()
        self.z_loss = torch.logsumexp(logits, dim=-1).pow(2).mean()
        self.tokens_per_expert = counts.detach()
        if torch.is_grad_enabled():  # training forwards only (a recompute counts again: the sign
            # rule of update_bias is blind to a uniform factor, and every micro-batch gets it)
            c = counts.detach()
            self.step_counts = c if self.step_counts is None else self.step_counts + c

    def aux_loss(self) -> torch.Tensor | None:
        """aux_loss_coef * load_balance + z_loss_coef * z from the last forward; None before one."""
        if self.load_balance_loss is None:
            return None
        return self.aux_loss_coef * self.load_balance_loss + self.z_loss_coef * self.z_loss


# --- recipe part: this layer's tensor-parallel style ("moe" in llama.py's plan) ---------------


def _tp_piece(module: nn.Module, name: str, dim: int, group) -> None:
    setattr(module, name, shard_parameter(getattr(module, name), "tp", Shard(dim), group))
    if isinstance(module, nn.Linear):  # keep the Linear's own description true
        module.out_features, module.in_features = module.weight.shape


class TensorParallelMoE(MoE):
    """MoE with each expert's hidden width (and the shared expert's) split over tp.

    Every rank routes all tokens with the replicated router (so routing, aux losses and
    tokens_per_expert equal the single-device ones), runs its hidden slice of every expert,
    and one reduce (reduce_from, or reduce_scatter_sp) sums the experts' partial outputs.
    Gradients: the routed and shared experts' input goes through copy_to (partial input
    gradients summed); the combine weights go through copy_to (each rank's output is partial,
    so its weight gradient is too); the router input itself is not summed (its gradient is
    already complete on every rank). Expert parallelism (experts split over ranks) is separate.
    """

    def __init__(self, moe: MoE, group, sequence_parallel: bool = False):
        nn.Module.__init__(self)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.n_experts, self.top_k = moe.n_experts, moe.top_k
        self.aux_loss_coef, self.z_loss_coef = moe.aux_loss_coef, moe.z_loss_coef
        self.router = moe.router
        self.experts = moe.experts
        for name, dim in (("w1", 1), ("w3", 1), ("w2", 2)):  # [E, hidden, dim] / [E, dim, hidden]
            _tp_piece(self.experts, name, dim, group)
        self.shared_expert = moe.shared_expert
        if self.shared_expert is not None:  # plain linears on pieces: this layer does the reduce
            for name, dim in (("w1", 0), ("w3", 0), ("w2", 1)):
                _tp_piece(getattr(self.shared_expert, name), "weight", dim, group)
        self.load_balance_loss = self.z_loss = self.tokens_per_expert = self.step_counts = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:  # [batch, seq/tp, dim] -> all tokens [batch, seq, dim]
            x = comm.gather_from(x, self.group, 1)
        shape = x.shape
        xr = x.reshape(-1, shape[-1])  # [tokens, dim], replicated
        weights, experts, logits = self.router(xr)
        counts = torch.bincount(experts.flatten(), minlength=self.n_experts)  # [n_experts]
        self._record_router(logits, counts)
        xe = comm.copy_to(xr, self.group)
        out = self.routed(xe, comm.copy_to(weights, self.group), experts, counts)  # partial
        if self.shared_expert is not None:
            out = out + self.shared_expert(xe)
        out = out.view(shape)
        if self.sequence_parallel:
            return comm.reduce_scatter_sp(out, self.group, 1)
        return comm.reduce_from(out, self.group)


MOE_TP_STYLE = Style(
    MoE,
    "router replicated; each expert's (and the shared expert's) hidden dim split",
    lambda m, g, sp: TensorParallelMoE(m, g, sp),
)
