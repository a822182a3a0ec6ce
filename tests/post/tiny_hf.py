"""A tiny Hugging Face chat tokenizer (and Llama) built offline, for the post-training tests.

The tokenizer is a byte-level BPE trained in a fraction of a second on a few sentences (so merges
exist and token boundaries do not fall on every character), with ChatML's special tokens and a
ChatML template whose `{% generation %}` block marks what HF's `return_assistant_tokens_mask`
(TRL's `assistant_only_loss`) trains on: the assistant's content and `<|im_end|>\\n`.
"""

from __future__ import annotations

import json
import os

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
    "{%- else %}{{- message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CORPUS = [
    "What is 17+25? The answer is 42.",
    "Hello! How are you today? I am fine, thank you.",
    "system user assistant: be brief and helpful. 0123456789 + - = ?",
    "Tell me a story about a shard, a rank and a layer of heads.",
]


def tiny_tokenizer(path: str, vocab_size: int = 320) -> str:
    """Write tokenizer.json + tokenizer_config.json (ChatML template) to `path`; returns `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 8, trainer)
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHATML,
        "model_max_length": 4096,
    }
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return path


def hf_tokenizer(path: str):
    """The transformers tokenizer of `tiny_tokenizer(path)`."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_tokenizer(path))


def tiny_llama(vocab_size: int, seed: int = 0, dim: int = 32):
    """A random HF LlamaForCausalLM: 2 layers, width `dim`, fp32, no dropout."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=dim,
        intermediate_size=2 * dim,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attention_dropout=0.0,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    return LlamaForCausalLM(cfg).float()
