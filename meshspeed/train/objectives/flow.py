"""Rectified-flow math (pure functions, no trainer state): the path, its target, the loss, the
timestep draws and classifier-free-guidance label dropout.

Convention (SD3, FLUX, torchtitan): t = 0 is data, t = 1 is noise,

    x_t = (1 - t)·x0 + t·ε          target velocity v = dx_t/dt = ε - x0

so a sampler integrates dx/dt = v from t = 1 down to t = 0. Every draw takes an explicit
torch.Generator: the batch's randomness comes from the layout-independent data stream, so a
sample's t, ε and label drop are the same whatever the parallel layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

T_KINDS = ("uniform", "logit_normal")


def sample_t(
    n: int,
    generator: torch.Generator | None = None,
    kind: str = "uniform",
    mean: float = 0.0,
    std: float = 1.0,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """n timesteps [n] float32 in (0, 1): 'uniform', or 'logit_normal' = sigmoid(N(mean, std))
    (SD3's choice: more weight on the middle of the path, where the velocity is hardest)."""
    if kind == "uniform":
        return torch.rand(n, generator=generator, device=device)
    if kind == "logit_normal":
        if not std > 0:
            raise ValueError(f"logit-normal t sampling needs std > 0, got std={std}")
        return torch.sigmoid(mean + std * torch.randn(n, generator=generator, device=device))
    raise ValueError(f"t sampling kind={kind!r} is invalid; choose one of {', '.join(T_KINDS)}")


def _per_sample(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """t [B] -> [B, 1, ..., 1] broadcasting over like's non-batch dims, in like's dtype."""
    return t.to(like.dtype).reshape(-1, *([1] * (like.dim() - 1)))


def noisy(x0: torch.Tensor, eps: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """x_t = (1 - t)·x0 + t·ε with t [B] per sample."""
    tt = _per_sample(t, x0)
    return (1 - tt) * x0 + tt * eps


def target(x0: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """The velocity the model regresses: ε - x0."""
    return eps - x0


def flow_loss(v_pred: torch.Tensor, x0: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """Mean squared error of the velocity, over every element (float32). A prediction with more
    channels than x0 (DiT's learn_sigma) is compared on its first x0.shape[1] channels."""
    return F.mse_loss(v_pred[:, : x0.shape[1]].float(), target(x0, eps).float())


def stratified_t(n: int = 8, device: torch.device | str = "cpu") -> torch.Tensor:
    """The n fixed validation timesteps, the midpoints (i + 0.5) / n: for n = 8, 1/16, 3/16, ...,
    15/16 (torchtitan's FLUX validator, the MLPerf FLUX.1 metric: the validation loss averaged
    over these, each sample evaluated at all of them)."""
    return (torch.arange(n, dtype=torch.float32, device=device) + 0.5) / n


def drop_labels(
    y: torch.Tensor, p: float, null_id: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Classifier-free guidance: each label replaced by `null_id` with probability p (a new
    tensor; y is not modified). p = 0 returns y unchanged without drawing."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"label dropout p={p} is invalid; use a probability in [0, 1]")
    if p == 0.0:
        return y
    drop = torch.rand(y.shape, generator=generator, device=y.device) < p
    return torch.where(drop, torch.full_like(y, null_id), y)
