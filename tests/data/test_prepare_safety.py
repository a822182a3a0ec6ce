"""`meshspeed data prepare` never loses a file and its sidecar is checked, not believed (issue 31,
items 1, 5 and 6): an --out it did not write is replaced only with --overwrite; the token file
and its sidecar are written under temporary names and renamed when complete, so a SIGKILL
leaves the previous pair whole (and the next run removes the leftover, saying so); the sidecar
records the file's size and SHA-256 and training checks the largest id against the file itself;
a sidecar or an input record of the wrong shape is one line naming the file."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from meshspeed.data.corpus import read_sidecar
from meshspeed.data.loader import DataError, check_token_data
from meshspeed.data.prepare import prepare_tokens
from tests import warm
from tests.cli_batch import ROOT, run_many
from tests.faults.procs import env


def _sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture
def text(tmp_path):
    (tmp_path / "in.txt").write_text("hello world, " * 400)
    return tmp_path / "in.txt"


def test_an_out_it_did_not_write_is_replaced_only_with_overwrite(tmp_path, text):
    out = tmp_path / "mine.bin"
    out.write_bytes(b"my own precious file")
    base = ["data", "prepare", "--input", str(text), "--out", str(out)]
    refused, forced, again = run_many([base, base + ["--overwrite"], base], tmp_path)
    assert refused.returncode == 2, refused.stderr
    line = refused.stderr.strip()
    assert "\n" not in line and "--overwrite" in line
    assert "was not written by `meshspeed data prepare`" in line
    assert forced.returncode == 0, forced.stderr
    assert again.returncode == 0, again.stderr  # its own output (the sidecar describes it): replaced
    assert sorted(os.listdir(tmp_path)) == ["in.txt", "mine.bin", "mine.bin.json"]


def test_sidecar_records_the_file_and_a_changed_token_is_refused(tmp_path, text):
    out = str(tmp_path / "t.bin")
    meta = prepare_tokens(out, input=str(text))
    assert meta["bytes"] == os.path.getsize(out) and meta["sha256"] == _sha(out)
    check_token_data(out, "uint16", 256, cache_dir=str(tmp_path / "cache"))
    ids = torch.from_file(out, shared=False, size=meta["count"], dtype=torch.uint16).clone()
    ids[100] = 300  # past the byte vocabulary; same size, same count, the sidecar untouched
    ids.numpy().tofile(out)
    with pytest.raises(DataError, match=r"does not match its sidecar .*largest id is 300, not") as e:
        check_token_data(out, "uint16", 256, cache_dir=str(tmp_path / "cache"))
    assert "\n" not in str(e.value)
    side = json.load(open(out + ".json"))
    for key in ("sha256", "bytes"):  # a sidecar from before the digest: the scan still finds 300
        side.pop(key)
    json.dump(side, open(out + ".json", "w"))
    with pytest.raises(DataError, match="largest id is 300"):
        check_token_data(out, "uint16", 256, cache_dir=str(tmp_path / "cache2"))


def _side(**change) -> str:
    good = {"format": "uint16", "count": 12, "max_id": 1, "vocab_size": 256, "tokenizer": "bytes"}
    return json.dumps({**good, **change})


@pytest.mark.parametrize(
    "body, needle",
    [
        ("[1, 2, 3]", "holds a JSON list, not an object"),
        (_side(count="12"), "count='12'"),
        (_side(max_id=-1), "max_id=-1"),
        (_side(format="int8"), "format='int8'"),
        (_side(vocab_size=True), "vocab_size=True"),
        ("{" * 100_000, "unreadable"),
    ],
)
def test_a_sidecar_of_the_wrong_shape_is_one_line_naming_it(tmp_path, body, needle):
    path = tmp_path / "t.bin"
    path.write_bytes(b"\0\1" * 12)
    (tmp_path / "t.bin.json").write_text(body)
    with pytest.raises(DataError) as e:
        read_sidecar(str(path))
    assert needle in str(e.value) and "t.bin.json" in str(e.value) and "\n" not in str(e.value)


def test_hostile_inputs_and_numbers_are_one_line(tmp_path):
    deep = tmp_path / "deep.jsonl"
    deep.write_text('{"text": "fine"}\n' + "[" * 200_000 + "\n")
    out = str(tmp_path / "o.bin")
    base = ["data", "prepare", "--out", out]
    cases = [
        (base + ["--input", str(deep)], "is not a JSON object with a string 'text'"),
        (base + ["--max-mb", "inf"], "--max-mb='inf' is not a number"),
        (base + ["--max-mb", "nan"], "--max-mb='nan' is not a number"),
        (base + ["--val-fraction", "nan"], "--val-fraction='nan' is not a number"),
        (base + ["--workers", "0"], "--workers=0 must be a positive integer"),
    ]
    for (argv, needle), r in zip(cases, run_many([c[0] for c in cases], tmp_path)):
        assert r.returncode == 2, (argv, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], (argv, r.stderr)
    assert not os.path.exists(out)


def test_sigkill_mid_prepare_leaves_the_previous_pair_whole(tmp_path):
    big = tmp_path / "big.txt"
    big.write_text("the quick brown fox jumps over the lazy dog\n" * 400_000)  # ~18 MB
    out = tmp_path / "t.bin"
    argv = ["data", "prepare", "--input", str(big), "--out", str(out)]
    (first,) = run_many([argv + ["--max-mb", "1"]], tmp_path)
    assert first.returncode == 0, first.stderr
    before = (_sha(out), _sha(str(out) + ".json"))
    seen = set(os.listdir(tmp_path))
    cmd = [sys.executable, "-m", "meshspeed", "data", "prepare", "--input", str(big), "--out", str(out)]
    proc = warm.popen(
        cmd + ["--workers", "1"], env={**env(), "PYTHONPATH": ROOT}, cwd=tmp_path,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 240
    try:
        while set(os.listdir(tmp_path)) == seen and proc.poll() is None:
            assert time.monotonic() < deadline, "prepare never started writing"
            time.sleep(0.005)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert (_sha(out), _sha(str(out) + ".json")) == before, "an interrupted prepare changed the previous file"
    leftovers = sorted(set(os.listdir(tmp_path)) - seen)
    (again,) = run_many([cmd[3:] + ["--max-mb", "2"]], tmp_path)
    assert again.returncode == 0, again.stderr
    if leftovers:
        assert "left by an interrupted write" in again.stderr, (leftovers, again.stderr)
    assert sorted(os.listdir(tmp_path)) == sorted(seen)
    check_token_data(str(out), "uint16", 256, cache_dir=str(tmp_path / "cache"))
