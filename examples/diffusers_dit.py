"""A diffusers DiTTransformer2DModel in and out of meshspeed, with nothing downloaded.

    python examples/diffusers_dit.py --out dit-diffusers          # a tiny random one, save_pretrained
    python examples/diffusers_dit.py --check dit-exported --against runs/dit-tiny

--out writes a digits-shaped model (1 channel, 8 × 8, 10 classes: what configs/dit-tiny.toml
trains on) with random weights and one conditioning embedder shared by its blocks (as DiT's
checkpoints have; meshspeed's dit shares one). --check loads an exported directory with
`DiTTransformer2DModel.from_pretrained` and prints how far its forward is from meshspeed's dit
holding the run's EMA weights (what `meshspeed convert --to-hf` exports by default).
docs/diffusion.md shows the commands between the two.
"""

from __future__ import annotations

import argparse
import sys

import torch

DIGITS = dict(
    num_attention_heads=2,
    attention_head_dim=16,
    in_channels=1,
    num_layers=2,
    sample_size=8,
    patch_size=2,
    num_embeds_ada_norm=10,
)


def write(out: str, seed: int) -> None:
    import diffusers

    torch.manual_seed(seed)
    model = diffusers.DiTTransformer2DModel(**DIGITS)
    with torch.no_grad():
        for p in model.parameters():  # diffusers zero-inits the adaLN paths: make every weight live
            p.add_(0.02 * torch.randn_like(p))
        first = model.transformer_blocks[0].norm1.emb
        for block in model.transformer_blocks[1:]:  # dit shares one conditioning embedder
            block.norm1.emb.load_state_dict(first.state_dict())
    model.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: DiTTransformer2DModel, {n:,} parameters (random, seed {seed})")


def check(exported: str, run: str) -> int:
    import diffusers

    from meshspeed.interop.model_source import checkpoint_model_config, checkpoint_state
    from meshspeed.models import build_model

    ema = (checkpoint_state(run)[1].get("extra") or {}).get("ema")
    if ema is None:
        print(f"{run}: the checkpoint holds no EMA; train with flow.ema_decay > 0", file=sys.stderr)
        return 2
    dit = build_model(checkpoint_model_config(run)).eval()
    dit.load_state_dict(ema["weights"])
    back = diffusers.DiTTransformer2DModel.from_pretrained(exported).eval()
    gen = torch.Generator().manual_seed(0)
    c = dit.config
    x = torch.randn(4, c.in_channels, c.image_size, c.image_size, generator=gen)
    t, y = torch.tensor([0.0, 0.3, 0.7, 1.0]), torch.tensor([0, 3, 9, c.n_classes])  # n_classes: null
    with torch.no_grad():  # diffusers' timestep is 1000·t (meshspeed/models/dit.py)
        err = (back(x, timestep=1000 * t, class_labels=y).sample - dit(x, t, y)).abs().max().item()
    print(f"{exported}: diffusers' forward is {err:.2e} from meshspeed's dit (the EMA of {run})")
    return 0 if err < 1e-5 else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="", help="write a tiny random DiTTransformer2DModel here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", default="", metavar="DIR", help="an exported diffusers directory")
    p.add_argument("--against", default="", metavar="RUN", help="with --check: the meshspeed run")
    a = p.parse_args(argv)
    if bool(a.out) == bool(a.check) or bool(a.check) != bool(a.against):
        p.error("give --out DIR, or --check DIR --against RUN")
    if a.out:
        write(a.out, a.seed)
        return 0
    return check(a.check, a.against)


if __name__ == "__main__":
    sys.exit(main())
