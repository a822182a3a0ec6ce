"""Qwen2-style decoder for ONE device: Llama with biases on the q/k/v projections and untied
embeddings (Qwen2-7B: rope theta 1e6, RMSNorm eps 1e-6, GQA 28/4 heads).

Everything else — RoPE layout, SwiGLU, pre-norm blocks, FQNs — is the Llama family's, so the
model is two small subclasses and the recipe is Llama's with this model class. Its tensor-
parallel plan splits the biases with their columns (the colwise style shards a bias along with
dim 0 of its weight); nothing in meshspeed.parallel knows this family exists.
"""

from __future__ import annotations

from meshspeed.comm.recipe import Recipe

from . import llama
from .config import ModelConfig


class Qwen2Attention(llama.Attention):
    def __init__(self, config: ModelConfig):
        super().__init__(config, qkv_bias=True)


class Qwen2Block(llama.TransformerBlock):
    attention_cls = Qwen2Attention


class Qwen2(llama.Transformer):
    block_cls = Qwen2Block


def recipe(config: ModelConfig) -> Recipe:
    return llama.recipe(config, model_cls=Qwen2, name="qwen2")
