"""Vision-language training (family 'vlm') in the trainer: the caption records and the caption
objective.

The loss is SFT's (train/objectives/lm.py: per token over the global batch, labels -100 outside
the caption), so `Caption` is SFT with rows the model runs as they are: the tokens with their
placeholders, the images, and the M-RoPE positions [3, rows, seq]. The positions travel in the
micro-batch because a later pipeline stage holds hidden states only and cannot find the
placeholders (parallel/pipeline/forward_only.micro_positions); stage 0's embedding unit takes
(tokens, images) (the recipe's PipelineUnits.inputs).

Data (`data.path`): empty or "shapes" — the built-in shapes captions (data/shapes.py: 8,000
training records from seed 0, 500 held out from seed 1); "digits" — scikit-learn's digits
captioned "the digit 7"; a .jsonl file of {"image": PNG path, "caption": text} or {"image",
"question", "answer"} lines read through Pillow (data/image_captions.py), its last tenth held out.
"""

from __future__ import annotations

import torch

from meshspeed.data.image_sources import caption_splits
from meshspeed.models.vlm import mrope_positions
from meshspeed.models.vlm_config import image_tokens
from meshspeed.train.objectives.lm import SFT


def caption_records(path: str, config, seq_len: int, splits=("train", "val")) -> tuple[dict, ...]:
    """The `splits` records ("train", "val": held out) of `data.path` for the vlm `config` at
    `train.seq_len` (data/image_captions.py)."""
    return caption_splits(
        path, config.image_size, image_tokens(config), config.image_token_id, seq_len, splits
    )


class Caption(SFT):
    """SFT's loss on the caption tokens, the model run on (tokens, images, M-RoPE positions)."""

    name = "sft"
    token_rows = False  # the rows are not cut for cp (refused for vlm) and are run as they are

    def __init__(self, config):
        super().__init__()
        self.config = config

    def rows(self, batch: dict) -> dict:
        tokens, labels = batch["tokens"], batch["labels"]
        return {
            "tokens": tokens,
            "labels": labels,
            "images": batch["images"],
            "positions": mrope_positions(tokens, self.config),  # [3, rows, seq]
            "n_labels": (labels != -100).sum(),  # counted on the host: no device sync in loss()
        }

    def forward(self, model, item: dict) -> torch.Tensor:
        return model(item["tokens"], item["images"], item["positions"])
