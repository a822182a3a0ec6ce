"""Sampling a rectified-flow model: ODE integration of dx/dt = v(x, t, y) from noise (t = 1)
to data (t = 0), with classifier-free guidance, per-image seeds and dp over the request.

The model is any module `model(x [B,C,H,W], t [B] float in [0,1], y [B] long) -> v [B,C,H,W]`
trained on x_t = (1 − t)·x0 + t·ε with target v = ε − x0; the class id `null_class` (the
model's n_classes) is the "no label" its training dropped labels to, the unconditional branch
of guidance.

Seeds: image i of a request starts from noise drawn on the CPU by a generator seeded from
(seed, i) alone, so the same seeds give the same images whatever the dp split, the batch size
or the device the steps run on (the rest of the computation is row-independent: no op mixes
images of a batch).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from meshspeed import comm
from meshspeed.comm.algorithms import bounds
from meshspeed.comm.errors import ConfigError

SAMPLERS = ("euler", "heun")


@dataclass
class SampleStats:
    """Counters for the images/s line; rank-local (a dp replica times its own share)."""

    images: int = 0
    evals: int = 0  # model forwards, a guided pair counting once (one batched call)
    seconds: float = 0.0
    per_rank: list[float] = field(default_factory=list)  # every replica's seconds (rank 0)

    def line(self, total: int | None = None) -> str:
        n = self.images if total is None else total
        wall = max(self.per_rank) if self.per_rank else self.seconds
        return f"{n} images in {wall:.2f} s: {n / max(wall, 1e-9):.1f} images/s"


def check_sampling(steps: int, sampler: str, guidance: float) -> None:
    """One ConfigError line for a setting no sampler can use (called before any worker starts)."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"--steps={steps!r} must be an integer ≥ 1, e.g. 32")
    if sampler not in SAMPLERS:
        raise ConfigError(f"--sampler={sampler!r} is not valid; choose one of {', '.join(SAMPLERS)}")
    if not (isinstance(guidance, (int, float)) and guidance == guidance and abs(guidance) < float("inf")):
        raise ConfigError(f"--guidance={guidance!r} must be a finite number (1 = no guidance, e.g. 2.0)")


def image_seed(seed: int, index: int) -> int:
    """A 63-bit seed for image `index` of a request made with `seed`: hashed, so (seed, i) and
    (seed + 1, i − 1) do not share noise as a sum would."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def image_noise(shape: tuple[int, int, int], seed: int, rows) -> torch.Tensor:
    """[len(rows), C, H, W] standard normal noise, row j from image_seed(seed, rows[j]); drawn
    on the CPU in float32 (the same bits on every device and dtype), moved by the caller."""
    out = torch.empty(len(rows), *shape)
    g = torch.Generator()
    for j, i in enumerate(rows):
        g.manual_seed(image_seed(seed, int(i)))
        out[j] = torch.randn(shape, generator=g)
    return out


def guided_velocity(
    model: nn.Module, x: torch.Tensor, t: float, y: torch.Tensor, guidance: float, null_class: int | None
) -> torch.Tensor:
    """v = v_u + s·(v_c − v_u), conditional and unconditional rows in one forward of 2B rows.
    s = 1 is the conditional model alone (one forward of B rows); no null class: no guidance."""
    tt = torch.full((x.shape[0],), t, dtype=x.dtype, device=x.device)
    c = x.shape[1]
    if guidance == 1 or null_class is None:
        return model(x, tt, y)[:, :c]
    null = torch.full_like(y, null_class)
    # [:, :c]: a learn_sigma model (DiT's checkpoints) adds variance channels the flow ignores
    v = model(torch.cat([x, x]), torch.cat([tt, tt]), torch.cat([y, null]))[:, :c]
    v_cond, v_uncond = v.chunk(2)
    return v_uncond + guidance * (v_cond - v_uncond)


@torch.no_grad()
def sample(
    model: nn.Module,
    labels: torch.Tensor,
    shape: tuple[int, int, int],
    *,
    steps: int = 32,
    sampler: str = "euler",
    guidance: float = 1.0,
    seed: int = 0,
    rows=None,
    null_class: int | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    stats: SampleStats | None = None,
) -> torch.Tensor:
    """[B, C, H, W] float32 samples (about [-1, 1]) for class ids `labels` [B].

    Integrates dx/dt = v from t = 1 to t = 0 over `steps` equal steps: Euler (one model
    evaluation per step) or Heun (Euler's predictor, then the trapezoid of the velocities at
    both ends: two evaluations, second-order). `rows`: the images' indices in the whole request
    (their seeds; default 0..B−1)."""
    check_sampling(steps, sampler, guidance)
    b = labels.shape[0]
    rows = range(b) if rows is None else rows
    if len(rows) != b:
        raise ConfigError(f"sample: {len(rows)} row indices for {b} labels; give one per image")
    if device is None:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
    start = time.perf_counter()
    x = image_noise(shape, seed, rows).to(device=device, dtype=dtype)  # [B, C, H, W] at t = 1
    y = labels.to(device=device, dtype=torch.long)
    # t_k = 1 − k/steps, computed from k (not by repeated subtraction) so every rank's grid is
    # the same floats
    ts = [1.0 - k / steps for k in range(steps + 1)]
    evals = 0
    for k in range(steps):
        t0, t1 = ts[k], ts[k + 1]
        dt = t1 - t0  # negative: time runs from noise to data
        v0 = guided_velocity(model, x, t0, y, guidance, null_class)
        evals += 1
        if sampler == "euler":
            x = x + dt * v0
        else:
            x_pred = x + dt * v0
            v1 = guided_velocity(model, x_pred, t1, y, guidance, null_class)
            evals += 1
            x = x + dt * 0.5 * (v0 + v1)
    out = x.float()
    if stats is not None:
        if out.device.type == "cuda":
            torch.cuda.synchronize(out.device)  # the time is the work's, not its launch's
        stats.images += b
        stats.evals += evals
        stats.seconds += time.perf_counter() - start
    return out


def _dp_group(mesh):
    if mesh is None:
        return None
    group = mesh.group("dp") if hasattr(mesh, "group") else mesh
    return group if group.size > 1 else None


def sample_parallel(
    model: nn.Module,
    labels: torch.Tensor,
    shape: tuple[int, int, int],
    mesh,
    *,
    stats: SampleStats | None = None,
    **kwargs,
) -> torch.Tensor:
    """Every image of the request [N, C, H, W] (float32, request order) on every rank.

    Replica r of mesh's dp group (or `mesh` itself when it is a comm.Group) samples images
    bounds(N, dp)[r]..[r+1] with their global indices (so their seeds), and the shares are
    gathered through meshspeed.comm. kwargs: sample()'s."""
    dp = _dp_group(mesh)
    if dp is None:
        return sample(model, labels, shape, stats=stats, **kwargs)
    n = labels.shape[0]
    offs = bounds(n, dp.size)
    lo, hi = offs[dp.rank], offs[dp.rank + 1]
    dev = dp.ctx.device  # the gather travels on the backend's device (NCCL moves no CPU tensor)
    local = (
        sample(model, labels[lo:hi], shape, rows=range(lo, hi), stats=stats, **kwargs)
        if hi > lo
        else torch.empty(0, *shape)
    )
    sizes = [offs[r + 1] - offs[r] for r in range(dp.size)]
    out = comm.all_gather(local.to(dev, torch.float32).contiguous(), dp, sizes=sizes).cpu()
    if stats is not None:
        mine = torch.tensor([stats.seconds], dtype=torch.float64, device=dev)
        stats.per_rank = comm.all_gather(mine, dp).tolist()
    return out
