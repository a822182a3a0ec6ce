"""Train the `vlm-tiny` vision-language model on the built-in shapes captions, on one device,
with a plain torch loop (AdamW, no meshspeed trainer), and print the held-out exact-match as it
rises from chance:

    python examples/vlm_shapes.py --seconds 120
    python examples/vlm_shapes.py --png shape.png    # one held-out image, for generate --image

first word: the caption's first word (the first object's colour; chance 1/4) predicted right;
caption: every byte of the caption and its end token right (chance about 1/288). Both are greedy
under teacher forcing, which equals greedy decoding whenever every position is right.
"""

from __future__ import annotations

import argparse
import time

import torch

from meshspeed.data.shapes import shapes_task
from meshspeed.models import build_model, cross_entropy_loss, get_preset
from meshspeed.models.vlm_config import image_tokens


@torch.no_grad()
def exact_match(model, data: dict, n_img: int, batch: int = 250) -> tuple[float, float]:
    """(first-word, whole-caption) exact-match fractions on `data`."""
    first = whole = 0
    for i in range(0, len(data["tokens"]), batch):
        tokens, labels = data["tokens"][i : i + batch], data["labels"][i : i + batch]
        pred = model(tokens, data["images"][i : i + batch]).argmax(-1)
        right = (pred == labels) | (labels == -100)
        whole += right.all(1).sum().item()
        # first word: from the last placeholder up to (and predicting) the first space
        space = (tokens[:, n_img:] == ord(" ")).long().argmax(1) + n_img
        upto = torch.arange(tokens.shape[1])[None] < space[:, None]
        first += (right | ~upto).all(1).sum().item()
    n = len(data["tokens"])
    return first / n, whole / n


def write_png(path: str) -> None:
    """Held-out image 0 (seed 1) as an RGB PNG, and its caption."""
    import numpy as np
    from PIL import Image

    from meshspeed.data.shapes import shape_captions

    images, captions = shape_captions(1, seed=1, image_size=get_preset("vlm-tiny").image_size)
    pixels = ((images[0].transpose(1, 2, 0) + 1) * 127.5).round().astype(np.uint8)
    Image.fromarray(pixels).save(path)
    print(f"wrote {path}: {captions[0]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=120.0, help="training time budget")
    ap.add_argument("--train", type=int, default=8000, help="training records (seed 0)")
    ap.add_argument("--heldout", type=int, default=500, help="held-out records (seed 1)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--eval_every", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1, help="1 holds up best on a shared CPU")
    ap.add_argument(
        "--png", metavar="FILE", help="only write held-out image 0 as a PNG (for generate --image)"
    )
    args = ap.parse_args()
    if args.png:
        return write_png(args.png)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    config = get_preset("vlm-tiny")
    n_img = image_tokens(config)
    train = shapes_task(args.train, seed=0, image_size=config.image_size, n_image_tokens=n_img)
    held = shapes_task(args.heldout, seed=1, image_size=config.image_size, n_image_tokens=n_img)
    model = build_model(config, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    print(
        f"vlm-tiny: {sum(p.numel() for p in model.parameters()):,} parameters; step 0 held-out "
        f"first word / caption: {exact_match(model, held, n_img)}",
        flush=True,
    )

    start, step = time.perf_counter(), 0
    while time.perf_counter() - start < args.seconds:
        idx = torch.randint(0, args.train, (args.batch,))
        logits = model(train["tokens"][idx], train["images"][idx])
        loss = cross_entropy_loss(logits, train["labels"][idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for group in opt.param_groups:  # linear warm-up over the first 100 steps
            group["lr"] = args.lr * min(1.0, (step + 1) / 100)
        opt.step()
        step += 1
        if step % args.eval_every == 0:
            model.eval()
            first, whole = exact_match(model, held, n_img)
            model.train()
            print(
                f"step {step:5d}  {time.perf_counter() - start:6.1f}s  loss {loss.item():.4f}  "
                f"held-out first word {first:.3f}  caption {whole:.3f}",
                flush=True,
            )
    first, whole = exact_match(model.eval(), held, n_img)
    print(
        f"final: {step} steps in {time.perf_counter() - start:.1f}s; held-out first word {first:.3f}, "
        f"caption {whole:.3f}"
    )


if __name__ == "__main__":
    main()
