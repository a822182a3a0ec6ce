"""Write a directory of captioned images and conversations about them, the files a vision-language
run reads as `data.path` (docs/vlm.md): the built-in shapes images as PNGs (data/shapes.py, no
download), `captions.jsonl` ({"image", "caption"} a line: what `meshspeed data prepare --images`
reads) and `conversations.jsonl` (three turns about each image, the image mid-sentence).

    python examples/vlm_captions.py --out data/shapes --count 200
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
from PIL import Image

from meshspeed.data.shapes import shape_captions


def conversation(caption: str) -> list[dict]:
    """'red square above blue circle' → three questions and answers about it."""
    words = caption.split()
    first, second = " ".join(words[:2]), " ".join(words[-2:])
    relation = " ".join(words[2:-2])
    return [
        {"role": "user", "content": "In <image> which shape is first?"},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "And second?"},
        {"role": "assistant", "content": second},
        {"role": "user", "content": "Where is the first?"},
        {"role": "assistant", "content": relation},
    ]


def write(out: str, count: int, seed: int, image_size: int) -> None:
    images, captions = shape_captions(count, seed, image_size)
    os.makedirs(os.path.join(out, "images"), exist_ok=True)
    with (
        open(os.path.join(out, "captions.jsonl"), "w") as caps,
        open(os.path.join(out, "conversations.jsonl"), "w") as chats,
    ):
        for i, (pixels, caption) in enumerate(zip(images, captions, strict=True)):
            name = f"images/{i:05d}.png"
            rgb = ((pixels.transpose(1, 2, 0) + 1) * 127.5).round().astype(np.uint8)
            Image.fromarray(rgb).save(os.path.join(out, name))
            caps.write(json.dumps({"image": name, "caption": caption}) + "\n")
            chats.write(json.dumps({"image": name, "messages": conversation(caption)}) + "\n")
    print(f"wrote {out}/: {count} images, captions.jsonl and conversations.jsonl")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="data/shapes", help="the directory to write")
    ap.add_argument("--count", type=int, default=200, help="images")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--image-size", type=int, default=32)
    args = ap.parse_args()
    write(args.out, args.count, args.seed, args.image_size)


if __name__ == "__main__":
    main()
