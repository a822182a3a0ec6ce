"""Chat and preference records: the trained tokens are the assistant's, and only those.

The oracle is Hugging Face itself: `apply_chat_template(..., return_assistant_tokens_mask=True)`
on a template with `{% generation %}` blocks (TRL's `assistant_only_loss`) for conversations, and
TRL's prompt/completion rule (the completion = what follows the tokenized prompt with its
generation prompt) for completions and pairs. The tokenizer is built offline (tiny_hf.py).
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from meshspeed.data.chat import (
    ChatStats,
    load_chat,
    load_chat_split,
    load_pairs,
    load_pairs_split,
)
from meshspeed.data.corpus import DataError
from meshspeed.data.tokenizer import ByteTokenizer, load_tokenizer
from tests.post.tiny_hf import CHATML, hf_tokenizer

CONVERSATIONS = [
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 17+25?"},
            {"role": "assistant", "content": "42"},
            {"role": "user", "content": "And minus 2?"},
            {"role": "assistant", "content": "The answer is 40."},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "Hello! How are you today?"},
            {"role": "assistant", "content": " I am fine, thank you. "},
            {"role": "user", "content": "Tell me a story."},
        ]
    },
    {"messages": [{"role": "user", "content": "héllo ✓"}, {"role": "assistant", "content": "ça va ✓"}]},
]
COMPLETIONS = [
    {"prompt": "What is 3+4?", "completion": "7"},
    {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}],
        "completion": [{"role": "assistant", "content": "hi there"}],
    },
]
PAIRS = [
    {"prompt": "What is 17+25?", "chosen": "42", "rejected": "43"},
    {
        "prompt": [{"role": "user", "content": "Tell me a story."}],
        "chosen": [{"role": "assistant", "content": "A shard met a rank."}],
        "rejected": [{"role": "assistant", "content": "No."}],
    },
]


def _jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    pytest.importorskip("transformers")
    return hf_tokenizer(str(tmp_path_factory.mktemp("tok")))


def _trained_positions(labels: torch.Tensor, tokens: torch.Tensor) -> list[int]:
    """Token positions that are some label's target (labels[i] targets token i+1)."""
    at = (labels != -100).nonzero().flatten()
    assert torch.equal(labels[at], tokens[at + 1]), "a label is not the next token"
    return (at + 1).tolist()


def test_conversation_masks_equal_hugging_face_assistant_masks(tmp_path, hf):
    recs = load_chat(_jsonl(tmp_path / "c.jsonl", CONVERSATIONS), hf, 96)
    for i, conv in enumerate(CONVERSATIONS):
        ref = hf.apply_chat_template(
            conv["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, want = ref["input_ids"], [j for j, m in enumerate(ref["assistant_masks"]) if m]
        assert recs["tokens"][i, : len(ids)].tolist() == ids
        assert _trained_positions(recs["labels"][i], recs["tokens"][i]) == want
        assert (recs["labels"][i, len(ids) - 1 :] == -100).all()  # padding and the last token


def _trl_completion(hf, prompt, answer):
    """TRL's rule: the completion is what follows the tokenized prompt (with generation prompt)."""
    as_msgs = lambda v, role: [{"role": role, "content": v}] if isinstance(v, str) else v  # noqa: E731
    p = hf.apply_chat_template(
        as_msgs(prompt, "user"), tokenize=True, add_generation_prompt=True, return_dict=True
    )["input_ids"]
    full = hf.apply_chat_template(
        as_msgs(prompt, "user") + as_msgs(answer, "assistant"), tokenize=True, return_dict=True
    )["input_ids"]
    assert full[: len(p)] == p
    return full, list(range(len(p), len(full)))


def test_completion_masks_follow_trls_prompt_completion_rule(tmp_path, hf):
    recs = load_chat(_jsonl(tmp_path / "c.jsonl", COMPLETIONS), hf, 64)
    for i, r in enumerate(COMPLETIONS):
        ids, want = _trl_completion(hf, r["prompt"], r["completion"])
        assert recs["tokens"][i, : len(ids)].tolist() == ids
        assert _trained_positions(recs["labels"][i], recs["tokens"][i]) == want


def test_pair_masks_cover_the_completion_only(tmp_path, hf):
    recs = load_pairs(_jsonl(tmp_path / "p.jsonl", PAIRS), hf, 64)
    assert set(recs) == {"chosen_tokens", "chosen_labels", "rejected_tokens", "rejected_labels"}
    for i, r in enumerate(PAIRS):
        for side in ("chosen", "rejected"):
            ids, want = _trl_completion(hf, r["prompt"], r[side])
            assert recs[f"{side}_tokens"][i, : len(ids)].tolist() == ids
            assert _trained_positions(recs[f"{side}_labels"][i], recs[f"{side}_tokens"][i]) == want


def test_byte_template_trains_on_assistant_bytes_and_their_end_of_turn(tmp_path):
    tok = ByteTokenizer()
    recs = load_chat(_jsonl(tmp_path / "c.jsonl", CONVERSATIONS), tok, 160)
    for i, conv in enumerate(CONVERSATIONS):
        text = tok.decode(recs["tokens"][i]).rstrip("\0")
        answers = [m["content"] for m in conv["messages"] if m["role"] == "assistant"]
        header = "<|assistant|>\n"
        assert text.count(header) == len(answers)
        labelled = recs["labels"][i][recs["labels"][i] != -100]
        assert tok.decode(labelled) == "".join(a + "\0" for a in answers)
    pairs = load_pairs(_jsonl(tmp_path / "p.jsonl", PAIRS[:1]), tok, 64)
    assert tok.decode(pairs["chosen_labels"][0][pairs["chosen_labels"][0] != -100]) == "42\0"
    assert tok.decode(pairs["rejected_labels"][0][pairs["rejected_labels"][0] != -100]) == "43\0"
    assert tok.decode(pairs["chosen_tokens"][0]).startswith("<|user|>\nWhat is 17+25?\n<|assistant|>\n42\0")


def test_packing_keeps_each_conversation_whole_and_its_own_document(tmp_path, hf):
    path = _jsonl(tmp_path / "c.jsonl", CONVERSATIONS + COMPLETIONS)
    alone = load_chat(path, hf, 64)
    packed = load_chat(path, hf, 64, packing=True)
    assert set(packed) == {"tokens", "labels", "doc_ids"} and packed["tokens"].dtype == torch.int64
    assert packed["tokens"].shape[0] < alone["tokens"].shape[0]
    seen = []
    for r in range(packed["tokens"].shape[0]):
        d = packed["doc_ids"][r]
        assert (d[1:] >= d[:-1]).all() and d[0] == 0
        for k in d.unique().tolist():
            at = (d == k).nonzero().flatten()
            seen.append((packed["tokens"][r, at].tolist(), packed["labels"][r, at].tolist()))
    for i in range(alone["tokens"].shape[0]):
        n = int((alone["labels"][i] != -100).nonzero().max()) + 2  # through the last labelled target
        match = [s for s in seen if s[0][:n] == alone["tokens"][i, :n].tolist()]
        assert match and match[0][1] == alone["labels"][i, : len(match[0][1])].tolist()


def test_truncation_keeps_the_start_and_drops_what_has_no_answer_left(tmp_path):
    tok = ByteTokenizer()
    long = {"prompt": "x" * 50, "completion": "y"}
    fits = {"prompt": "q", "completion": "long answer " * 8}
    stats = ChatStats()
    train, val = load_chat_split(
        _jsonl(tmp_path / "c.jsonl", [long, fits]), tok, 40, val_fraction=0, stats=stats
    )
    assert (stats.records, stats.truncated, stats.dropped) == (2, 2, 1)
    assert train["tokens"].shape == (1, 40) and val["tokens"].shape == (0, 40)
    assert train["labels"][0, -1] == -100  # the 41st token is not asked for, as TRL's max_length
    assert (train["labels"][0, :-1] != -100).sum() > 0


def test_held_out_split_is_the_last_records(tmp_path):
    tok = ByteTokenizer()
    pairs = [{"prompt": f"q{i}", "chosen": f"a{i}", "rejected": f"b{i}"} for i in range(10)]
    train, val = load_pairs_split(_jsonl(tmp_path / "p.jsonl", pairs), tok, 32, val_fraction=0.2)
    assert train["chosen_tokens"].shape[0] == 8 and val["chosen_tokens"].shape[0] == 2
    assert tok.decode(val["chosen_labels"][1][val["chosen_labels"][1] != -100]) == "a9\0"


def _templated(tmp_path, template: str):
    pytest.importorskip("transformers")
    from tests.post.tiny_hf import tiny_tokenizer

    d = tiny_tokenizer(str(tmp_path / "tok"))
    cfg = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(cfg))
    return load_tokenizer(d)


@pytest.mark.parametrize(
    "record, message",
    [
        ({"text": "hi"}, "needs 'messages' or 'prompt' + 'completion'"),
        (
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}]},
            "assistant turn 1 is empty",
        ),
        ({"messages": [{"role": "tool", "content": "hi"}]}, "has role 'tool'"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
        ({"prompt": "a\0b", "completion": "c"}, "NUL byte"),
    ],
)
def test_a_bad_record_is_one_line_naming_file_and_line(tmp_path, record, message):
    path = _jsonl(tmp_path / "c.jsonl", [COMPLETIONS[0], record])
    with pytest.raises(DataError, match=re.escape(message)) as err:
        load_chat(path, ByteTokenizer(), 64)
    assert f"{path} line 2:" in str(err.value) and "\n" not in str(err.value)


def test_a_pair_missing_a_key_is_named(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "q", "chosen": "a"}])
    with pytest.raises(DataError, match=r"line 1: .*missing \['rejected'\]"):
        load_pairs(path, ByteTokenizer(), 32)


def test_a_template_that_rewrites_earlier_turns_cannot_be_split(tmp_path):
    # like reasoning templates that strip earlier answers: an answer renders only as the last turn
    tok = _templated(
        tmp_path,
        (
            "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
            "{%- if m['role'] != 'assistant' or loop.last %}{{ m['content'] }}{% endif %}"
            "{{ '<|im_end|>\\n' }}{%- endfor %}"
            "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
        ),
    )
    path = _jsonl(tmp_path / "c.jsonl", CONVERSATIONS[:1])
    with pytest.raises(DataError, match="line 1: the chat template cannot be split at assistant turn 2"):
        load_chat(path, tok, 96)


def test_a_template_that_drops_the_answer_is_refused(tmp_path):
    tok = _templated(
        tmp_path,
        (
            "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
            "{%- if m['role'] != 'assistant' %}{{ m['content'] }}{% endif %}"
            "{{ '<|im_end|>\\n' }}{%- endfor %}"
            "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
        ),
    )
    with pytest.raises(DataError, match="does not hold the assistant's content"):
        load_chat(_jsonl(tmp_path / "c.jsonl", COMPLETIONS[:1]), tok, 64)


def test_a_template_closing_only_the_last_turn_keeps_that_token_off_earlier_turns(tmp_path):
    """Phi-3's pattern: an end-of-text after the final answer only. `<|endoftext|>` and the next
    turn's `<|im_start|>` share their first characters, not their token: the earlier answer's mask
    must stop at its own `<|im_end|>\\n`, as HF's generation mask does."""
    tok = _templated(
        tmp_path,
        (
            "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
            "{%- if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>\\n' }}"
            "{% endgeneration %}{%- else %}{{ m['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
            "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
            "{%- elif messages[-1]['role'] == 'assistant' %}{% generation %}{{ '<|endoftext|>' }}"
            "{% endgeneration %}{%- endif %}"
        ),
    )
    from meshspeed.data.chat_template import chat_format

    hf = chat_format(tok).hf
    conv = CONVERSATIONS[0]["messages"]
    recs = load_chat(_jsonl(tmp_path / "c.jsonl", CONVERSATIONS[:1]), tok, 96)
    ref = hf.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, want = ref["input_ids"], [j for j, m in enumerate(ref["assistant_masks"]) if m]
    assert recs["tokens"][0, : len(ids)].tolist() == ids
    assert _trained_positions(recs["labels"][0], recs["tokens"][0]) == want


@pytest.mark.parametrize(
    "template, header_in_mask",
    [("llama3", ""), ("qwen3", ""), ("phi3", ""), ("cohere", ""), ("gemma3", ""), ("glm4moe", ""),
     ("qwen2_5", "\n"), ("qwen3_8", "<think>\n")],
)  # fmt: skip
def test_trls_training_templates_give_hugging_faces_assistant_masks(tmp_path, hf, template, header_in_mask):
    """TRL ships `{% generation %}` versions of common templates (its assistant_only_loss): the
    masks are equal, except where the generation block also covers the end of the generation
    prompt (a role header's newline, an opened <think>), which a prompt already holds."""
    import os

    trl = pytest.importorskip("trl")
    path = os.path.join(os.path.dirname(trl.__file__), "chat_templates", f"{template}_training.jinja")
    hf.chat_template = open(path, encoding="utf-8").read()
    try:
        conv = CONVERSATIONS[0]["messages"]
        recs = load_chat(_jsonl(tmp_path / "c.jsonl", CONVERSATIONS[:1]), hf, 1024)
        ref = hf.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    finally:
        hf.chat_template = CHATML
    ids, want = ref["input_ids"], {j for j, m in enumerate(ref["assistant_masks"]) if m}
    assert recs["tokens"][0, : len(ids)].tolist() == ids
    got = set(_trained_positions(recs["labels"][0], recs["tokens"][0]))
    assert got <= want
    assert hf.decode([ids[j] for j in sorted(want - got)]) == header_in_mask * 2  # once per answer


def test_prompt_ids_are_the_records_prompt(tmp_path, hf):
    from meshspeed.data.chat_template import prompt_ids

    for tok, eot in ((ByteTokenizer(), 0), (hf, hf.eos_token_id)):
        recs = load_chat(_jsonl(tmp_path / "c.jsonl", COMPLETIONS[:1]), tok, 64)
        ids, end = prompt_ids(tok, [{"role": "user", "content": COMPLETIONS[0]["prompt"]}])
        first = int((recs["labels"][0] != -100).nonzero()[0])  # predicts the answer's first token
        assert recs["tokens"][0, : first + 1].tolist() == ids and end == eot
