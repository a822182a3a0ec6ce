"""The vision-language model (vlm-tiny) in the real Trainer on one mesh equals one process:
per-step caption losses (SFT's per-token normalisation), gradient norms and the validation loss
under dp with ZeRO-1 and ZeRO-3, dp 3, tp 2, pp 2 (the ViT and projector on stage 0, the M-RoPE
positions carried to stage 1 in the micro-batch), dp 2 × tp 2 and pp 2 × tp 2, in the pooled gloo
workers.
The run plan refuses what is not built (cp, other objectives) in one line before any worker
starts. Sequence parallelism: test_vlm_sp.py.
"""

from __future__ import annotations

import pytest
import torch

from meshspeed.comm import ConfigError
from meshspeed.plan import config
from meshspeed.plan.run_plan import make_plan
from meshspeed.train.trainer import Trainer
from tests import harness

STEPS = 2
BASE = [
    ("model.preset", "vlm-tiny"),
    ("train.objective", "sft"),
    ("data.path", "digits"),  # built in (scikit-learn's digits, "the digit 7"): cheap to make
    ("train.seq_len", "28"),  # 16 image tokens + "the digit 7" + its end token
    ("train.global_batch_size", "12"),
    ("train.micro_batch_size", "2"),
    ("train.dtype", "float32"),
    ("train.eval_interval", "0"),
    ("train.eval_batches", "1"),
    ("train.warmup_steps", "1"),
    ("train.lr", "2e-3"),
    ("parallel.tp", "1"),
]


def job_rows(ctx, run_dir: str, extra: list):
    cfg = config.load(None, BASE + [("run.dir", run_dir), ("train.steps", str(STEPS))] + extra)
    trainer = Trainer(cfg, ctx)
    rows = [trainer.train_step(s) for s in range(STEPS)]
    return [[r["loss"], r["grad_norm"]] for r in rows] + [[trainer.validate()]]


_REF: list = []


def reference(tmp_path_factory) -> list:
    if not _REF:
        _REF.append(harness.run(1, job_rows, str(tmp_path_factory.mktemp("vlm-ref")), [])[0])
    return _REF[0]


LAYOUTS = [
    ("dp2-zero1", 2, [("parallel.zero", "1")]),
    ("dp2-zero3", 2, [("parallel.zero", "3")]),
    ("dp3", 3, []),
    ("tp2", 2, [("parallel.tp", "2")]),
    ("pp2", 2, [("parallel.pp", "2")]),
    ("dp2-tp2", 4, [("parallel.tp", "2")]),
    ("pp2-tp2", 4, [("parallel.pp", "2"), ("parallel.tp", "2")]),
]


def assert_rows_equal(got: list, want: list, name: str) -> None:
    """Every rank's [loss, grad norm] per step and [validation loss] the same, and equal to one
    process's (shared by the SP and [modules] parity tests)."""
    assert all(g == got[0] for g in got), f"{name}: ranks disagree"
    for step, (g, w) in enumerate(zip(got[0], want, strict=True)):
        for i, (a, b) in enumerate(zip(g, w, strict=True)):
            tol = (2e-4 if i == 1 else 2e-5) * max(abs(b), 0.05)  # the norm sums more roundings
            assert abs(a - b) <= tol, f"{name} step {step} column {i}: {a} vs one process {b}"


@pytest.mark.parametrize("name,ws,extra", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_layout_equals_one_process(tmp_path_factory, name, ws, extra):
    want = reference(tmp_path_factory)
    got = harness.run(ws, job_rows, str(tmp_path_factory.mktemp(f"vlm-{name}")), extra)
    assert_rows_equal(got, want, name)
    assert want[1][0] < want[0][0], "the caption loss falls"


@pytest.mark.parametrize(
    "extra,match",
    [
        ([("parallel.cp", "2")], "parallel.cp=2 with a 'vlm' model: the image placeholders must stay whole"),
        ([("train.objective", "lm")], "train.objective=lm with a 'vlm' model"),
        ([("train.seq_len", "20")], "train.seq_len=20 is too short .* use train.seq_len=28"),
        ([("data.path", "nowhere.jsonl")], "data.path='nowhere.jsonl' is not a file"),
    ],
)
def test_plan_refuses_in_one_line(tmp_path, extra, match):
    cfg = config.load(None, BASE + [("run.dir", str(tmp_path))] + extra)
    with pytest.raises(ConfigError, match=match) as err:
        make_plan(cfg, 2, ranks=False)
    assert "\n" not in str(err.value)


def test_jsonl_of_pngs_gives_the_shapes_records(tmp_path):
    """data.path a .jsonl of {"image", "caption"} lines: the PNGs of 32 x 32 shapes images read
    back as the same pixels and tokens as the built-in records, the last tenth held out."""
    import json

    import numpy as np
    from PIL import Image

    from meshspeed.data.image_captions import load_caption_jsonl
    from meshspeed.data.shapes import shapes_task

    want = shapes_task(20, seed=3, seq_len=56)
    with open(tmp_path / "caps.jsonl", "w") as f:
        for i in range(20):
            pixels = ((want["images"][i].numpy().transpose(1, 2, 0) + 1) * 127.5).round().astype(np.uint8)
            Image.fromarray(pixels).save(tmp_path / f"{i}.png")
            caption = bytes(t for t in want["tokens"][i, 16:].tolist() if t).decode()
            f.write(json.dumps({"image": f"{i}.png", "caption": caption}) + "\n")
    train, held = load_caption_jsonl(str(tmp_path / "caps.jsonl"), 32, 16, 255, 56)
    assert len(train["tokens"]) == 18 and len(held["tokens"]) == 2
    for k in ("images", "tokens", "labels"):
        assert torch.equal(torch.cat([train[k], held[k]]), want[k]), k


def test_jsonl_questions_label_the_answer_only(tmp_path):
    """A {"image", "question", "answer"} line: placeholders, the question's bytes, the answer's
    and the end token; labels predict the answer and its end only."""
    import json

    import numpy as np
    from PIL import Image

    from meshspeed.data.image_captions import load_caption_jsonl

    Image.fromarray(np.zeros((32, 32, 3), dtype=np.uint8)).save(tmp_path / "k.png")
    with open(tmp_path / "qa.jsonl", "w") as f:
        for _ in range(2):
            f.write(json.dumps({"image": "k.png", "question": "what? ", "answer": "red"}) + "\n")
    train, _ = load_caption_jsonl(str(tmp_path / "qa.jsonl"), 32, 16, 255, 32)
    tokens, labels = train["tokens"][0].tolist(), train["labels"][0].tolist()
    assert tokens[:16] == [255] * 16 and bytes(tokens[16:25]) == b"what? red" and tokens[25] == 0
    assert [t for t in labels if t != -100] == list(b"red") + [0] and labels.index(ord("r")) == 21
