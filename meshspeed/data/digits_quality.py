"""Sample quality of a digits model: how many class-conditional samples a small digit
classifier recognises as their class (pure noise: 10%), and an FID on that classifier's
penultimate features against the real held-out digits.

The classifier is an MLP (64 → 128 → 32 → 10), trained full-batch with AdamW on the digits train
split (data/images.py's fixed split) from a fixed seed: about 1-2 s on one CPU core, then cached
as safetensors (plain tensors, nothing unpickled) under ~/.cache/meshspeed (or a given folder,
such as a run directory). It lives in data/, not bench/, because the trainer scores its sample
grid with it at the end of a run and train/ must not import bench/.

FID here is the Fréchet distance between Gaussians fitted to 32-d features: computed in float64
with a torch eigendecomposition (symmetric form Tr((√Σ₁ Σ₂ √Σ₁)^½), no scipy), so it is
comparable between runs of this classifier only, not with Inception FIDs.
"""

from __future__ import annotations

import hashlib
import os

import torch
from torch import nn

from meshspeed.comm.errors import ConfigError

SHAPE = (1, 8, 8)
HIDDEN, FEATURES, CLASSES = 128, 32, 10
STEPS, LR, WEIGHT_DECAY = 150, 1e-2, 1e-4
# the cache file's name carries everything that defines the weights: a change makes a new file
VERSION = f"v1-mlp{HIDDEN}x{FEATURES}-s{STEPS}-lr{LR}"


class DigitClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, FEATURES)
        self.head = nn.Linear(FEATURES, CLASSES)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """[N, 1, 8, 8] in [-1, 1] → [N, 32] penultimate features (the FID's space)."""
        h = torch.relu(self.fc1(x.flatten(1)))
        return torch.relu(self.fc2(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def _cache_path(cache_dir: str | None, seed: int) -> str:
    base = cache_dir or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "meshspeed"
    )
    return os.path.join(base, f"digits-classifier-{VERSION}-seed{seed}.safetensors")


def train_classifier(seed: int = 0) -> DigitClassifier:
    """The classifier trained on the digits train split: deterministic from `seed` (the init
    drawn from its own generator, full-batch steps, no shuffling)."""
    from meshspeed.data.images import load_image_records

    train, _ = load_image_records("digits")
    g = torch.Generator().manual_seed(seed)
    model = DigitClassifier()
    with torch.no_grad():
        for p in model.parameters():
            # uniform ±1/√fan_in, as nn.Linear's default but from our generator
            fan_in = p.shape[-1] if p.dim() > 1 else model.fc1.in_features
            p.uniform_(-(fan_in**-0.5), fan_in**-0.5, generator=g)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    x, y = train["images"], train["labels"]
    for _ in range(STEPS):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return model.eval()


def load_classifier(cache_dir: str | None = None, seed: int = 0) -> DigitClassifier:
    """The cached classifier, trained and cached first when absent (or unreadable)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file, save_file

    path = _cache_path(cache_dir, seed)
    model = DigitClassifier()
    try:
        model.load_state_dict(load_file(path))
        return model.eval()
    except (OSError, SafetensorError, RuntimeError):
        pass  # absent, partial or from another shape: train again
    model = train_classifier(seed)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp)
    os.replace(tmp, path)  # two runs training at once each write whole files
    return model


def _check(images: torch.Tensor, what: str) -> torch.Tensor:
    if images.dim() != 4 or tuple(images.shape[1:]) != SHAPE:
        raise ConfigError(
            f"{what} has shape {list(images.shape)}; the digit classifier scores [N, 1, 8, 8] images "
            "(a model trained on data.path=digits)"
        )
    # a sample's pixels past [-1, 1] would not survive its PNG either
    return images.detach().float().cpu().clamp(-1, 1)


def frechet_distance(f1: torch.Tensor, f2: torch.Tensor) -> float:
    """‖μ₁ − μ₂‖² + Tr(Σ₁ + Σ₂ − 2(Σ₁Σ₂)^½) of Gaussians fitted to features [N, D] and [M, D]."""
    a, b = f1.double(), f2.double()
    mu1, mu2 = a.mean(0), b.mean(0)
    s1, s2 = torch.cov(a.T), torch.cov(b.T)

    def sqrt_psd(m):
        w, v = torch.linalg.eigh(m)
        return (v * w.clamp(min=0).sqrt()) @ v.T

    r1 = sqrt_psd(s1)
    # Tr((Σ₁Σ₂)^½) = Tr((√Σ₁ Σ₂ √Σ₁)^½): the same eigenvalues, and the latter is symmetric
    cross = torch.linalg.eigvalsh(r1 @ s2 @ r1).clamp(min=0).sqrt().sum()
    return float((mu1 - mu2).square().sum() + s1.trace() + s2.trace() - 2 * cross)


class DigitsScorer:
    """Accuracy and FID of digit images with one cached classifier and the real held-out set."""

    def __init__(self, cache_dir: str | None = None, seed: int = 0):
        from meshspeed.data.images import load_image_records

        self.model = load_classifier(cache_dir, seed)
        _, self.val = load_image_records("digits")

    @torch.no_grad()
    def features(self, images: torch.Tensor) -> torch.Tensor:
        return self.model.features(_check(images, "images"))

    @torch.no_grad()
    def accuracy(self, images: torch.Tensor, labels: torch.Tensor) -> float:
        """Fraction of `images` the classifier assigns to `labels` (their conditioning class)."""
        pred = self.model(_check(images, "images")).argmax(1)
        return float((pred == labels.cpu()).float().mean())

    def fid(self, images: torch.Tensor, reference: torch.Tensor | None = None) -> float:
        """FID of `images` against `reference` (default: the 180 real held-out digits)."""
        ref = self.val["images"] if reference is None else reference
        return frechet_distance(self.features(images), self.features(ref))

    def score(self, images: torch.Tensor, labels: torch.Tensor) -> dict:
        return {"accuracy": self.accuracy(images, labels), "fid": self.fid(images), "n": images.shape[0]}


def score_samples(images: torch.Tensor, labels: torch.Tensor, cache_dir: str | None = None) -> dict:
    """{"accuracy", "fid", "n"} of class-conditional samples [N, 1, 8, 8] in [-1, 1] (the
    trainer's end-of-run figure)."""
    return DigitsScorer(cache_dir).score(images, labels)


def weights_digest(model: DigitClassifier) -> str:
    """A short hash of the classifier's weights (tests: the same seed, the same weights)."""
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode() + v.numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    """The figure's baselines: real held-out digits and pure noise, 50 per class."""
    s = DigitsScorer()
    labels = torch.arange(CLASSES).repeat_interleave(50)
    noise = torch.randn(labels.shape[0], *SHAPE, generator=torch.Generator().manual_seed(0))
    from meshspeed.data.images import load_image_records

    train, _ = load_image_records("digits")  # not the reference itself, which scores 0 trivially
    print(f"real held-out: accuracy {s.accuracy(s.val['images'], s.val['labels']):.1%}")
    print(f"noise        : accuracy {s.accuracy(noise, labels):.1%}, FID {s.fid(noise):.2f}")
    print(f"real train   : FID {s.fid(train['images']):.2f} against the held-out digits")


if __name__ == "__main__":
    main()
