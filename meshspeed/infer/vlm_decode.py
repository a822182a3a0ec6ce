"""A vision-language model (family vlm) decoded by the text families' generators: the key/value
cache, the sampling, the dp split and the pipeline of infer/generate.py and infer/pipeline.py,
with three things only a vlm needs, given to them as their Step (one process, tp) or as a view
of the pipeline stages (pp):

- the prefill's image placeholders take the image's features (the ViT runs once per run, on
  the ranks that hold the embedding); decode steps embed their one token as text;
- M-RoPE positions: the generators count positions as real tokens from 0 (left pads skipped),
  and every prompt holds its image at the same token (`image_at`), so the vlm's [3, batch, new]
  positions are a lookup of that count in one table, made by models/vlm.mrope_positions on a
  row laid out like the prompts. A generated token thus sits where mrope_positions puts it on
  the whole sequence (the uncached path, infer/captions.greedy): text after the image resumes at
  the image's start + its grid side, one further on all three axes per token (Qwen2-VL's
  rope_deltas);
- the placeholder id is never chosen (a generated one would be read as part of an image).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from meshspeed.infer.generate import Step
from meshspeed.models.vlm import mrope_positions
from meshspeed.models.vlm_config import image_tokens


def position_table(config, image_at: int, device=None) -> torch.Tensor:
    """[3, max_seq_len] M-RoPE positions of the token whose real-token count is the index, in a
    sequence with `image_at` text tokens, the image's placeholders, then text."""
    row = torch.zeros(1, config.max_seq_len, dtype=torch.long, device=device)
    row[0, image_at : image_at + image_tokens(config)] = config.image_token_id
    return mrope_positions(row, config)[:, 0]


class VLMInputs:
    """What the generators' token steps become for a vlm (module docstring).
    features: [1, n_img, dim] of the one image (None on ranks without the embedding)."""

    def __init__(self, config, image_at: int, features: torch.Tensor | None, device=None):
        self.config, self.features = config, features
        self.table = position_table(config, image_at, device)

    def positions(self, counts: torch.Tensor) -> torch.Tensor:
        """counts [batch, new] (real tokens before each slot) -> [3, batch, new]."""
        return self.table[:, counts]

    def features_for(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """The features for tokens [batch, new]: the image's once per row in the prefill (every
        prompt holds the one image), None for a decode step (no placeholders)."""
        if not bool((tokens == self.config.image_token_id).any()):
            return None
        return self.features.expand(tokens.shape[0], -1, -1)

    def ban(self, logits: torch.Tensor) -> torch.Tensor:
        logits[..., self.config.image_token_id] = float("-inf")
        return logits


def cached_step(model, inputs: VLMInputs) -> Step:
    """generate()'s Step over a whole (possibly tp) vlm: last-slot logits [batch, vocab], whole
    on every tp rank (as generate.model_step switches the vocab-parallel output to gather)."""
    if hasattr(model.output, "gather_output"):
        model.output.gather_output = True

    def step(tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        logits = model(tokens, None, inputs.positions(counts), inputs.features_for(tokens))
        return inputs.ban(logits[:, -1].float())

    return step


class _StageView:
    """One pipeline chunk as generate_pipeline calls it (embed, body), with the vlm's inputs."""

    def __init__(self, chunk, inputs: VLMInputs):
        self.chunk, self.inputs = chunk, inputs
        self.is_first, self.is_last = chunk.is_first, chunk.is_last

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.chunk.model.embed(tokens, None, self.inputs.features_for(tokens))

    def body(self, h: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        out = self.chunk.body(h, self.inputs.positions(counts))
        return self.inputs.ban(out) if self.is_last else out


def stage_view(stages, inputs: VLMInputs):
    """`stages` (PipelineStages, one chunk) seen through `inputs`, for generate_pipeline."""
    if len(stages.chunks) != 1:
        return stages  # generate_pipeline refuses it in one line
    return SimpleNamespace(chunks=[_StageView(stages.chunks[0], inputs)], model=stages.model, vpp=1)


def decode(model, stages, mesh, config, prompts, features, image_at: int, **kwargs) -> list[list[int]]:
    """Generated ids of every prompt in prompt order on every rank (infer/parallel.generate_parallel:
    dp split, pp when `stages`); kwargs: generate()'s (max_new_tokens, sampling, eos_id, stats)."""
    from meshspeed.infer.parallel import generate_parallel

    device = next(model.parameters()).device
    inputs = VLMInputs(config, image_at, features, device)
    if stages is not None:
        return generate_parallel(model, prompts, mesh, stages=stage_view(stages, inputs), **kwargs)
    return generate_parallel(model, prompts, mesh, step=cached_step(model, inputs), **kwargs)
