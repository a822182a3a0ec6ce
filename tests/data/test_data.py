"""The data pipeline: tokenizer, corpora (built-in, text, token files), cache, layout-independent loader."""

import os
from array import array

import pytest
import torch

from meshspeed.data import corpus as corpus_mod
from meshspeed.data.loader import (
    ByteTokenizer,
    DataError,
    GlobalBatchLoader,
    ValidationLoader,
    accumulation_steps,
    load_corpus,
    load_tokens,
)

CAP_MB = 2.0


@pytest.fixture(scope="module")
def stdlib(tmp_path_factory):
    return load_corpus("", max_mb=CAP_MB, cache_dir=str(tmp_path_factory.mktemp("cache")))


# --------------------------------------------------------------------------- tokenizer
@pytest.mark.parametrize(
    "text", ["", "hello world\n", "naïve café — 東京 🚀\x00\t", "def f():\n    return 'é'\n"]
)
def test_tokenizer_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode_tensor(text)) == text
    assert tok.encode_tensor(text).tolist() == ids


def test_tokenizer_non_ascii_is_multibyte_and_rejects_non_bytes():
    tok = ByteTokenizer()
    assert len(tok.encode("é")) == 2 and len(tok.encode("🚀")) == 4
    assert tok.decode(tok.encode("🚀")[:2]) == "\ufffd"  # a cut character is replaced, not an exception
    with pytest.raises(ValueError, match="token 300 is not a byte"):
        tok.decode([104, 300])


# --------------------------------------------------------------------------- built-in corpus
def test_stdlib_corpus_deterministic_capped_and_split_by_file(stdlib, tmp_path):
    again = load_corpus("", max_mb=CAP_MB, cache_dir=str(tmp_path))  # a fresh cache: built again
    assert again.cache_path != stdlib.cache_path
    assert torch.equal(again.train, stdlib.train) and torch.equal(again.val, stdlib.val)
    assert again.train_files == stdlib.train_files and again.val_files == stdlib.val_files
    assert stdlib.train.dtype == torch.uint8 and stdlib.vocab_size == 256
    files = stdlib.train_files + stdlib.val_files
    assert not set(stdlib.train_files) & set(stdlib.val_files)
    assert all(f.endswith(".py") and "site-packages" not in f for f in files)
    assert not any(part in ("test", "tests") for f in files for part in f.split("/"))
    assert list(stdlib.train_files) == sorted(stdlib.train_files)
    n = stdlib.train.numel() + stdlib.val.numel()
    assert CAP_MB * 1e6 <= n <= CAP_MB * 1e6 + len(files)  # the cap plus one separator per file
    assert 0.01 < stdlib.val.numel() / n < 0.05
    # the split is by file: each file's bytes sit whole in one split, followed by the separator
    root = corpus_mod.stdlib_files(CAP_MB)[0]
    take = {rel: n for rel, _, _, n in corpus_mod.stdlib_files(CAP_MB)[1]}  # the last file is cut at the cap
    contents = [open(os.path.join(root, rel), "rb").read(take[rel]) for rel in stdlib.val_files]
    assert bytes(stdlib.val.tolist()) == b"".join(c + b"\0" for c in contents)
    assert max(contents, key=len) not in bytes(stdlib.train.tolist())


def test_stdlib_corpus_cache_reused_not_rebuilt(stdlib, monkeypatch):
    path = stdlib.cache_path
    assert path and os.path.exists(path)
    mtime = os.stat(path).st_mtime_ns

    def no_rebuild(*args, **kwargs):
        raise AssertionError("the corpus was re-encoded instead of read from the cache")

    # Reuse is shown by what happened (no re-encoding, the file untouched), not by how long it
    # took: speed belongs in benchmarks/, and a loaded machine would fail a time limit.
    monkeypatch.setattr(corpus_mod, "_encode", no_rebuild)
    hit = load_corpus("", max_mb=CAP_MB, cache_dir=os.path.dirname(path))
    assert hit.cache_path == path and os.stat(path).st_mtime_ns == mtime
    assert torch.equal(hit.train, stdlib.train)
    # a different cap is a different cache entry (and a prefix of the same file list)
    monkeypatch.undo()
    small = load_corpus("", max_mb=0.5, cache_dir=os.path.dirname(path))
    assert small.cache_path != path
    assert set(small.train_files + small.val_files) < set(stdlib.train_files + stdlib.val_files)


def test_unwritable_cache_falls_back_to_memory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    c = load_corpus("", max_mb=0.2, cache_dir=str(blocker / "corpus"))
    assert c.cache_path is None and c.train.numel() + c.val.numel() >= 200_000


# --------------------------------------------------------------------------- loader
def _layout_batch(tokens, step, gbs, mbs, dp, seed=0):
    """The global batch reassembled from every dp rank in the documented order."""
    loaders = [GlobalBatchLoader(tokens, 16, gbs, mbs, r, dp, seed) for r in range(dp)]
    per_rank = [ld.batches(step) for ld in loaders]
    accum = loaders[0].accum_steps
    assert accum == gbs // (mbs * dp) and all(len(p) == accum for p in per_rank)
    parts = [per_rank[r][a] for a in range(accum) for r in range(dp)]
    assert all(x.shape == (mbs, 16) and x.dtype == torch.int64 for x, _ in parts)
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def test_global_batch_is_layout_independent(stdlib):
    ref = GlobalBatchLoader(stdlib.train, 16, 8, 8, 0, 1, seed=5)
    for step in (0, 7):
        want = ref.global_batch(step)
        for dp, mbs in [(1, 8), (1, 1), (2, 4), (2, 1), (2, 2), (4, 2), (4, 1), (8, 1)]:
            got = _layout_batch(stdlib.train, step, 8, mbs, dp, seed=5)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (step, dp, mbs)
    assert not torch.equal(ref.global_batch(0)[0], ref.global_batch(1)[0])
    other_seed = GlobalBatchLoader(stdlib.train, 16, 8, 8, 0, 1, seed=6)
    assert not torch.equal(ref.global_batch(0)[0], other_seed.global_batch(0)[0])


def test_ranks_get_disjoint_slices(stdlib):
    a = GlobalBatchLoader(stdlib.train, 16, 8, 2, 0, 2, seed=1).batches(3)
    b = GlobalBatchLoader(stdlib.train, 16, 8, 2, 1, 2, seed=1).batches(3)
    assert len(a) == 2 and not torch.equal(a[0][0], b[0][0])


def test_targets_are_inputs_shifted_by_one():
    tokens = torch.arange(1000, dtype=torch.int32)  # every window is then a run of consecutive ints
    loader = GlobalBatchLoader(tokens, 32, 4, 2, 0, 1, seed=3)
    starts = loader.window_starts(2)
    assert all(0 <= s <= 1000 - 33 for s in starts)
    x, y = loader.global_batch(2)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(x, torch.tensor(starts)[:, None] + torch.arange(32))
    assert torch.equal(y, x + 1)


def test_resume_equals_uninterrupted(stdlib):
    run = GlobalBatchLoader(stdlib.train, 16, 8, 2, 1, 2, seed=11)
    uninterrupted = [next(run) for _ in range(6)]
    assert run.state_dict() == {"step": 6}
    fresh = GlobalBatchLoader(stdlib.train, 16, 8, 2, 1, 2, seed=11)
    fresh.load_state_dict({"step": 3})
    resumed = [next(fresh) for _ in range(3)]
    from_batches = [fresh.batches(s) for s in range(3, 6)]  # pure: leaves fresh.step alone
    for want, got, got2 in zip(uninterrupted[3:], resumed, from_batches):
        for (wx, wy), (gx, gy), (hx, hy) in zip(want, got, got2):
            assert torch.equal(wx, gx) and torch.equal(wy, gy) and torch.equal(wx, hx) and torch.equal(wy, hy)
    assert fresh.state_dict() == {"step": 6}
    assert not torch.equal(uninterrupted[0][0][0], uninterrupted[3][0][0])


def test_validation_loader_fixed_and_layout_independent(stdlib):
    one = ValidationLoader(stdlib.val, 32, 8, 8, 0, 1, max_batches=3)
    assert len(one) == 3
    x0, y0 = one.global_batch(1)
    starts = one.window_starts(1)
    assert starts == [(8 + g) * 32 for g in range(8)]  # consecutive, non-overlapping
    assert torch.equal(x0[:, 1:], y0[:, :-1])
    assert torch.equal(x0[0], stdlib.val[256:288].long())
    twice = [list(one), list(one)]
    assert all(torch.equal(a[0][0], b[0][0]) for a, b in zip(*twice))
    ranks = [ValidationLoader(stdlib.val, 32, 8, 2, r, 2, max_batches=3) for r in range(2)]
    per_rank = [list(r) for r in ranks]
    for b in range(3):
        parts = [per_rank[r][b][a] for a in range(2) for r in range(2)]
        assert torch.equal(torch.cat([p[0] for p in parts]), one.global_batch(b)[0])


# --------------------------------------------------------------------------- other sources
def _write(path, typecode, values):
    with open(path, "wb") as f:
        array(typecode, values).tofile(f)  # native order: little-endian on every supported machine


@pytest.mark.parametrize(
    "fmt,typecode,dtype,high",
    [("uint16", "H", torch.uint16, 65_000), ("uint32", "I", torch.uint32, 4_000_000_000)],
)
def test_token_file_memmap(tmp_path, fmt, typecode, dtype, high):
    values = [(i * 7919) % 1000 for i in range(1000)]
    values[10] = high
    path = tmp_path / "tokens.bin"
    _write(path, typecode, values)
    c = load_corpus(str(path), fmt, val_fraction=0.1)
    train, val = load_tokens(str(path), fmt, val_fraction=0.1)
    assert torch.equal(train, c.train) and torch.equal(val, c.val)
    assert c.train.dtype == dtype and c.vocab_size is None
    assert c.train.numel() == 900 and c.val.numel() == 100
    assert c.train.long().tolist() == values[:900] and c.val.long().tolist() == values[900:]
    x, y = GlobalBatchLoader(c.train, 8, 4, 4, seed=0).global_batch(0)
    assert x.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])
    # memory-mapped, not copied: a change to the file shows through a fresh map of it
    values[0] = 123
    _write(path, typecode, values)
    assert load_corpus(str(path), fmt, val_fraction=0.1).train[0].item() == 123
    assert load_corpus(str(path), fmt, val_fraction=0.1).train[10].item() == high


def test_text_directory_and_file(tmp_path):
    d = tmp_path / "texts"
    (d / "sub").mkdir(parents=True)
    docs = {
        "a.txt": "alpha " * 50,
        "sub/b.md": "béta ✓ " * 40,
        "c.txt": "gamma\n" * 60,
        "z.txt": "zeta " * 70,
    }
    for rel, text in docs.items():
        (d / rel).write_text(text, encoding="utf-8")
    (d / ".hidden").write_text("secret")
    (d / "blob.dat").write_bytes(b"\x01\x00\x02")
    c = load_corpus(str(d), "text", val_fraction=0.2, cache_dir=str(tmp_path / "cache"))
    assert sorted(c.train_files + c.val_files) == sorted(docs) and c.val_files and c.train_files
    tok = ByteTokenizer()
    train_text = tok.decode(c.train)
    for rel in c.train_files:
        assert docs[rel] + "\0" in train_text
    assert all(docs[rel] in tok.decode(c.val) for rel in c.val_files)
    # one file: its tail is the validation split
    single = load_corpus(str(d / "a.txt"), val_fraction=0.1, cache_dir=str(tmp_path / "cache"))
    text = docs["a.txt"]
    assert tok.decode(single.train) + tok.decode(single.val) == text[:-30] + "\0" + text[-30:] + "\0"


# --------------------------------------------------------------------------- errors
def test_error_messages(tmp_path, stdlib):
    with pytest.raises(DataError, match=r"data.path='/no/such/file' does not exist"):
        load_corpus("/no/such/file")
    with pytest.raises(
        DataError, match=r"data.format='int8' is not a known format; choose one of text, uint16"
    ):
        load_corpus("", "int8")
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(
        DataError, match=r"looks like a token file but data.format=text; set data.format uint16"
    ):
        load_corpus(str(tmp_path / "odd.bin"))
    with pytest.raises(DataError, match=r"has 3 bytes, not a whole, non-zero number of uint16 tokens"):
        load_corpus(str(tmp_path / "odd.bin"), "uint16")
    with pytest.raises(DataError, match=r"needs one token file"):
        load_corpus(str(tmp_path), "uint32")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"contains no non-empty files"):
        load_corpus(str(tmp_path / "empty"))
    with pytest.raises(
        DataError, match=r"train split has 10 tokens, fewer than train.seq_len \+ 1 = 17; .*len ≤ 9"
    ):
        GlobalBatchLoader(torch.arange(10), 16, 4, 2)
    with pytest.raises(
        DataError,
        match=r"train.global_batch_size=10 is not divisible by train.micro_batch_size × "
        r"parallel.dp = 3 × 2 = 6; use train.global_batch_size=6 or 12, or "
        r"train.micro_batch_size in \{1, 5\}",
    ):
        GlobalBatchLoader(stdlib.train, 16, 10, 3, 0, 2)
    with pytest.raises(DataError, match=r"dp_rank=2 is outside parallel.dp=2"):
        GlobalBatchLoader(stdlib.train, 16, 8, 2, 2, 2)
    with pytest.raises(
        DataError,
        match=r"validation split has 100 tokens = 6 windows of train.seq_len=16, fewer "
        r"than one train.global_batch_size=8",
    ):
        ValidationLoader(torch.arange(100), 16, 8, 2)
    with pytest.raises(DataError, match=r"train.eval_batches=9 but the validation split holds 3 batches"):
        ValidationLoader(torch.arange(100), 4, 8, 2, max_batches=9)
    with pytest.raises(IndexError, match="validation batch 3 is outside 0..2"):
        ValidationLoader(torch.arange(100), 4, 8, 2).batches(3)
    assert accumulation_steps(12, 2, 3) == 2
