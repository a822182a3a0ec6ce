"""`meshspeed generate` end to end on an imported tiny Hugging Face Llama: one process, tp 2,
dp 2, pp 2 and tp 2 × pp 2 write the same --json; bad input is one line before any worker starts."""

from __future__ import annotations

import json

import pytest

from meshspeed.cli import main
from tests.interop.test_hf import make_hf

pytest.importorskip("transformers")
PROMPTS = ["hello", "a longer prompt here", "x"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("hf") / "llama")
    make_hf("llama-tied", d, vocab_size=260)  # ≥ 256: the byte tokenizer's ids
    return d


def run(hf_dir, out, *extra):
    argv = ["generate", "--hf", hf_dir, "--max-new-tokens", "5", "--json", str(out), *extra]
    for p in PROMPTS:
        argv += ["--prompt", p]
    assert main(argv) == 0
    return json.load(open(out))["outputs"]


@pytest.mark.slow  # three CLI launches; test_parallel_generate compares the same layouts token for token
def test_layouts_write_the_same_json(hf_dir, tmp_path, capsys):
    solo = run(hf_dir, tmp_path / "solo.json")
    assert [o["prompt"] for o in solo] == PROMPTS and all(len(o["token_ids"]) == 5 for o in solo)
    assert "decode" in capsys.readouterr().out
    sampled = ["--temperature", "0.7", "--seed", "5"]
    solo_s = run(hf_dir, tmp_path / "solo_s.json", *sampled)
    # this model ties its embeddings, which pp refuses (test_bad_input_is_one_line); pp's CLI
    # run is test_pipeline_generation_of_an_untied_model_equals_one_process
    for layout in (["--parallel.tp", "2"], ["--parallel.dp", "2"]):
        assert run(hf_dir, tmp_path / "p.json", "--nproc", "2", *layout) == solo
        assert run(hf_dir, tmp_path / "ps.json", "--nproc", "2", *layout, *sampled) == solo_s


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--nproc", "2"], "--parallel.tp=1 × --parallel.dp=1 × --parallel.pp=1 = 1 must equal --nproc=2"),
        (["--top-p", "0"], "top_p=0.0"),
        (["--parallel.pp", "2", "--nproc", "2"], "--parallel.pp=2: parallel.pp=2 with tied embeddings"),
        (["--max-new-tokens", "500"], "max_seq_len"),
    ],
)
def test_bad_input_is_one_line(hf_dir, tmp_path, capsys, extra, needle):
    argv = ["generate", "--hf", hf_dir, "--prompt", "hi", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_needs_a_model(capsys):
    assert main(["generate", "--prompt", "hi"]) == 2
    assert "exactly one of --checkpoint" in capsys.readouterr().err


def test_meshspeed_checkpoint_equals_hf(hf_dir, tmp_path):
    """The same weights as a meshspeed checkpoint (convert --from-hf), loaded one process and
    resharded over tp 2, generate what the Hugging Face directory generates."""
    from meshspeed.interop.hf_import import convert_from_hf

    ckpt = convert_from_hf(hf_dir, str(tmp_path / "ckpt"))
    want = run(hf_dir, tmp_path / "hf.json")
    argv = ["generate", "--checkpoint", ckpt, "--max-new-tokens", "5", "--json", str(tmp_path / "c.json")]
    for p in PROMPTS:
        argv += ["--prompt", p]
    assert main(argv) == 0
    assert json.load(open(tmp_path / "c.json"))["outputs"] == want
    assert main([*argv, "--nproc", "2", "--parallel.tp", "2"]) == 0
    assert json.load(open(tmp_path / "c.json"))["outputs"] == want


def test_pipeline_generation_of_an_untied_model_equals_one_process(tmp_path):
    """tp 2 × pp 2 through the command line: each rank loads its stage's layers (its tp pieces of
    them) from a meshspeed checkpoint and the prompts flow through the stages."""
    from meshspeed.interop.hf_import import convert_from_hf

    d = str(tmp_path / "llama")
    make_hf("llama", d, vocab_size=260)
    ckpt = convert_from_hf(d, str(tmp_path / "ckpt"))
    argv = ["generate", "--checkpoint", ckpt, "--max-new-tokens", "5", "--json", str(tmp_path / "c.json")]
    for p in PROMPTS:
        argv += ["--prompt", p]
    outs = []
    for layout in ([], ["--nproc", "4", "--parallel.tp", "2", "--parallel.pp", "2"]):
        assert main([*argv, *layout, "--temperature", "0.7", "--seed", "3"]) == 0
        outs.append(json.load(open(tmp_path / "c.json"))["outputs"])
    assert outs[0] == outs[1] and all(len(o["token_ids"]) == 5 for o in outs[0])


def chat_run(model_dir, out, *extra):
    return run(model_dir, out, "--chat", *extra)


def test_chat_prompts_are_the_template(hf_dir, tmp_path):
    """--chat: each prompt is a user turn with the generation prompt (chat_template.prompt_ids,
    as SFT/DPO records are tokenized), stopping at the template's end-of-turn id."""
    from meshspeed.data.chat_template import prompt_ids
    from meshspeed.data.tokenizer import load_tokenizer
    from meshspeed.infer.runner import resolve

    opts = {"hf": hf_dir, "prompt": PROMPTS, "max_new_tokens": 5, "tp": 1, "dp": 1, "pp": 1, "nproc": 1}
    job = resolve({**opts, "chat": True})
    want = [prompt_ids(load_tokenizer("bytes"), [{"role": "user", "content": p}]) for p in PROMPTS]
    assert job["ids"] == [i for i, _ in want] and job["eos_id"] == want[0][1] == 0
    assert job["ids"][0] == list(b"<|user|>\nhello\n<|assistant|>\n")
    solo = chat_run(hf_dir, tmp_path / "solo.json")
    assert solo != run(hf_dir, tmp_path / "plain.json"), "the template changed nothing"
    for o in solo:  # stops at the end-of-turn id
        ids = o["token_ids"]
        assert 0 not in ids[:-1] and (len(ids) == 5 or ids[-1] == 0)


def test_chat_layouts_equal_one_process(hf_dir, tmp_path):
    """--chat under tp 2 and dp 2 gives the same ids and text as one process."""
    solo = chat_run(hf_dir, tmp_path / "solo.json")
    for layout in (["--parallel.tp", "2"], ["--parallel.dp", "2"]):
        assert chat_run(hf_dir, tmp_path / "p.json", "--nproc", "2", *layout) == solo


def test_chat_stops_at_the_end_of_turn_token(tmp_path):
    """A model whose every logit is 0 answers greedily with id 0, the byte template's end of
    turn: --chat stops right after it and its text leaves it out."""
    d = str(tmp_path / "silent")
    model = make_hf("llama", str(tmp_path / "src"), vocab_size=260)
    model.lm_head.weight.data.zero_()
    model.save_pretrained(d)
    outs = run(d, tmp_path / "c.json", "--chat")
    assert all(o["token_ids"] == [0] and o["text"] == "" for o in outs), outs
