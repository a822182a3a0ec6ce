"""`meshspeed eval` on data too small for its validation split (issue 44, item 4): eval scores
only the split (a lone file's last 2%), ~400 KB of text with the default settings. A 14.6 KB or
216 KB notes file was refused by a worker after 4 workers had started (~19 s); now one line,
before any worker, naming the size needed and the smaller settings the file holds."""

from __future__ import annotations

import pytest

from meshspeed import cli
from meshspeed.comm import launch
from tests.interop.test_hf import make_hf

LAYOUT = ["--nproc", "1", "--parallel.tp", "1"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("hf") / "llama")
    make_hf("llama-tied", d, vocab_size=260, max_position_embeddings=128)  # bytes; seq_len 128
    return d


def _notes(tmp_path, size: int) -> str:
    line = b"meeting notes: the planner ranks layouts by predicted step time.\n"
    (tmp_path / "notes.txt").write_bytes((line * (size // len(line) + 1))[:size])
    return str(tmp_path / "notes.txt")


@pytest.mark.parametrize(
    "size, extra, tail",
    [
        (
            14_600,
            [],
            " need 8,193 tokens (a file of about 408 KB); give more data, or use --train.seq_len 18 ",
        ),
        (14_600, ["--train.seq_len", "32"], "use --train.global_batch_size 8 --train.eval_batches 1 (what"),
        (
            216_000,
            [],
            "holds 4,321 tokens = 33 sequences of train.seq_len=128, and train.eval_batches=4 × "
            "train.global_batch_size=16 = 64 sequences need 8,193 tokens (a file of about 410 KB); give more "
            "data, or use --train.eval_batches 2 (what this data holds)",
        ),
    ],
    ids=["14.6KB", "14.6KB-seq32", "216KB"],
)
def test_too_little_data_for_eval_is_one_line_before_any_worker(
    hf_dir, tmp_path, monkeypatch, capsys, size, extra, tail
):
    monkeypatch.setattr(launch, "spawn", lambda *a, **k: pytest.fail("a worker was started"))
    path = _notes(tmp_path, size)
    argv = ["eval", "--checkpoint", hf_dir, "--data.path", path, *LAYOUT]
    argv += ["--train.global_batch_size", "16", "--train.micro_batch_size", "4", *extra]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(
        f"meshspeed eval: data.path={path!r} is too small to evaluate"
    ), err
    assert tail in err, err


def test_data_that_holds_the_batches_goes_on_to_the_workers(hf_dir, tmp_path, monkeypatch):
    """The suggested settings are ones eval accepts: the check passes and the workers start."""
    started = []
    monkeypatch.setattr(launch, "spawn", lambda *a, **k: started.append(a) or 0)
    path = _notes(tmp_path, 216_000)
    argv = ["eval", "--checkpoint", hf_dir, "--data.path", path, *LAYOUT]
    argv += ["--train.global_batch_size", "8", "--train.micro_batch_size", "4", "--train.eval_batches", "4"]
    assert cli.main(argv) == 0 and len(started) == 1
