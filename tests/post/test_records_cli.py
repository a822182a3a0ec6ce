"""`meshspeed data prepare --kind chat|pairs|arith` and `load_records`: what is written reads back
exactly, the arithmetic task is deterministic and held out by question, and mistakes are one line."""

from __future__ import annotations

import json
import re

import pytest
import torch

from meshspeed.cli import main
from meshspeed.data.arith import N_QUESTIONS, arith_records, near_miss, question
from meshspeed.data.chat import load_chat_split, load_pairs_split
from meshspeed.data.corpus import DataError
from meshspeed.data.record_file import load_records
from meshspeed.data.tokenizer import ByteTokenizer


def _read(path) -> list[dict]:
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def q(recs) -> set[str]:
    """The questions of SFT or pair records."""
    return {r["messages"][0]["content"] if "messages" in r else r["prompt"][0]["content"] for r in recs}


@pytest.fixture(scope="module")
def arith_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("arith") / "task"
    assert (
        main(["data", "prepare", "--kind", "arith", "--out", str(out), "--count", "300", "--seed", "7"]) == 0
    )
    return out


def test_arith_files_are_deterministic_and_held_out_by_question(arith_dir, tmp_path):
    again = tmp_path / "again"
    assert (
        main(["data", "prepare", "--kind", "arith", "--out", str(again), "--count", "300", "--seed", "7"])
        == 0
    )
    for name in ("sft.train.jsonl", "sft.val.jsonl", "pairs.train.jsonl", "pairs.val.jsonl"):
        assert (arith_dir / name).read_bytes() == (again / name).read_bytes(), name
    train, val = q(_read(arith_dir / "sft.train.jsonl")), q(_read(arith_dir / "sft.val.jsonl"))
    assert len(train) == 270 and len(val) == 30 and not train & val
    assert (
        q(_read(arith_dir / "pairs.val.jsonl")) == val and q(_read(arith_dir / "pairs.train.jsonl")) == train
    )
    for r in _read(arith_dir / "pairs.train.jsonl"):
        a, op, b = re.fullmatch(r"What is (\d+)([+-])(\d+)\?", r["prompt"][0]["content"]).groups()
        right = int(a) + int(b) if op == "+" else int(a) - int(b)
        assert r["chosen"][0]["content"] == str(right)
        miss = int(r["rejected"][0]["content"])
        assert miss != right and miss >= 0


def test_every_question_is_distinct_and_right():
    seen = set()
    for i in range(0, N_QUESTIONS, 7):
        text, ans = question(i)
        a, op, b = re.fullmatch(r"What is (\d+)([+-])(\d+)\?", text).groups()
        assert ans == (int(a) + int(b) if op == "+" else int(a) - int(b)) >= 0
        seen.add(text)
    assert len(seen) == len(range(0, N_QUESTIONS, 7))
    import random

    rng = random.Random(0)
    assert all(near_miss(0, rng) > 0 for _ in range(20))
    with pytest.raises(DataError, match=r"--count=1 must be an integer in \[2, 15050\]"):
        arith_records(1)


@pytest.mark.parametrize("kind, packing", [("chat", False), ("chat", True), ("pairs", False)])
def test_prepared_records_read_back_exactly(arith_dir, tmp_path, kind, packing):
    src = arith_dir / ("sft.train.jsonl" if kind == "chat" else "pairs.train.jsonl")
    out = tmp_path / f"{kind}.safetensors"
    argv = ["data", "prepare", "--kind", kind, "--input", str(src), "--seq-len", "48", "--out", str(out)]
    assert main(argv + (["--packing"] if packing else [])) == 0
    rec = load_records(str(out))
    tok = ByteTokenizer()
    if kind == "chat":
        want = load_chat_split(str(src), tok, 48, packing=packing)
    else:
        want = load_pairs_split(str(src), tok, 48)
    assert rec.kind == kind and rec.meta["seq_len"] == 48 and rec.meta["pad_id"] == 0
    assert rec.meta["end_of_turn_id"] == 0 and rec.meta["packing"] == packing
    for got, exp in zip((rec.train, rec.val), want):
        assert set(got) == set(exp)
        for k in exp:
            assert got[k].dtype == torch.int64 and torch.equal(got[k], exp[k]), k


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--kind", "chat"], "--seq-len=None: --kind chat needs the row length"),
        (["--kind", "pairs", "--seq-len", "32", "--packing"], "--packing applies to --kind chat only"),
        (["--kind", "chat", "--seq-len", "1"], "seq_len=1 must be an integer ≥ 2"),
        (["--kind", "rows"], "--kind='rows' is not known"),
    ],
)
def test_prepare_mistakes_are_one_line(arith_dir, tmp_path, capsys, extra, needle):
    src = str(arith_dir / "pairs.train.jsonl")
    assert main(["data", "prepare", "--input", src, "--out", str(tmp_path / "o.st"), *extra]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_load_records_refuses_other_files(tmp_path):
    from safetensors.torch import save_file

    other = tmp_path / "images.safetensors"
    save_file({"images": torch.zeros(2, 3)}, str(other), metadata={"format": "x"})
    with pytest.raises(DataError, match="was not written by `meshspeed data prepare --kind chat|pairs`"):
        load_records(str(other))
    junk = tmp_path / "junk.st"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(DataError, match="is not a prepared record file"):
        load_records(str(junk))


def test_check_records_names_what_does_not_fit_the_run(arith_dir, tmp_path):
    from meshspeed.data.record_file import check_records

    out = tmp_path / "pairs.safetensors"
    src = str(arith_dir / "pairs.train.jsonl")
    assert (
        main(["data", "prepare", "--kind", "pairs", "--input", src, "--seq-len", "40", "--out", str(out)])
        == 0
    )
    rf = load_records(str(out))
    check_records(rf, objective="dpo", tokenizer=ByteTokenizer(), seq_len=40, vocab_size=256)
    for kwargs, needle in [
        ({"objective": "sft"}, "holds pairs records but train.objective='sft' reads chat records"),
        ({"seq_len": 64}, "holds rows of 40 tokens but the run's seq_len is 64"),
        ({"vocab_size": 128}, "a 256-token vocabulary but the model's vocab_size is 128"),
    ]:
        with pytest.raises(DataError, match=re.escape(needle)):
            check_records(rf, **kwargs)
