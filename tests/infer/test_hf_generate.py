"""Greedy tokens of an imported tiny Hugging Face Llama equal `transformers`' own generate."""

from __future__ import annotations

import pytest
import torch

from meshspeed import comm
from meshspeed.infer import generate
from meshspeed.interop.hf_import import HFCheckpoint, hf_recipe
from meshspeed.parallel.materialize import build_parallel_model
from tests.interop.test_hf import make_hf

transformers = pytest.importorskip("transformers")
PROMPTS = [[5, 9, 2, 17], [7, 1, 4, 4, 8, 3, 11, 60], [30], [12, 13, 14, 15, 16]]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_equals_transformers(tmp_path, family):
    theirs = make_hf(family, str(tmp_path / "hf"))
    ours = build_parallel_model(
        hf_recipe(HFCheckpoint(str(tmp_path / "hf"))), comm.ParallelDims().build(comm.init())
    )
    got = generate(ours.eval(), PROMPTS, max_new_tokens=8)
    want = []
    for p in PROMPTS:  # one prompt at a time: transformers' reference without any padding
        ids = theirs.generate(
            torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        want.append(ids[0, len(p) :].tolist())
    assert got == want
    assert len({tuple(w) for w in want}) > 1  # the prompts lead to different continuations
