"""Vision-language records from every `data.path` form (data/image_captions.py, image_chat.py,
image_sources.py): a conversation about an image (placeholders where `<image>` stands, labels on
the assistant turns only, M-RoPE positions as transformers' Qwen2-VL gives them), a file from
`meshspeed data prepare --images` equal to the directory it was prepared from, captions templated
from class labels, one line from the run plan for a bad record, and a 2-step `meshspeed train` on
a prepared file and on conversations."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from meshspeed.cli import main
from meshspeed.comm import ConfigError
from meshspeed.data.image_captions import load_caption_jsonl, read_rgb
from meshspeed.data.image_sources import caption_splits
from meshspeed.data.images import load_image_records
from meshspeed.plan import config
from meshspeed.plan.run_plan import make_plan
from tests import warm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N_IMG, IMG = 16, 255  # vlm-tiny: 16 placeholders of id 255
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Is <image> red?"},
    {"role": "assistant", "content": "yes"},
    {"role": "user", "content": "Sure?"},
    {"role": "assistant", "content": "very"},
]


def _png(path, colour, size=32) -> None:
    rgb = np.zeros((size, size, 3), dtype=np.uint8)
    rgb[: size // 2] = colour  # top half coloured: a resize has edges to blend
    Image.fromarray(rgb).save(path)


def _jsonl(path, rows) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def _chat_file(tmp_path, messages=CHAT, n=2) -> str:
    _png(tmp_path / "a.png", (200, 10, 10))
    return _jsonl(tmp_path / "chat.jsonl", [{"image": "a.png", "messages": messages}] * n)


def test_conversation_puts_the_placeholders_at_image_and_labels_assistant_turns(tmp_path):
    train, _ = load_caption_jsonl(_chat_file(tmp_path), 32, N_IMG, IMG, 120)
    tokens, labels = train["tokens"][0].tolist(), train["labels"][0].tolist()
    head = b"<|system|>\nBe brief.\n<|user|>\nIs "
    rest = b" red?\n<|assistant|>\nyes\0<|user|>\nSure?\n<|assistant|>\nvery\0"
    want = list(head) + [IMG] * N_IMG + list(rest)
    assert tokens == want + [0] * (120 - len(want))
    # position p predicts token p+1: labelled exactly where token p+1 is an answer's or its end
    answers = {len(head) + N_IMG + rest.index(b"yes\0") + k for k in range(4)}
    answers |= {len(head) + N_IMG + rest.index(b"very\0") + k for k in range(5)}
    assert [p + 1 for p, t in enumerate(labels) if t != -100] == sorted(answers)
    assert [t for t in labels if t != -100] == list(b"yes\0very\0")
    assert torch.equal(train["images"][0], torch.from_numpy(read_rgb(str(tmp_path / "a.png"), 32, "")))


def test_conversation_without_image_opens_the_first_user_turn(tmp_path):
    msgs = [
        m if m["role"] != "user" else {**m, "content": m["content"].replace("<image>", "it")} for m in CHAT
    ]
    train, _ = load_caption_jsonl(_chat_file(tmp_path, msgs), 32, N_IMG, IMG)
    head = list(b"<|system|>\nBe brief.\n<|user|>\n")
    assert train["tokens"][0, : len(head) + N_IMG + 2].tolist() == head + [IMG] * N_IMG + list(b"Is")


def test_mixed_lines_each_keep_their_own_form(tmp_path):
    _png(tmp_path / "a.png", (10, 200, 10))
    rows = [
        {"image": "a.png", "caption": "green"},
        {"image": "a.png", "question": "colour? ", "answer": "green"},
        {"image": "a.png", "messages": CHAT[1:3]},
    ]
    train, held = load_caption_jsonl(_jsonl(tmp_path / "m.jsonl", rows), 32, N_IMG, IMG, 64)
    assert len(train["tokens"]) == 2 and len(held["tokens"]) == 1  # the last tenth, at least one
    answers = [
        bytes(t for t in r.tolist() if t != -100) for r in torch.cat([train["labels"], held["labels"]])
    ]
    assert answers == [b"green\0", b"green\0", b"yes\0"]


def test_mrope_positions_of_an_image_mid_sequence(tmp_path):
    """The placeholders after text: text counts up, the image's tokens take (p, p + row, p + col)
    on its 4 x 4 merged grid, the text after resumes at p + 4 (the rule of mrope_positions'
    docstring); and, when transformers is installed, exactly its Qwen2-VL get_rope_index."""
    from meshspeed.models.presets import get_preset
    from meshspeed.models.vlm import mrope_positions

    cfg = get_preset("vlm-tiny")
    train, _ = load_caption_jsonl(_chat_file(tmp_path), 32, N_IMG, IMG, 120)
    tokens = train["tokens"][:1]
    pos = mrope_positions(tokens, cfg)[:, 0]  # [3, seq]
    p = tokens[0].tolist().index(IMG)
    assert p > 0 and pos[:, :p].tolist() == [list(range(p))] * 3
    grid = torch.arange(N_IMG)
    assert pos[0, p : p + N_IMG].tolist() == [p] * N_IMG
    assert pos[1, p : p + N_IMG].tolist() == (p + grid // 4).tolist()
    assert pos[2, p : p + N_IMG].tolist() == (p + grid % 4).tolist()
    after = p + N_IMG
    assert pos[:, after].tolist() == [p + 4] * 3 and pos[0, -1].item() == p + 4 + 120 - after - 1

    modeling = pytest.importorskip("transformers.models.qwen2_vl.modeling_qwen2_vl")
    from types import MethodType, SimpleNamespace

    fake = SimpleNamespace(config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=2)))
    fake.get_vision_position_ids = MethodType(modeling.Qwen2VLModel.get_vision_position_ids, fake)
    want, _ = modeling.Qwen2VLModel.get_rope_index(
        fake, tokens, mm_token_type_ids=(tokens == IMG).int(), image_grid_thw=torch.tensor([[1, 8, 8]])
    )
    assert torch.equal(mrope_positions(tokens, cfg), want)


def _captions_dir(tmp_path, n=8):
    d = tmp_path / "caps"
    d.mkdir()
    colours = [(200, 10, 10), (10, 200, 10), (10, 10, 200), (200, 200, 10)]
    rows = []
    for i in range(n):
        _png(d / f"{i}.png", colours[i % 4], size=16)  # 16 x 16: resized to the model's 32
        rows.append({"image": f"{i}.png", "caption": f"picture {i}"})
    _jsonl(d / "captions.jsonl", rows)
    return d


def test_prepared_file_equals_its_directory_and_the_jsonl_pixels(tmp_path, capsys):
    d = _captions_dir(tmp_path)
    out = tmp_path / "caps.safetensors"
    assert main(["data", "prepare", "--images", str(d), "--out", str(out)]) == 0
    from_file = caption_splits(str(out), 32, N_IMG, IMG, 40)
    from_dir = caption_splits(str(d), 32, N_IMG, IMG, 40)
    for a, b in zip(from_file, from_dir, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # held out: the prepared file's fixed split
    _, val = load_image_records(str(out))
    assert len(from_file[1]["tokens"]) == len(val["images"]) == 1
    # each record: the caption's tokens and the pixels the .jsonl path reads from the same PNG
    for rec in from_file:
        for tokens, image in zip(rec["tokens"], rec["images"], strict=True):
            text = bytes(t for t in tokens.tolist() if t not in (0, IMG)).decode()
            i = int(text.split()[1])
            assert tokens[:N_IMG].tolist() == [IMG] * N_IMG and text == f"picture {i}"
            assert torch.equal(image, torch.from_numpy(read_rgb(str(d / f"{i}.png"), 32, "")))


def test_class_labels_become_captions(tmp_path, capsys):
    out = tmp_path / "digits.safetensors"
    assert main(["data", "prepare", "--images", "digits", "--out", str(out)]) == 0
    train, held = caption_splits(str(out), 32, N_IMG, IMG, 28)
    assert len(train["tokens"]) + len(held["tokens"]) == 1797
    first = bytes(t for t in train["tokens"][0].tolist() if t not in (0, IMG)).decode()
    assert first.startswith("the digit ") and len(first) == len("the digit 7")
    folders = tmp_path / "pets"
    for name in ("cat", "dog"):
        (folders / name).mkdir(parents=True)
        for i in range(2):
            _png(folders / name / f"{i}.png", (i * 100, 50, 50))
    train, held = caption_splits(str(folders), 32, N_IMG, IMG, 24)
    words = sorted(bytes(t for t in r.tolist() if t not in (0, IMG)).decode() for r in train["tokens"])
    assert len(held["tokens"]) == 1 and set(words) <= {"cat", "dog"} and len(words) == 3
    np.savez(tmp_path / "bare.npz", images=np.zeros((4, 8, 8), dtype=np.uint8))
    with pytest.raises(ConfigError, match="without captions or class labels") as err:
        caption_splits(str(tmp_path / "bare.npz"), 32, N_IMG, IMG, 24)
    assert "\n" not in str(err.value)


BAD = [
    ("missing image", {"image": "gone.png", "caption": "x"}, r"line 2: image .*gone\.png' does not exist"),
    (
        "unknown key",
        {"image": "a.png", "caption": "x", "colour": "red"},
        r"line 2: unknown key\(s\) \['colour'\]",
    ),
    (
        "too long",
        {
            "image": "a.png",
            "messages": [{"role": "user", "content": "?"}, {"role": "assistant", "content": "y" * 40}],
        },
        r"line 2: the record takes 82 tokens .* train\.seq_len=56; use train\.seq_len=82",
    ),
    (
        "image in an answer",
        {
            "image": "a.png",
            "messages": [{"role": "user", "content": "?"}, {"role": "assistant", "content": "<image>"}],
        },
        "line 2: <image> is in message 1, a assistant turn; put it in a user turn",
    ),
]


@pytest.mark.parametrize("row,match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_plan_names_the_bad_record_in_one_line(tmp_path, row, match):
    _png(tmp_path / "a.png", (1, 2, 3))
    path = _jsonl(
        tmp_path / "d.jsonl",
        [{"image": "a.png", "caption": "fine"}, row, {"image": "a.png", "caption": "ok"}],
    )
    settings = [("model.preset", "vlm-tiny"), ("train.objective", "sft"), ("train.seq_len", "56")]
    cfg = config.load(None, settings + [("data.path", path), ("run.dir", str(tmp_path / "run"))])
    with pytest.raises(ConfigError, match=match) as err:
        make_plan(cfg, 2, ranks=False)
    assert "\n" not in str(err.value) and str(err.value).startswith(path)


def _train(cwd, data_path, *extra):
    argv = [
        sys.executable,
        "-m",
        "meshspeed",
        "train",
        "--config",
        os.path.join(ROOT, "configs", "vlm-tiny.toml"),
    ]
    argv += [
        "--data.path",
        data_path,
        "--train.steps",
        "2",
        "--checkpoint.interval",
        "0",
        "--run.dir",
        "run",
        *extra,
    ]
    done = warm.run(argv, cwd=str(cwd), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in open(cwd / "run" / "metrics.jsonl")]
    assert len(rows) == 2 and all(np.isfinite(r["loss"]) for r in rows)
    return done


def test_train_two_steps_on_a_prepared_file(tmp_path, capsys):
    d = _captions_dir(tmp_path, n=20)
    assert main(["data", "prepare", "--images", str(d), "--out", str(tmp_path / "caps.safetensors")]) == 0
    done = _train(tmp_path, "caps.safetensors", "--train.seq_len", "28")
    assert "exact-match" in done.stdout  # the held-out captions of the prepared file's split


def test_train_two_steps_on_conversations(tmp_path):
    done = _train(tmp_path, _chat_file(tmp_path, n=20), "--train.seq_len", "112")
    assert "exact-match" in done.stdout
