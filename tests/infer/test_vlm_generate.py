"""`meshspeed generate --image FILE --prompt TEXT` on a vlm checkpoint: the key/value-cached
decoding gives the uncached greedy ids (infer/captions.greedy, the whole sequence every step);
tp 2, dp 2 and pp 2 give one process's ids, greedy and sampled with a seed (the workers' answer()
in the pooled gloo harness); --chat builds a training conversation's prompt and stops at its
end of turn; every command of docs/vlm.md's "Generating" runs; the image goes in as the training
records' pixels, and bad input is one line before any worker starts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from meshspeed import comm
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
                chat=False, temperature=0.0, top_k=0, top_p=1.0, seed=0, pp=1, tp=1, dp=1, nproc=1,
                max_new_tokens=6)  # fmt: skip
    gpus = kw.pop("local_gpus", 0)  # the choice made for a CPU machine unless a test says otherwise
    return resolve({**opts, **kw}, local_gpus=gpus)


def test_image_reaches_the_model_as_the_records_pixels(run_dir, png):
    path, pixels = png
    job = make_job(run_dir, path)
    assert torch.equal(torch.tensor(job["pixels"]), pixels)  # exact: [-1, 1] <-> 0..255
    assert job["ids"][0][:16] == [255] * 16 and job["ids"][0][16:] == list(b"the")


def test_prompts_file_adds_its_lines(run_dir, png, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("red?\n\nblue\n")
    job = make_job(run_dir, png[0], prompt=["a"], prompts=str(f))
    assert job["texts"] == ["a", "red?", "blue"] and job["ids"][2] == [255] * 16 + list(b"blue")


def job_uncached(ctx, job: dict) -> list[list[int]]:
    """The oracle: infer/captions.greedy (no cache: the whole sequence through the decoder at
    every step, M-RoPE positions from the placeholders) on each prompt alone, one process."""
    from meshspeed.infer.captions import greedy
    from meshspeed.infer.vlm_generate import load

    model, _, config = load(job, comm.ParallelDims(dp=1).build(ctx))
    image = torch.tensor(job["pixels"])[None]
    return [greedy(model, config, torch.tensor([p]), image, job["max_new_tokens"])[0] for p in job["ids"]]


def ids_of(rows: list[dict]) -> list[list[int]]:
    return [r["token_ids"] for r in rows]


@pytest.mark.parametrize("chat", [False, True], ids=["plain", "chat"])
def test_cached_equals_uncached(run_dir, png, chat):
    """Prompts of three lengths (left padded in one batch), 12 tokens each: 11 decode steps at
    positions past the image, which resumes the text at its start + grid side (chat: the image
    after the user header, so positions before it count too)."""
    job = make_job(run_dir, png[0], chat=chat, max_new_tokens=12)
    want = harness.run(1, job_uncached, job)[0]
    assert all(len(w) == 12 for w in want), "no end token: every step is compared"
    assert ids_of(harness.run(1, job_answer, job)[0]) == want


SAMPLED = dict(temperature=1.0, top_k=40, top_p=0.9, seed=7)


@pytest.fixture(scope="module")
def solo(run_dir, png):
    """One process's answers, greedy and sampled."""
    return {
        name: harness.run(1, job_answer, make_job(run_dir, png[0], **kw))[0]
        for name, kw in (("greedy", {}), ("sampled", SAMPLED))
    }


@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
@pytest.mark.parametrize("layout", [dict(tp=2), dict(dp=2), dict(pp=2)], ids=["tp2", "dp2", "pp2"])
def test_layouts_equal_one_process(run_dir, png, solo, layout, sampling):
    check_layout(run_dir, png, solo, layout, sampling)


@pytest.mark.parametrize("layout", [dict(dp=3), dict(tp=2, pp=2)], ids=["dp3", "tp2xpp2"])
def test_wider_layouts_equal_one_process(run_dir, png, solo, layout):
    check_layout(run_dir, png, solo, layout, "sampled")


def check_layout(run_dir, png, solo, layout: dict, sampling: str) -> None:
    kw = SAMPLED if sampling == "sampled" else {}
    n = layout.get("tp", 1) * layout.get("dp", 1) * layout.get("pp", 1)
    got = harness.run(n, job_answer, make_job(run_dir, png[0], nproc=n, **layout, **kw))[0]
    assert got == solo[sampling]
    assert [r["prompt"] for r in got] == ["the", "a longer question", ""]
    assert all(1 <= len(r["token_ids"]) <= 6 for r in got)
    assert max(max(r["token_ids"]) for r in got) >= 128, "some token from tp rank 1's vocab half"


def test_sampling_follows_the_seed(run_dir, png, solo):
    assert ids_of(solo["sampled"]) != ids_of(solo["greedy"])
    again = harness.run(1, job_answer, make_job(run_dir, png[0], **SAMPLED))[0]
    other = harness.run(1, job_answer, make_job(run_dir, png[0], **{**SAMPLED, "seed": 8}))[0]
    assert again == solo["sampled"] and ids_of(other) != ids_of(solo["sampled"])


@pytest.mark.parametrize("question", ["what shape?", "is <image> red?", ""])
def test_chat_prompt_is_the_training_conversations(run_dir, png, question):
    """--chat's prompt: the tokens a training conversation (data/image_chat.py) holds before its
    answer, and written out: the user header, the image where <image> stands (else first), the
    question, the generation prompt."""
    from meshspeed.data.image_chat import conversation_sequence

    job = make_job(run_dir, png[0], chat=True, prompt=[question])
    turns = [{"role": "user", "content": question}, {"role": "assistant", "content": "a red square"}]
    ids, labels = conversation_sequence(turns, "test", 16, 255)
    answer_at = next(i for i, lab in enumerate(labels) if lab != -100) + 1
    assert job["ids"] == [ids[:answer_at]]
    before, _, after = ("<image>" + question if "<image>" not in question else question).partition("<image>")
    user = list(f"<|user|>\n{before}".encode()) + [255] * 16 + list(f"{after}\n<|assistant|>\n".encode())
    assert job["ids"] == [user]
    assert job["eos_id"] == 0  # the byte template's end of turn


def job_pushed(ctx, job: dict, token: int) -> list[dict] | None:
    """answer() with the model's output pushed towards `token` at every step."""
    from meshspeed.infer import vlm_generate

    real_load = vlm_generate.load

    def load(job, mesh):
        model, stages, config = real_load(job, mesh)

        def push(_mod, _inp, out):
            out[..., token] += 1e4
            return out

        model.output.register_forward_hook(push)
        return model, stages, config

    vlm_generate.load = load
    try:
        return vlm_generate.answer(job, ctx)
    finally:
        vlm_generate.load = real_load


def test_chat_stops_at_the_end_of_turn(run_dir, png):
    rows = harness.run(1, job_pushed, make_job(run_dir, png[0], chat=True), 0)[0]
    assert [r["token_ids"] for r in rows] == [[0]] * 3 and all(r["text"] == "" for r in rows)


@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_a_placeholder_is_never_generated(run_dir, png, sampling):
    """The image token id most likely everywhere: still never chosen (it would be read as part
    of an image), as the uncached path never chooses it."""
    rows = harness.run(1, job_pushed, make_job(run_dir, png[0], **sampling), 255)[0]
    assert all(r["token_ids"] and 255 not in r["token_ids"] for r in rows)


def test_device_is_chosen_as_for_text(run_dir, png):
    from meshspeed.comm import ConfigError

    assert make_job(run_dir, png[0], device="auto", local_gpus=1)["device"] == "cuda"
    assert make_job(run_dir, png[0], device="auto", local_gpus=0)["device"] == "cpu"
    with pytest.raises(ConfigError, match="--run.device=cuda needs a GPU per local rank"):
        make_job(run_dir, png[0], device="cuda", local_gpus=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_gives_the_cpu_ids(run_dir, png, tmp_path):
    """The cache, masks, positions table and image features on the GPU: the CPU's greedy ids."""
    import json

    def ids(device):
        out = tmp_path / f"{device}.json"
        argv = ["generate", "--checkpoint", run_dir, "--image", png[0], "--prompt", "the", "--prompt", ""]
        assert main([*argv, "--max-new-tokens", "6", "--run.device", device, "--json", str(out)]) == 0
        return [r["token_ids"] for r in json.loads(out.read_text())["outputs"]]

    assert ids("cuda") == ids("cpu")


def documented_generate_commands() -> list:
    from tests import doc_commands

    cmds = doc_commands.parse_page("docs/vlm.md")
    return [c for c in cmds if c.argv[:2] == ["meshspeed", "generate"] and "--image" in c.argv]


def test_the_docs_show_the_generate_features():
    shown = " ".join(c.text for c in documented_generate_commands())
    for flag in ("--chat", "--temperature", "--seed", "--parallel.tp", "--parallel.pp"):
        assert flag in shown, f"docs/vlm.md's Generating shows no command with {flag}"


@pytest.mark.parametrize("cmd", documented_generate_commands(), ids=lambda c: f"line{c.line}")
def test_documented_command_runs(run_dir, png, capfd, cmd):
    """Each `meshspeed generate --image` command of docs/vlm.md, shortened as the docs test does,
    on this module's checkpoint and image (the docs test runs them too, in the slow tier)."""
    from tests import doc_commands

    where = {"runs/vlm-tiny": run_dir, "shape.png": png[0]}
    argv = [where.get(a, a) for a in doc_commands.shorten(cmd.argv)[1:]]
    assert main(argv) == 0
    out = capfd.readouterr().out
    assert "meshspeed generate: prefill" in out and (
        "assistant: " in out if "--chat" in argv else png[0] in out
    )


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--max-new-tokens", "200"], "over the model's max_seq_len 128"),
        (["--prompt", "x" * 120], "leaving no room under the model's max_seq_len 128; shorten it by 9"),
        (["--nproc", "2"], "--parallel.tp=1 × --parallel.dp=1 × --parallel.pp=1 = 1 must equal --nproc=2"),
        (["--parallel.pp", "3", "--nproc", "3"], "--parallel.pp=3: "),
        (
            ["--chat", "--prompt", "a", "--prompt", "b <image>"],
            "--chat: the prompts put <image> at different",
        ),
        (["--chat", "--prompt", "<image><image>"], "--chat: --prompt: 'messages' holds <image> 2 times"),
        (["--top-p", "0"], "--top_p=0.0 must be in (0, 1]"),
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
