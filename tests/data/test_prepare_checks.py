"""Training checks a token file before anything starts (issue 10 item 2, issue 16 item 4):
format, tokenizer and vocabulary against the sidecar, and every id below the model's vocabulary,
for files with and without a sidecar, in one line, at every tp degree. And the acceptance run:
prepare a directory of text with a Hugging Face tokenizer, then train on it."""

import json
import os
import sys

import pytest
import torch

from meshspeed import cli
from meshspeed.comm import launch
from meshspeed.data import loader as data_mod
from meshspeed.data.loader import DataError, check_token_data
from meshspeed.data.prepare import prepare_tokens
from tests import cli_batch, warm

WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far", "."]
SMALL = ["--train.seq_len", "16", "--train.global_batch_size", "4", "--train.micro_batch_size", "2"]


@pytest.fixture
def texts(tmp_path):
    """40 short documents of WORDS in a directory, and a word-level tokenizer for them (vocab 13)."""
    os.makedirs(tmp_path / "texts")
    for i in range(40):
        words = [WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(30 + i % 7)]
        (tmp_path / "texts" / f"doc{i:02d}.txt").write_text(" ".join(words) + "\n")
    _word_tokenizer(tmp_path / "tok", len(WORDS) + 2)
    return tmp_path


@pytest.fixture
def no_workers(monkeypatch):
    def spawn(*a, **k):
        raise AssertionError("a worker was spawned")

    monkeypatch.setattr(launch, "spawn", spawn)
    monkeypatch.setattr(launch, "run_worker", spawn)


def test_sidecar_mismatches_are_one_line_naming_the_file(texts):
    out, tok = str(texts / "t.bin"), str(texts / "tok")
    meta = prepare_tokens(out, input=str(texts / "texts"), tokenizer=tok)
    assert (meta["format"], meta["vocab_size"], meta["max_id"]) == ("uint16", 13, 12)
    check_token_data(out, "uint16", 13, tok)  # what it was made with: accepted
    check_token_data(out, "uint16", 64, tok)  # a padded vocabulary too
    cases = [
        (("uint32", 13, tok), "data.format=uint32 but data.path=.*holds uint16 tokens.*--data.format uint16"),
        (("uint16", 13, "bytes"), "data.tokenizer='bytes' but data.path=.*was tokenized with .*tok"),
        (("uint16", 12, tok), "13-token vocabulary .*vocab_size is 12; use a model with vocab_size ≥ 13"),
    ]
    for args, pattern in cases:
        with pytest.raises(DataError, match=pattern) as e:
            check_token_data(out, *args)
        assert "\n" not in str(e.value) and "t.bin" in str(e.value)
    # another tokenizer of the same size is still another tokenizer (compared by content)
    other = json.load(open(texts / "tok" / "tokenizer.json"))
    other["model"]["vocab"] = {w: 12 - i for w, i in other["model"]["vocab"].items()}
    (texts / "other").mkdir()
    json.dump(other, open(texts / "other" / "tokenizer.json", "w"))
    with pytest.raises(DataError, match="was tokenized with"):
        check_token_data(out, "uint16", 13, str(texts / "other"))
    with open(out, "ab") as f:  # the file changed after its sidecar was written
        f.write(b"\0\0")
    with pytest.raises(DataError, match=r"holds 1,\d+ tokens but .*json says .*stale"):
        check_token_data(out, "uint16", 13, tok)


@pytest.mark.parametrize("fmt, dtype", [("uint16", torch.uint16), ("uint32", torch.uint32)])
def test_raw_file_is_scanned_once_for_its_largest_id(tmp_path, monkeypatch, fmt, dtype):
    path, cache = str(tmp_path / "raw.bin"), str(tmp_path / "cache")
    ids = torch.randint(0, 256, (5000,), generator=torch.Generator().manual_seed(0))
    ids[3777] = 300
    ids.to(dtype).numpy().tofile(path)
    monkeypatch.setattr(data_mod, "_SCAN_TOKENS", 1000)  # several chunks; 300 is in the fourth
    with pytest.raises(
        DataError, match=r"raw.bin' holds token id 300 but the model's vocab_size is 256"
    ) as e:
        check_token_data(path, fmt, 256, cache_dir=cache)
    assert "\n" not in str(e.value) and "vocab_size ≥ 301" in str(e.value)
    check_token_data(path, fmt, 301, cache_dir=cache)

    def no_scan(*a, **k):
        raise AssertionError("scanned again")

    monkeypatch.setattr(data_mod.torch, "from_file", no_scan)
    with pytest.raises(DataError, match="holds token id 300"):  # from the cache
        check_token_data(path, fmt, 256, cache_dir=cache)
    monkeypatch.undo()
    ids[3777] = 7
    ids.to(dtype).numpy().tofile(path)
    os.utime(path, ns=(1, 1))  # a new mtime: a new scan
    check_token_data(path, fmt, 256, cache_dir=cache)


def test_text_data_and_missing_files_pass_through(tmp_path):
    check_token_data("", "text", 256)
    check_token_data(str(tmp_path / "nowhere.bin"), "uint16", 256)  # load_corpus words that error


@pytest.mark.parametrize("tp", [1, 2])
def test_id_beyond_the_vocabulary_stops_training_in_one_line(tmp_path, capsys, no_workers, tp):
    path = tmp_path / "raw.bin"
    ids = torch.arange(2000) % 256
    ids[1500] = 40_000
    ids.to(torch.uint16).numpy().tofile(str(path))
    args = ["--nproc", str(tp), "--parallel.tp", str(tp), "--data.path", str(path), "--data.format", "uint16"]
    rc = cli.main(["train", *SMALL, *args, "--run.dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc != 0 and err.count("\n") == 1 and "Traceback" not in err
    assert "raw.bin' holds token id 40,000 but the model's vocab_size is 256" in err


def _train(args, cwd):
    return warm.run(
        [sys.executable, "-m", "meshspeed", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "MESHSPEED_CACHE_DIR": str(cwd / "cache")},
    )


@pytest.mark.slow  # a real 4-worker training run after the prepare (70 s on 2 cores)
def test_prepare_a_text_directory_then_train_on_it(texts):
    """The acceptance run, through the command line as a user types it: the tiny preset's
    vocabulary (256) holds the tokenizer's 13 ids."""
    tok = str(texts / "tok")
    argv = ["data", "prepare", "--input", "texts", "--tokenizer", tok, "--out", "tokens.bin"]
    out = _train([*argv, "--val-fraction", "0.1"], texts)
    assert out.returncode == 0, out.stderr
    side = json.load(open(texts / "tokens.bin.json"))
    assert side["format"] == "uint16" and side["documents"] == 40 and side["validation"]["documents"] == 4
    common = [*SMALL, "--nproc", "1", "--parallel.tp", "1", "--data.format", "uint16"]
    common += ["--train.eval_batches", "1", "--train.steps", "2"]
    run = _train(
        ["train", *common, "--data.path", "tokens.bin", "--data.tokenizer", tok, "--run.dir", "r"], texts
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in open(texts / "r" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1] and all(0 < r["loss"] < 10 for r in rows)
    # a tokenizer of 300 ids, more than the model's 256: one line, non-zero exit, nothing trained
    big = _word_tokenizer(texts / "big", 300)
    # prepare, then the two refused trainings, in one interpreter (tests/cli_batch.py)
    env = {**os.environ, "MESHSPEED_CACHE_DIR": str(texts / "cache")}
    argvs = [["data", "prepare", "--input", "texts", "--tokenizer", big, "--out", "big.bin"]]
    for tok_args in (["--data.tokenizer", big], []):  # named, or left at bytes: refused either way
        argvs.append(["train", *common, "--data.path", "big.bin", *tok_args, "--run.dir", "bad"])
    out, *bads = cli_batch.run_many(argvs, texts, env=env)
    assert out.returncode == 0 and json.load(open(texts / "big.bin.json"))["vocab_size"] == 300
    for bad in bads:
        assert bad.returncode != 0 and "Traceback" not in bad.stderr, bad.stderr
        assert bad.stderr.strip().count("\n") == 0 and "big" in bad.stderr
        assert not os.path.exists(texts / "bad" / "metrics.jsonl")
    assert "has 300 tokens but the model's vocab_size is 256" in bads[0].stderr


def _word_tokenizer(path, size: int) -> str:
    """A word-level tokenizer of `size` ids: WORDS, fillers, [UNK], and an end-of-text token."""
    pytest.importorskip("tokenizers", reason="tokenizers is in the dev extra: pip install -e .[dev]")
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = WORDS + [f"w{i}" for i in range(size - len(WORDS) - 2)]
    vocab = {w: i for i, w in enumerate(words + ["[UNK]", "<|endoftext|>"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    return str(path)


def test_readme_llama3_8b_commands_agree_with_the_preset(tmp_path, monkeypatch, capsys, no_workers):
    """README: prepare with a 128K-class tokenizer (auto → uint32, what llama3-8b.toml reads),
    then the preset's run plan on 8 ranks accepts the file, and refuses it without the tokenizer."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus").mkdir()
    for i in range(3):
        (tmp_path / "corpus" / f"{i}.txt").write_text("the cat sat on a mat . " * (i + 1))
    tok = _word_tokenizer(tmp_path / "llama", 70_000)
    assert (
        cli.main(["data", "prepare", "--input", "corpus", "--tokenizer", tok, "--out", "data/tokens.bin"])
        == 0
    )
    assert json.load(open("data/tokens.bin.json"))["format"] == "uint32"
    toml = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "llama3-8b.toml")
    run = ["train", "--config", toml, "--nproc", "8", "--dry-run"]
    capsys.readouterr()
    assert cli.main([*run, "--data.tokenizer", tok]) == 0, capsys.readouterr().err
    assert cli.main(run) != 0
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1 and "data.tokenizer='bytes' but data.path='data/tokens.bin' was tokenized" in err
    )
