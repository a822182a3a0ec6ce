"""What the run plan checks of a vision-language run (family 'vlm'), before any worker starts:
the objective, the layouts built for it so far and the caption data. One line each, naming the
setting, its value and what works.
"""

from __future__ import annotations

import os

from meshspeed.comm import ConfigError
from meshspeed.models.vlm_config import image_tokens

BUILT_IN = ("", "shapes", "digits")
LONGEST_CAPTION = {"": 39, "shapes": 39, "digits": 11}  # bytes ("yellow triangle left of ...")


def check_vlm(cfg, config) -> None:
    """Refuse what a vlm run cannot do yet (config: the resolved ModelConfig)."""
    if config.family != "vlm":
        return
    t, p = cfg.train, cfg.parallel
    if t.objective != "sft":
        raise ConfigError(
            f"train.objective={t.objective} with a 'vlm' model: vision-language runs train the caption "
            "loss with train.objective=sft"
        )
    if p.cp > 1:  # a cp slice would cut an image's run of placeholders
        raise ConfigError(
            f"parallel.cp={p.cp} with a 'vlm' model: the image placeholders must stay whole on one "
            "rank; use cp=1 (dp, tp with sequence parallelism and pp work)"
        )
    for key, on in (
        ("data.packing", cfg.data.packing),
        ("memory.chunked_loss", cfg.memory.chunked_loss),
        ("train.fused_kernels", t.fused_kernels),
    ):
        if on:  # text-only features, not built for image inputs
            raise ConfigError(f"{key}=true is not built for family vlm yet; set it to false")
    need = image_tokens(config) + LONGEST_CAPTION.get(cfg.data.path, 0) + 1
    if cfg.data.path in BUILT_IN and t.seq_len < need:
        raise ConfigError(
            f"train.seq_len={t.seq_len} is too short for the {image_tokens(config)} image tokens and "
            f"the longest caption of data.path={cfg.data.path or 'shapes'!r}; use train.seq_len={need}"
        )


PLAN_CHECK_RECORDS = 100_000  # a .jsonl's records the plan reads (~1 s); the loader reads the rest


def check_vlm_data(cfg, config, need: bool = True) -> str | None:
    """data.path of a vlm run: empty, 'shapes' or 'digits' (built in), a .jsonl of captions,
    questions or conversations about images, a file from `meshspeed data prepare --images` or a
    directory it reads (data/image_captions.py). Each record's form, image file and length
    against train.seq_len are checked here without opening an image. need=False (dry run): a
    missing path is a note. config: the resolved ModelConfig."""
    from meshspeed.data.image_sources import check_caption_data

    path = cfg.data.path
    if path in BUILT_IN:
        return None
    if not os.path.exists(path):
        if not need:
            return f"data.path={path!r} not found here; planned without it (training needs it)"
        raise ConfigError(
            f"data.path={path!r} is not a file or a directory; give 'shapes' (or leave it empty), "
            "'digits', a .jsonl "
            'of {"image": "a.png", "caption": "..."} (or "question"/"answer", or "messages") lines, '
            "a file from `meshspeed data prepare --images` or the directory it was prepared from"
        )
    n_img, seq_len = image_tokens(config), cfg.train.seq_len
    check_caption_data(path, n_img, config.image_token_id, seq_len, PLAN_CHECK_RECORDS)
    return None
