"""Rectified flow: the math (pure functions: the path, its target, the loss, the timestep draws,
classifier-free-guidance label dropout) and the trainer's objective built on it (`Flow`).

Convention (SD3, FLUX, torchtitan): t = 0 is data, t = 1 is noise,

    x_t = (1 - t)·x0 + t·ε          target velocity v = dx_t/dt = ε - x0

so a sampler integrates dx/dt = v from t = 1 down to t = 0. Every draw takes an explicit
torch.Generator: the batch's randomness comes from the layout-independent data stream, so a
sample's t, ε and label drop are the same whatever the parallel layout.
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F

from meshspeed.train.objectives import Batch, Objective, Scorer

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


# --- the objective the trainer runs (train.objective=flow) -------------------------------------

VAL_SALT = 0x5EED_0F_7A1  # validation noise: its own stream, never a training sample's


def sample_seed(seed: int, sample_id: int, salt: int = 0) -> int:
    """A 63-bit generator seed from (run seed, sample position, salt), hashed so that nearby
    (seed, id) pairs do not share streams as a sum would."""
    digest = hashlib.blake2b(f"{seed}:{sample_id}:{salt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class Flow(Objective):
    """Rectified flow (module docstring): model(x_t, t, y) regresses v = ε − x0, MSE.

    Training: each sample's ε, t and label drop come from a generator seeded by (train.seed,
    sample_id), its position in the stream of all steps, so every layout (dp, ZeRO, tp, micro-
    batch size) and a resumed run draw the same numbers for the same sample. Validation: every
    sample at the 8 stratified timesteps with one fixed ε per sample (the torchtitan / MLPerf
    FLUX.1 metric), its label kept; the mean over them is the validation loss.

    Every micro-batch holds as many samples of the same shape, so the mean of micro-batch means
    over the step and the dp ranks is the global batch's mean (the trainer's contract)."""

    name = "flow"
    token_rows = False

    def __init__(
        self,
        seed: int = 0,
        t_sampling: str = "logit_normal",
        t_mean: float = 0.0,
        t_std: float = 1.0,
        label_dropout: float = 0.1,
        n_classes: int = 0,
        image_tokens: int | None = None,
        val_timesteps: int = 8,
    ):
        self.seed, self.kind, self.mean, self.std = int(seed), t_sampling, t_mean, t_std
        self.p, self.n_classes, self.val_t = label_dropout, n_classes, val_timesteps
        self.tokens_per_row = image_tokens  # tokens/s counts image tokens (MFU's flops are per one)

    def _train_rows(self, x0: torch.Tensor, y: torch.Tensor, ids: torch.Tensor) -> Batch:
        eps, t, ys = torch.empty_like(x0), torch.empty(x0.shape[0]), y.clone()
        g = torch.Generator()
        for j, i in enumerate(ids.tolist()):
            g.manual_seed(sample_seed(self.seed, i))
            # draw order fixed (ε, t, drop): changing it changes every run's numbers
            eps[j] = torch.randn(x0.shape[1:], generator=g)
            t[j] = sample_t(1, g, self.kind, self.mean, self.std)[0]
            if self.n_classes:
                ys[j : j + 1] = drop_labels(ys[j : j + 1], self.p, self.n_classes, g)
        return {"x0": x0, "eps": eps, "t": t, "y": ys}

    def _val_rows(self, x0: torch.Tensor, y: torch.Tensor, ids: torch.Tensor) -> Batch:
        n, k = x0.shape[0], self.val_t
        eps = torch.empty_like(x0)
        g = torch.Generator()
        for j, i in enumerate(ids.tolist()):
            g.manual_seed(sample_seed(self.seed, i, VAL_SALT))
            eps[j] = torch.randn(x0.shape[1:], generator=g)
        # [k·n] rows, timestep-major: rows [s·n, (s+1)·n) are every sample at stratified t_s
        t = stratified_t(k).repeat_interleave(n)
        rep = (k,) + (1,) * (x0.dim() - 1)
        return {"x0": x0.repeat(rep), "eps": eps.repeat(rep), "t": t, "y": y.repeat(k)}

    def rows(self, batch: Batch) -> Batch:
        x0 = batch["images"].float()
        y = batch["labels"].long() if "labels" in batch else torch.full((x0.shape[0],), -1)
        if self.n_classes:  # unlabelled images (-1) train the unconditional branch
            y = torch.where(y < 0, torch.full_like(y, self.n_classes), y)
        ids = batch["sample_id"]
        rows = self._train_rows(x0, y, ids) if self.training else self._val_rows(x0, y, ids)
        rows["x_t"] = noisy(rows["x0"], rows["eps"], rows["t"])
        return rows

    def forward(self, model, item: Batch) -> torch.Tensor:
        """The velocity [B, C, H, W] (a learn_sigma model's variance channels cut off)."""
        y = item["y"] if self.n_classes else None
        return model(item["x_t"], item["t"], y)[:, : item["x0"].shape[1]]

    def loss(self, forward, rows: Batch, batch: Batch, scorer: Scorer):
        return flow_loss(forward(), rows["x0"], rows["eps"]), None


def make_flow(cfg, model_config) -> Flow:
    """The flow objective of cfg's [flow] settings for a 'dit' model config."""
    from meshspeed.models.dit_config import n_tokens

    f = cfg.flow
    n_classes = model_config.n_classes if model_config is not None else 0
    tokens = n_tokens(model_config) if model_config is not None else None
    return Flow(cfg.train.seed, f.t_sampling, f.t_mean, f.t_std, f.label_dropout, n_classes, tokens)
