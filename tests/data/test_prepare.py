"""`meshspeed data prepare`: text -> token file + sidecar that the trainer's loader reads back."""

import json
import os

import pytest
import torch

from meshspeed.cli import main
from meshspeed.data.loader import load_corpus, load_tokens
from meshspeed.data.prepare import DataError, prepare_tokens, sidecar_path
from meshspeed.data.tokenizer import load_tokenizer
from meshspeed.plan import config as config_mod

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _texts(root):
    """A small text tree: nested files, a hidden file and a binary file (both skipped)."""
    os.makedirs(root / "sub")
    for i in range(6):
        (root / f"doc{i}.txt").write_text(f"document {i}: naïve café 東京\n" * (i + 1))
    (root / "sub" / "deep.py").write_text("def f():\n    return 1\n")
    (root / ".hidden").write_text("never read\n")
    (root / "blob.bin").write_bytes(b"\x00\x01\x02binary")
    return root


def _read(path, fmt):
    train, val = load_tokens(str(path), fmt)
    return torch.cat([train, val]).to(torch.int64)


@pytest.mark.parametrize("fmt", ["uint32", "uint16"])
def test_directory_round_trips_through_the_trainers_loader(tmp_path, fmt):
    src = _texts(tmp_path / "texts")
    out = tmp_path / "data" / "tokens.bin"  # the parent folder is created
    meta = prepare_tokens(str(out), fmt, str(src))
    side = json.loads(open(sidecar_path(str(out))).read())
    assert side == meta
    assert (side["tokenizer"], side["vocab_size"], side["format"]) == ("bytes", 256, fmt)
    assert (side["files"], side["skipped_binary"]) == (7, 1)
    tokens = _read(out, fmt)
    assert tokens.numel() == side["count"] == os.path.getsize(out) // {"uint32": 4, "uint16": 2}[fmt]
    # the same tokens the trainer reads from the text directory: its train split, then its
    # validation files last (so the token file's validation tail comes from validation files)
    text = load_corpus(str(src), "text", cache_dir=str(tmp_path / "cache"))
    assert torch.equal(tokens, torch.cat([text.train, text.val]).to(torch.int64))


def test_default_is_the_trainers_builtin_corpus(tmp_path):
    out = tmp_path / "tokens.bin"
    meta = prepare_tokens(str(out), max_mb=0.05)
    text = load_corpus("", "text", max_mb=0.05, cache_dir=str(tmp_path / "cache"))
    tokens = _read(out, meta["format"])  # auto: 256 ids fit uint16
    assert meta["format"] == "uint16" and tokens.numel() == meta["count"] and meta["vocab_size"] == 256
    assert torch.equal(tokens, torch.cat([text.train, text.val]).to(torch.int64))


def _hf_tokenizer(path):
    """A tiny word-level Hugging Face tokenizer with an end-of-text token (trained in memory)."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    words = ["document", "naïve", "café", "東京", "def", "f", "return", "1", ":", "(", ")"]
    trainer = tokenizers.trainers.WordLevelTrainer(special_tokens=["[UNK]", "<|endoftext|>"])
    tok.train_from_iterator([" ".join(words)] * 2, trainer)
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    return str(path)


def test_hugging_face_tokenizer_matches_the_trainers_retokenized_text(tmp_path):
    src = _texts(tmp_path / "texts")
    spec = _hf_tokenizer(tmp_path / "tok")
    meta = prepare_tokens(str(tmp_path / "t.bin"), "uint16", str(src), tokenizer=spec)
    assert meta["tokenizer"] == spec and meta["eot"] == 1 and meta["vocab_size"] > 2
    tokens = _read(tmp_path / "t.bin", "uint16")
    assert tokens.numel() == meta["count"] and int((tokens == 1).sum()) == meta["files"] == 7
    tok = load_tokenizer(spec)
    train, val = load_tokens(str(src), "text", cache_dir=str(tmp_path / "cache"), tokenizer=tok)
    assert torch.equal(tokens, torch.cat([train, val]).to(torch.int64))


def test_single_file_cap_and_rerun_skips_own_output(tmp_path):
    (tmp_path / "a.txt").write_text("x" * 5000)
    meta = prepare_tokens(str(tmp_path / "t.bin"), "uint32", str(tmp_path / "a.txt"), max_mb=0.001)
    assert meta["count"] == 1001  # 1000 bytes + the separator
    assert _read(tmp_path / "t.bin", "uint32")[-1] == 0
    # --input holding --out and its sidecar: they are not read back as text
    again = prepare_tokens(str(tmp_path / "t.bin"), "uint32", str(tmp_path))
    assert again["files"] == 1 and again["count"] == 5001


def test_llama3_8b_preset_reads_the_prepared_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["data", "prepare", "--out", "data/tokens.bin", "--format", "uint32", "--max-mb", "0.02"]
    assert main(argv) == 0
    cfg = config_mod.load(os.path.join(REPO, "configs", "llama3-8b.toml"), {})
    train, val = load_tokens(cfg.data.path, cfg.data.format)
    assert (
        train.dtype == torch.uint32
        and train.numel() + val.numel() == json.load(open("data/tokens.bin.json"))["count"]
    )


@pytest.mark.parametrize(
    "argv, words",
    [
        ([], ["--out is missing", "data/tokens.bin"]),
        (["--out", "t.bin", "--format", "int8"], ["--format='int8'", "uint32"]),
        (["--out", "t.bin", "--input", "nowhere"], ["--input='nowhere'", "does not exist", "text file"]),
        (["--out", "t.bin", "--max-mb", "lots"], ["--max-mb='lots'", "e.g. 8"]),
        (["--out", "t.bin", "--max-mb", "-1"], ["--max-mb='-1'", "≥ 0"]),
        (["--out", "."], ["--out='.'", "e.g. data/tokens.bin"]),
        (["--out", "t.bin", "--input", "empty"], ["--input='empty'", "no non-empty files"]),
        (["--out", "t.bin", "--input", "blob.bin"], ["--input='blob.bin'", "NUL bytes", "text files"]),
        (["--out", "t.bin", "--tokenizer", "nowhere"], ["--tokenizer='nowhere'", "tokenizer.json"]),
    ],
)
def test_bad_input_is_one_line_naming_the_flag(tmp_path, monkeypatch, capsys, argv, words):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    (tmp_path / "blob.bin").write_bytes(b"\x00" * 8)
    assert main(["data", "prepare", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("meshspeed data prepare: ") and "Traceback" not in err
    for w in words:
        assert w in err
    assert not os.path.exists(tmp_path / "t.bin")


def test_unwritable_out_is_a_data_error(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(DataError, match=r"--out=.*cannot be written"):
        prepare_tokens(str(tmp_path / "file" / "t.bin"), max_mb=0.001)
