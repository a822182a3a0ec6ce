"""The two examples of examples/, run as a user runs them: `meshspeed run --nproc 4 SCRIPT` with
no other argument, as real launched processes, each bounded by a subprocess timeout (a bound,
not a speed claim). The Llama example's printed losses and gradient norms equal the same loop on
one process without meshspeed, and what it saves loads in `transformers`."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from tests.faults.procs import env

ROOT = pathlib.Path(__file__).resolve().parent.parent
BOUND = 300


def _run(tmp_path, script: str) -> list[tuple[float, ...]]:
    """Run the example on 4 workers with no argument of its own; the numbers of each `step`
    line rank 0 printed."""
    cmd = [sys.executable, "-m", "meshspeed", "run", "--nproc", "4", str(ROOT / "examples" / script)]
    e = env()
    e["PYTHONPATH"] = str(ROOT) + (":" + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    p = subprocess.run(cmd, cwd=tmp_path, env=e, capture_output=True, text=True, timeout=BOUND)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    rows = [
        tuple(map(float, re.findall(r" (-?\d+\.\d+)", ln)))
        for ln in p.stdout.splitlines()
        if ln.startswith("step ")
    ]
    assert len(rows) == 10, p.stdout
    return rows


def test_custom_module_example_trains_under_zero2(tmp_path):
    rows = _run(tmp_path, "custom_module.py")
    losses = [r[0] for r in rows]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
def test_hf_llama_example_equals_one_process_and_saves(tmp_path):
    import transformers

    rows = _run(tmp_path, "hf_llama.py")  # dp 2 × tp 2 + SP, saved to hf_llama_out, by default
    # the example's loop on one process, without meshspeed
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
    )
    model = transformers.LlamaForCausalLM(config).float()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.Generator().manual_seed(1)
    for loss_norm in rows:
        tokens = torch.randint(0, 256, (8, 32), generator=data)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        assert abs(loss_norm[0] - loss.item()) < 1e-5 and abs(loss_norm[1] - norm.item()) < 1e-5
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf_llama_out"))
    x = tokens[:2]
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=x).logits, model(input_ids=x).logits, atol=1e-5, rtol=0)


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib")
def test_post_training_example_runs_sft_then_dpo_and_plots(tmp_path):
    """examples/post_training.py at toy sizes under `meshspeed run --nproc 2` (dp 2): the three
    stages' figures are written and drawn; before SFT the model prefers neither answer (chance)
    and has no DPO ratio. The tuned figures are docs/post-training.md's, measured at its defaults."""
    script = str(ROOT / "examples" / "post_training.py")
    args = ["--sft-steps", "4", "--dpo-steps", "2", "--count", "400", "--batch", "16", "--micro", "4"]
    cmd = [sys.executable, "-m", "meshspeed", "run", "--nproc", "2", script, *args, "--out", "out"]
    e = env()
    e["PYTHONPATH"] = str(ROOT) + (":" + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    p = subprocess.run(cmd, cwd=tmp_path, env=e, capture_output=True, text=True, timeout=BOUND)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    figures = json.loads((tmp_path / "out" / "figures.json").read_text())["stages"]
    assert list(figures) == ["before SFT", "after SFT", "after DPO"]
    assert 0.3 < figures["before SFT"]["prefers_chosen"] < 0.7 and figures["before SFT"]["dpo_accuracy"] == 0
    assert (tmp_path / "out" / "figures.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "out" / "dpo" / "metrics.jsonl").exists() and "after DPO" in p.stdout
