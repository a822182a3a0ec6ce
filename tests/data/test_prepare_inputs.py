"""`meshspeed data prepare` inputs and outputs: several inputs, JSON lines, the automatic token
width, worker processes (same bytes for any count) and the document-level validation split."""

import json
import math
import os

import pytest
import torch

from meshspeed.cli import main
from meshspeed.commands import data as data_command
from meshspeed.data import prepare
from meshspeed.data.loader import load_tokens
from meshspeed.data.prepare import DataError, prepare_tokens, sidecar_path


def _corpus(root):
    """A directory of text, a JSON-lines file of 30 records (one blank line) and a binary file."""
    os.makedirs(root / "dir" / "sub")
    for i in range(5):
        (root / "dir" / f"t{i}.txt").write_text(f"text file {i}, naïve café\n" * (i + 2))
    (root / "dir" / "sub" / "blob").write_bytes(b"\x00\x01binary")
    lines = [json.dumps({"id": k, "body": f"record {k} " + "東京 " * (k % 5)}) for k in range(30)]
    (root / "recs.jsonl").write_text("\n".join(lines[:12] + [""] + lines[12:]) + "\n")
    return [str(root / "dir"), str(root / "recs.jsonl")]


def _docs(tokens: torch.Tensor, eot: int) -> list[list[int]]:
    """Token stream → documents (each ended by eot)."""
    out, cur = [], []
    for t in tokens.tolist():
        cur.append(t)
        if t == eot:
            out.append(cur)
            cur = []
    assert cur == []  # the stream ends with an end-of-document token
    return out


def test_several_inputs_and_json_lines_records_are_documents(tmp_path):
    inputs = _corpus(tmp_path)
    out = str(tmp_path / "t.bin")
    meta = prepare_tokens(out, input=inputs, text_key="body", val_fraction=0.1)
    assert meta["format"] == "uint16" and meta["files"] == 6 and meta["skipped_binary"] == 1
    assert meta["documents"] == 5 + 30  # each text file and each (non-blank) record
    tokens = torch.from_file(out, size=meta["count"], dtype=torch.uint16).to(torch.int64)
    docs = _docs(tokens, 0)
    assert len(docs) == meta["documents"] and meta["max_id"] == int(tokens.max())
    texts = {bytes(d[:-1]).decode() for d in docs}
    assert "record 7 東京 東京 " in texts and "text file 0, naïve café\n" * 2 in texts


def test_bad_json_lines_record_is_one_line_naming_the_key(tmp_path):
    inputs = _corpus(tmp_path)
    with pytest.raises(DataError, match=r"--text-key='text'.*recs.jsonl.*--text-key") as e:
        prepare_tokens(str(tmp_path / "t.bin"), input=inputs)  # records hold "body", not "text"
    assert "\n" not in str(e.value) and not os.path.exists(tmp_path / "t.bin")


@pytest.mark.parametrize("tokenizer", ["bytes", "hf"])
def test_workers_write_the_same_bytes_in_input_order(tmp_path, monkeypatch, tokenizer):
    inputs = _corpus(tmp_path)
    spec = _word_tokenizer(tmp_path / "tok", 300) if tokenizer == "hf" else "bytes"
    monkeypatch.setattr(prepare, "UNIT_BYTES", 200)  # the JSON-lines file becomes several units
    assert len(prepare._slices("r", inputs[1], os.path.getsize(inputs[1]))) > 3
    results = []
    for n in (1, 2, 3):
        out = tmp_path / f"w{n}.bin"
        meta = prepare_tokens(str(out), input=inputs, tokenizer=spec, text_key="body", workers=n)
        results.append((out.read_bytes(), meta))
    assert results[0][1]["documents"] == 35
    for data, meta in results[1:]:
        assert data == results[0][0] and meta == results[0][1]


def _word_tokenizer(path, size: int) -> str:
    """A word-level Hugging Face tokenizer of `size` ids: the corpus' words, fillers, [UNK] and
    an end-of-text token (the last id)."""
    pytest.importorskip("tokenizers", reason="tokenizers is in the dev extra: pip install -e .[dev]")
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["text", "file", "naïve", "café", "record", "東京", ",", "0", "1", "2", "3", "4"]
    words += [f"w{i}" for i in range(size - len(words) - 2)]
    vocab = {w: i for i, w in enumerate(words + ["[UNK]", "<|endoftext|>"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    return str(path)


def test_width_is_uint16_when_the_vocabulary_fits_else_uint32(tmp_path):
    (tmp_path / "a.txt").write_text("text file 東京 record\n")
    big = _word_tokenizer(tmp_path / "big", 70_000)
    meta = prepare_tokens(str(tmp_path / "b.bin"), input=str(tmp_path / "a.txt"), tokenizer=big)
    assert (meta["format"], meta["vocab_size"], meta["eot"]) == ("uint32", 70_000, 69_999)
    ids = torch.from_file(str(tmp_path / "b.bin"), size=meta["count"], dtype=torch.uint32).tolist()
    assert ids == [0, 1, 5, 4, 69_999]
    with pytest.raises(DataError, match=r"--format=uint16 holds token ids below 65,536.*70,000.*uint32"):
        prepare_tokens(str(tmp_path / "c.bin"), "uint16", str(tmp_path / "a.txt"), tokenizer=big)
    small = _word_tokenizer(tmp_path / "small", 300)
    assert (
        prepare_tokens(str(tmp_path / "s.bin"), input=str(tmp_path / "a.txt"), tokenizer=small)["format"]
        == "uint16"
    )


@pytest.mark.parametrize("fraction", [0.1, 0.5])
def test_validation_is_the_last_whole_documents_and_the_trainer_uses_it(tmp_path, fraction):
    inputs = _corpus(tmp_path)
    out = str(tmp_path / "t.bin")
    meta = prepare_tokens(out, input=inputs, text_key="body", val_fraction=fraction)
    val = meta["validation"]
    assert val["documents"] == math.ceil(35 * fraction) and val["fraction"] == fraction
    train, held = load_tokens(out, "uint16")
    assert held.numel() == val["tokens"] and train.numel() + held.numel() == meta["count"]
    # whole documents: training ends with an end-of-document token, validation holds exactly
    # val["documents"] of them, the last of the file
    assert int(train[-1]) == 0 and len(_docs(held.to(torch.int64), 0)) == val["documents"]
    everything = _docs(torch.cat([train, held]).to(torch.int64), 0)
    assert _docs(held.to(torch.int64), 0) == everything[-val["documents"] :]


def test_one_document_or_no_split_leaves_the_token_tail_rule(tmp_path):
    (tmp_path / "a.txt").write_text("x" * 999)
    meta = prepare_tokens(str(tmp_path / "a.bin"), input=str(tmp_path / "a.txt"), val_fraction=0.1)
    assert meta["validation"] == {"fraction": 0.1, "documents": 0, "tokens": 0}
    train, val = load_tokens(str(tmp_path / "a.bin"), "uint16")
    assert val.numel() == math.ceil(1000 * 0.02) and train.numel() == 1000 - val.numel()


def test_cli_several_inputs_workers_and_bad_values(tmp_path, monkeypatch, capsys):
    inputs = _corpus(tmp_path)
    monkeypatch.chdir(tmp_path)
    argv = ["data", "prepare", "--out", "t.bin", "--input", inputs[0], "--input", inputs[1]]
    assert main([*argv, "--text-key", "body", "--workers", "2", "--val-fraction", "0.2"]) == 0
    side = json.load(open(sidecar_path("t.bin")))
    assert side["documents"] == 35 and side["validation"]["documents"] == 7
    assert "--data.format uint16" in capsys.readouterr().out
    monkeypatch.setattr(data_command, "PROGRESS_MIN_BYTES", 1)  # as if the input were large
    assert main([*argv, "--text-key", "body", "--out", "p.bin"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("\r") and err.count("\n") == 1 and err.rstrip().split("\r")[-1].startswith("100%")
    for bad, words in [
        (["--workers", "0"], "--workers=0 must be a positive integer"),
        (["--workers", "many"], "--workers='many' must be a positive integer"),
        (["--val-fraction", "1"], "--val-fraction='1' must be < 1"),
        (["--val-fraction", "x"], "--val-fraction='x' is not a number"),
        (["--format", "int8"], "--format='int8' is not a token file format; use auto"),
    ]:
        assert main([*argv, "--text-key", "body", *bad]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err and "Traceback" not in err


def test_progress_is_reported_per_unit_up_to_the_total(tmp_path):
    inputs = _corpus(tmp_path)
    seen = []
    prepare_tokens(str(tmp_path / "t.bin"), input=inputs, text_key="body", progress=lambda *a: seen.append(a))
    assert len(seen) == 7 and seen[-1][0] == seen[-1][1] == sum(os.path.getsize(p) for p in _files(tmp_path))
    assert [s[0] for s in seen] == sorted(s[0] for s in seen)


def _files(root):
    return [os.path.join(d, n) for d, _, names in os.walk(root) for n in names if not n.startswith("t.bin")]
