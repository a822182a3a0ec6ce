"""Inference: a key/value cache installed into the single-device model's attention cores and
generation (greedy / sampled) over a batch of prompts of different lengths."""

from meshspeed.infer.cache import KVCache, left_pad
from meshspeed.infer.generate import SamplingConfig, generate, model_step

__all__ = ["KVCache", "SamplingConfig", "generate", "left_pad", "model_step"]
