"""meshspeed generate vs transformers' generate on the same model, prompts and batch (one process).

A random Llama (transformers LlamaForCausalLM, float32) is saved and imported into meshspeed, so
both run the very same weights. Both decode greedily with a key/value cache, the same left-padded
batch of prompts of different lengths, `--new` tokens with no early stop. Before timing, the
generated tokens are compared (a mismatch is flagged: timing different computations is worthless).

Prefill time: a generate of one new token (transformers) / meshspeed's measured prefill.
Decode time: (full generate - prefill) for transformers / meshspeed's measured decode loop.
Rounds alternate the order (A B B A); reported: median tokens/s over rounds and the ratio
meshspeed / transformers (> 1: meshspeed faster). CPU by default, CUDA with --device cuda.

    python -m benchmarks.generate [--hidden 256] [--layers 4] [--batch 8] [--new 32] [--device cuda]
                                  [--json FILE]   (the figures as JSON too: benchmarks/gpu_report.py)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from benchmarks import harness
from meshspeed import comm
from meshspeed.infer.generate import Stats, generate
from meshspeed.interop.hf_import import HFCheckpoint, hf_recipe
from meshspeed.parallel.materialize import build_parallel_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64, help="longest prompt; others shorter")
    ap.add_argument("--new", type=int, default=32, help="new tokens per prompt")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", metavar="FILE", help="also write the figures here")
    a = ap.parse_args()
    harness.require_positive(ap, a, "layers", "batch", "prompt_len", "rounds")
    if a.hidden < 64 or a.hidden % 64:  # heads of 32, key/value heads hidden / 64
        ap.error(f"--hidden {a.hidden}: must be a multiple of 64 (32-wide heads, hidden/64 key/value heads)")
    if a.vocab < 2:
        ap.error(f"--vocab {a.vocab}: must be at least 2 (token 0 pads)")
    if a.new < 2:
        ap.error(f"--new {a.new}: must be at least 2 (decode speed is over the tokens after the first)")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {a.device}: no GPU here; use --device cpu")
    try:
        import transformers
    except ImportError:
        ap.error("needs transformers (the peer): pip install -e .[dev]")

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.hidden * 8 // 3,
        num_hidden_layers=a.layers, num_attention_heads=a.hidden // 32,
        num_key_value_heads=a.hidden // 64,
        max_position_embeddings=a.prompt_len + a.new + 8,
    )  # fmt: skip
    theirs = transformers.LlamaForCausalLM(cfg).eval().to(a.device)
    with tempfile.TemporaryDirectory() as d:
        theirs.save_pretrained(d)
        mesh = comm.ParallelDims().build(comm.init(device="cpu" if a.device == "cpu" else "cuda"))
        ours = build_parallel_model(hf_recipe(HFCheckpoint(d)), mesh, device=a.device).eval()
    g = torch.Generator().manual_seed(1)
    lens = [a.prompt_len - (i * a.prompt_len) // (2 * a.batch) for i in range(a.batch)]
    prompts = [torch.randint(1, a.vocab, (n,), generator=g).tolist() for n in lens]
    ids = torch.zeros(a.batch, a.prompt_len, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as meshspeed does
        ids[i, a.prompt_len - len(p) :], mask[i, a.prompt_len - len(p) :] = torch.tensor(p), 1
    ids, mask = ids.to(a.device), mask.to(a.device)

    def hf(n: int) -> tuple[list[list[int]], float]:
        sync()
        t = time.perf_counter()
        with torch.no_grad():
            out = theirs.generate(
                ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
            )
        sync()
        return out[:, a.prompt_len :].tolist(), time.perf_counter() - t

    def sync():
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()

    def ms() -> tuple[list[list[int]], Stats]:
        s = Stats()
        return generate(ours, prompts, max_new_tokens=a.new, stats=s), s

    want, _ = hf(a.new)
    got, _ = ms()
    same = sum(w == o for w, o in zip(want, got, strict=True))
    print(f"tokens equal for {same}/{a.batch} prompts" + ("" if same == a.batch else "  <-- MISMATCH"))
    n_pre = sum(lens)
    n_dec = a.batch * (a.new - 1)
    rows = {k: [] for k in ("ms_pre", "ms_dec", "hf_pre", "hf_dec")}
    for r in range(a.rounds):
        print(f"  round {r + 1}/{a.rounds} ...", flush=True)
        for who in ("ms", "hf") if r % 2 == 0 else ("hf", "ms"):
            if who == "ms":
                _, s = ms()
                rows["ms_pre"].append(n_pre / s.prefill_s)
                rows["ms_dec"].append(n_dec / s.decode_s)
            else:
                _, t1 = hf(1)
                _, tn = hf(a.new)
                rows["hf_pre"].append(n_pre / t1)
                rows["hf_dec"].append(n_dec / max(tn - t1, 1e-9))
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(
        f"device {a.device}, torch {torch.__version__}, transformers {transformers.__version__}; "
        f"model hidden {a.hidden} x {a.layers} layers, vocab {a.vocab}; batch {a.batch}, "
        f"prompts {min(lens)}..{max(lens)} tokens, {a.new} new; median of {a.rounds} rounds"
    )
    print(f"{'phase':8} {'meshspeed tok/s':>16} {'transformers tok/s':>19} {'ratio ms/hf':>12}")
    for ph, k in (("prefill", "pre"), ("decode", "dec")):
        m, h = med[f"ms_{k}"], med[f"hf_{k}"]
        print(f"{ph:8} {m:16.1f} {h:19.1f} {m / h:12.2f}")
    if a.json:
        with open(a.json, "w") as f:
            fig = {"device": a.device, "prompts_equal": same, "prompts": a.batch, "new_tokens": a.new}
            json.dump({**fig, "tokens_per_s": med, "transformers": transformers.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
