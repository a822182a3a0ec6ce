"""Greedy captions and answers of a vision-language model (family 'vlm'): the end-of-run
held-out exact-match of `meshspeed train` on a vlm run, and `meshspeed generate --image`.

Decoding runs the whole model on the growing sequence at every step (no key/value cache): the
models this serves are CPU-sized, and the model's own forward is then the only code path, the
same under tp as on one process. Under tp the vocab-parallel output is switched to gather its
logits (as infer/generate.model_step does), so every rank picks the same token.
"""

from __future__ import annotations

import json
import os
import time

import torch

from meshspeed import comm
from meshspeed.comm import ConfigError
from meshspeed.models.vlm import mrope_positions

EOT = 0  # the byte tokenizer's end of text: ends a caption (data/shapes.py)


@torch.no_grad()
def greedy(model, config, prefix: torch.Tensor, images: torch.Tensor, max_new: int, eos: int = EOT):
    """Generated ids [batch, <= max_new] after `prefix` [batch, P] (equal lengths; the image
    placeholders inside), greedy, each row cut after its first `eos`. -> list of id lists."""
    out = getattr(model, "output", None)
    if out is not None and hasattr(out, "gather_output"):  # tp: whole logits on every rank
        out.gather_output = True
    tokens, done = prefix, torch.zeros(prefix.shape[0], dtype=torch.bool)
    features = model.embed.image_features(images)  # the ViT once, not at every step
    for _ in range(max_new):
        logits = model(tokens, None, mrope_positions(tokens, config), features)[:, -1].clone()
        # never a placeholder: a generated one would be read as part of an image next step
        logits[:, config.image_token_id] = float("-inf")
        nxt = logits.argmax(-1).cpu()
        tokens = torch.cat([tokens, torch.where(done, eos, nxt).to(tokens)[:, None]], dim=1)
        done |= nxt == eos
        if bool(done.all()):
            break
    new = tokens[:, prefix.shape[1] :].cpu().tolist()
    return [row[: row.index(eos) + 1] if eos in row else row for row in new]


def text_of(ids: list[int], eos: int = EOT) -> str:
    return bytes(i for i in ids if i != eos and i < 256).decode("utf-8", errors="replace")


def exact_match(model, config, records: dict, batch: int = 100, decode: int = 20) -> dict:
    """Whole-answer exact-match of `records` (placeholders first, a question if any, then the
    caption or answer and its end token, labelled: data/image_captions.py):
    {"exact_match", "right", "n", "greedy_agrees", "examples"}.

    A caption is right when the greedy choice is the caption's token at every position up to
    its end token under teacher forcing, one forward per batch: exactly when greedy decoding
    writes the caption and stops (each step's input is then the caption so far). The first
    `decode` records are also decoded greedily, and `greedy_agrees` counts the decoded ones
    whose verdict is the same (a check of that equivalence on every run)."""
    seq, n = records["tokens"].shape[1], len(records["tokens"])
    out = getattr(model, "output", None)
    if out is not None and hasattr(out, "gather_output"):
        out.gather_output = True
    right, verdicts = 0, []
    with torch.no_grad():
        for i in range(0, n, batch):
            tokens, labels = records["tokens"][i : i + batch], records["labels"][i : i + batch]
            logits = model(tokens, records["images"][i : i + batch])
            logits[..., config.image_token_id] = float("-inf")  # as greedy(): never a placeholder
            pred = logits.argmax(-1).cpu()
            ok = ((pred == labels) | (labels == -100)).all(1)
            right += int(ok.sum())
            verdicts += ok.tolist()
    examples, agrees, k = [], 0, min(decode, n)
    for i in range(k):  # greedy from the prompt (placeholders, then a question's bytes, if any)
        labels = records["labels"][i]
        start = int((labels != -100).nonzero()[0]) + 1  # the answer's first token
        want = labels[labels != -100].tolist()  # the answer and its end token
        prefix = records["tokens"][i : i + 1, :start]
        room = min(seq - start + 1, config.max_seq_len - start)
        got = greedy(model, config, prefix, records["images"][i : i + 1], room)[0]
        agrees += (got == want) == verdicts[i]
        examples.append({"caption": text_of(want), "greedy": text_of(got)})
    return {
        "exact_match": right / n, "right": right, "n": n,
        "greedy_agrees": f"{agrees}/{k}", "examples": examples,
    }  # fmt: skip


def load_run_model(path: str, mesh, setting: str):
    """(model on this rank of `mesh`, its ModelConfig, the checkpoint read) from a checkpoint or a
    run directory (its newest checkpoint that verifies)."""
    from meshspeed.checkpoint.dcp import load_checkpoint
    from meshspeed.checkpoint.dirs import COMPLETE, CheckpointError, newest_verified
    from meshspeed.infer.parallel import build_inference_model
    from meshspeed.interop.model_source import checkpoint_model_config
    from meshspeed.models import recipe_for

    if not os.path.isfile(os.path.join(path, COMPLETE)):  # a run directory: newest that verifies
        found, skipped = newest_verified(path, mesh)
        if found is None:
            raise CheckpointError(f"{setting}={path!r}: no checkpoint verifies ({skipped})")
        path = found
    config = checkpoint_model_config(path, setting)
    if config.family != "vlm":
        raise ConfigError(f"{setting}={path!r} holds a {config.family!r} model; captions need family vlm")
    model, _ = build_inference_model(recipe_for(config), mesh)
    load_checkpoint(path, model, None, mesh, restore_rng=False)
    return model.eval(), config, path


def after_training(cfg) -> dict:
    """The end of `meshspeed train` on a vlm run (commands/train.py calls it in the launcher once
    the workers are done; train/ never imports infer/): the held-out records captioned greedily
    from the final checkpoint, the exact-match printed and written to run.dir/captions.json."""
    from meshspeed.data.image_sources import caption_splits
    from meshspeed.models.vlm_config import image_tokens

    t0 = time.perf_counter()
    ctx = comm.init(device="cpu")
    try:
        mesh = comm.ParallelDims(dp=1).build(ctx)
        model, config, path = load_run_model(cfg.run.dir, mesh, "run.dir")
        args = (config.image_size, image_tokens(config), config.image_token_id, cfg.train.seq_len)
        (held,) = caption_splits(cfg.data.path, *args, splits=("val",))
        result = {**exact_match(model, config, held), "checkpoint": path}
    finally:
        ctx.close()
    result["seconds"] = round(time.perf_counter() - t0, 1)
    with open(os.path.join(cfg.run.dir, "captions.json"), "w") as f:
        json.dump(result, f, indent=1)
    ex = result["examples"][0]
    print(
        f"meshspeed train: held-out captions, greedy: exact-match {result['exact_match']:.1%} "
        f"({result['right']}/{result['n']}; greedy decoding agrees on {result['greedy_agrees']}, e.g. "
        f"{ex['caption']!r} -> {ex['greedy']!r}; "
        f"{result['seconds']:.0f} s) in {os.path.join(cfg.run.dir, 'captions.json')}",
        flush=True,
    )
    return result
