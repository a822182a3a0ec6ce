"""`meshspeed generate --image FILE --prompt TEXT` on a vlm checkpoint: tp 2 and dp 2 give one
process's ids (the workers' answer() in the pooled gloo harness), the command prints the
answer, the image goes in as the training records' pixels, and bad input is one line before any
worker starts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from meshspeed.cli import main
from meshspeed.plan import config
from meshspeed.train.trainer import Trainer
from tests import harness

PIL = pytest.importorskip("PIL.Image")
BASE = [
    ("model.preset", "vlm-tiny"),
    ("train.objective", "sft"),
    ("data.path", "digits"),
    ("train.seq_len", "28"),
    ("train.global_batch_size", "8"),
    ("train.micro_batch_size", "8"),
    ("train.steps", "3"),
    ("train.lr", "3e-3"),
    ("train.warmup_steps", "1"),
    ("parallel.tp", "1"),
]


def job_checkpoint(ctx, run_dir: str) -> str:
    """A vlm-tiny checkpoint at its seeded init: its greedy tokens spread over the whole
    vocabulary (a trained one picks ASCII bytes, all in tp rank 0's half of the logits, where a
    tp bug comparing only local logits would pass)."""
    return Trainer(config.load(None, BASE + [("run.dir", run_dir)]), ctx)._save(0)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("vlm-run"))
    harness.run(1, job_checkpoint, d)
    return d


@pytest.fixture(scope="module")
def png(tmp_path_factory):
    from meshspeed.data.shapes import shape_captions

    images, _ = shape_captions(1, seed=3)
    path = str(tmp_path_factory.mktemp("img") / "shape.png")
    pixels = ((images[0].transpose(1, 2, 0) + 1) * 127.5).round().astype(np.uint8)
    PIL.fromarray(pixels).save(path)
    return path, torch.from_numpy(images[0])


def job_answer(ctx, job: dict):
    from meshspeed.infer.vlm_generate import answer

    return answer(job, ctx)


def make_job(run_dir, image, **kw):
    from meshspeed.infer.vlm_generate import resolve

    opts = dict(checkpoint=run_dir, image=image, prompt=["the", "a longer question", ""], prompts=None,
                chat=False, temperature=0.0, pp=1, tp=1, dp=1, nproc=1, max_new_tokens=6)  # fmt: skip
    return resolve({**opts, **kw})


def test_image_reaches_the_model_as_the_records_pixels(run_dir, png):
    path, pixels = png
    job = make_job(run_dir, path)
    assert torch.equal(torch.tensor(job["pixels"]), pixels)  # exact: [-1, 1] <-> 0..255
    assert job["ids"][0][:16] == [255] * 16 and job["ids"][0][16:] == list(b"the")


@pytest.mark.parametrize("layout", [dict(tp=2), dict(dp=2)], ids=["tp2", "dp2"])
def test_layouts_equal_one_process(run_dir, png, layout):
    solo = harness.run(1, job_answer, make_job(run_dir, png[0]))[0]
    got = harness.run(2, job_answer, make_job(run_dir, png[0], nproc=2, **layout))[0]
    assert got == solo
    assert [r["prompt"] for r in solo] == ["the", "a longer question", ""]
    assert all(1 <= len(r["token_ids"]) <= 6 for r in solo)
    assert max(max(r["token_ids"]) for r in solo) >= 128, "some token from tp rank 1's vocab half"


def test_command_prints_the_answer(run_dir, png, capsys):
    assert (
        main(
            [
                "generate",
                "--checkpoint",
                run_dir,
                "--image",
                png[0],
                "--prompt",
                "the",
                "--max-new-tokens",
                "4",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.strip().startswith(f"{png[0]}: the")


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--temperature", "0.5"], "--image decodes greedily under tp and dp: --temperature=0.5"),
        (["--max-new-tokens", "200"], "over the model's max_seq_len 128"),
        (["--nproc", "2"], "--parallel.tp=1 × --parallel.dp=1 = 1 must equal --nproc=2"),
        (["--chat"], "--chat with --image is not built"),
    ],
)
def test_bad_input_is_one_line(run_dir, png, capsys, extra, needle):
    assert main(["generate", "--checkpoint", run_dir, "--image", png[0], *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_unreadable_image_is_one_line(run_dir, tmp_path, capsys):
    bad = tmp_path / "x.png"
    bad.write_text("not an image")
    assert main(["generate", "--checkpoint", run_dir, "--image", str(bad)]) == 2
    assert "cannot be read as an image" in capsys.readouterr().err
