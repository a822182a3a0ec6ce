"""TRL as the oracle: run TRL's `DPOTrainer` / `SFTTrainer` on a tiny random Hugging Face Llama and
return what they log per optimizer step, for meshspeed's trainer to be compared against.

Everything is offline and small: the tokenizer is trained on the spot (tiny_hf.py, ChatML, 320
ids), the model is 2 layers of width 32, the data are the arithmetic task's first pairs /
questions (meshspeed.data.arith) as TRL's conversational JSON lines. Fixed so that a second
trainer can replay the run exactly:

* the initial weights (saved with `save_pretrained` in `<work>/model`, the policy's and the
  reference's start), the tokenizer (`<work>/tokenizer`) and the JSON lines (`<work>/data.jsonl`);
* the order: `train_sampling_strategy="sequential"`: optimizer step k takes the records
  [k·B·A, (k+1)·B·A) of the file (B = batch_size, A = grad_accum), micro-batch j the B from k·B·A + j·B;
* AdamW (torch), constant learning rate, no warm-up, weight decay 0, betas (0.9, 0.999), eps 1e-8,
  gradient clipping at `max_grad_norm` (the logged grad_norm is the norm before clipping), fp32,
  no dropout; DPO: sigmoid, β 0.1, a frozen copy of the initial model as reference, no
  max_length cut; SFT: prompt/completion records, completion-only loss, no packing.

Usage (from the repository root; `python -m tests.post.trl_oracle dpo|sft` prints the steps):

    from tests.post.trl_oracle import run_dpo, run_sft
    out = run_dpo(work_dir, steps=20, batch_size=4, grad_accum=2, lr=1e-3, seed=0)
    out["steps"][k]   # {"step", "loss", "grad_norm", "rewards/chosen", "rewards/rejected",
                      #  "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected"}
    out["weights"][k] # the policy's state_dict at the start of step k (CPU float32 copies)
    out["model_dir"], out["tokenizer_dir"], out["data"], out["config"]

`run_sft` returns the same with per-step {"step", "loss", "grad_norm"} (TRL's loss: the summed
token cross-entropy of each step's completions / their token count over the whole step).
"""

from __future__ import annotations

import copy
import json
import os
import sys

from meshspeed.data.arith import arith_records
from tests.post.tiny_hf import hf_tokenizer, tiny_llama


def _common(work: str, n: int, kind: str, seed: int):
    os.makedirs(work, exist_ok=True)
    tok = hf_tokenizer(os.path.join(work, "tokenizer"))
    records = arith_records(max(n, 2) + 1, seed=seed, val_fraction=0.5 / (n + 1))
    if kind == "pairs":
        rows = records["pairs.train.jsonl"][:n]
    else:  # prompt/completion, for TRL's completion-only loss
        rows = [
            {"prompt": r["messages"][:1], "completion": r["messages"][1:]}
            for r in records["sft.train.jsonl"][:n]
        ]
    data = os.path.join(work, "data.jsonl")
    with open(data, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    model = tiny_llama(len(tok), seed=seed)
    model.save_pretrained(os.path.join(work, "model"))
    return tok, model, data


class _Weights:
    """A TrainerCallback (built lazily: transformers is imported only when the harness runs)."""

    def __new__(cls):
        from transformers import TrainerCallback

        class Snap(TrainerCallback):
            def __init__(self):
                self.weights = []

            def on_step_begin(self, args, state, control, model=None, **kw):
                self.weights.append({k: v.detach().float().clone() for k, v in model.state_dict().items()})

        return Snap()


def _args(config_cls, work, steps, batch_size, grad_accum, lr, seed, max_grad_norm, **extra):
    return config_cls(
        output_dir=os.path.join(work, "out"), max_steps=steps, per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=grad_accum, learning_rate=lr, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, optim="adamw_torch", adam_beta1=0.9, adam_beta2=0.999,
        adam_epsilon=1e-8, max_grad_norm=max_grad_norm, logging_steps=1, save_strategy="no",
        report_to="none", seed=seed, data_seed=seed, bf16=False, fp16=False, use_cpu=True,
        train_sampling_strategy="sequential", dataloader_num_workers=0, disable_tqdm=True, **extra,
    )  # fmt: skip


def _run(trainer, snap, work, data, steps, keys, config) -> dict:
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    if len(logs) != steps:
        raise RuntimeError(f"TRL logged {len(logs)} steps, expected {steps}")
    return {
        "steps": [{"step": i, **{k: float(h[k]) for k in keys if k in h}} for i, h in enumerate(logs)],
        "weights": snap.weights,
        "model_dir": os.path.join(work, "model"),
        "tokenizer_dir": os.path.join(work, "tokenizer"),
        "data": data,
        "config": config,
    }


def run_dpo(work, steps=20, batch_size=4, grad_accum=2, lr=1e-3, seed=0, beta=0.1, max_grad_norm=1.0) -> dict:
    """TRL DPOTrainer (sigmoid) on steps·batch_size·grad_accum arithmetic pairs; see the module docstring."""
    from datasets import load_dataset
    from trl import DPOConfig, DPOTrainer

    n = steps * batch_size * grad_accum
    tok, model, data = _common(work, n, "pairs", seed)
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    args = _args(DPOConfig, work, steps, batch_size, grad_accum, lr, seed, max_grad_norm,
                 beta=beta, loss_type=["sigmoid"], max_length=None,
                 precompute_ref_log_probs=False)  # fmt: skip
    snap = _Weights()
    dataset = load_dataset("json", data_files=data, split="train")
    trainer = DPOTrainer(
        model=model, ref_model=ref, args=args, train_dataset=dataset, processing_class=tok, callbacks=[snap]
    )
    keys = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins",
            "rewards/accuracies", "logps/chosen", "logps/rejected")  # fmt: skip
    config = dict(objective="dpo", loss_type="sigmoid", beta=beta, steps=steps, batch_size=batch_size,
                  grad_accum=grad_accum, lr=lr, seed=seed, max_grad_norm=max_grad_norm, pairs=n)  # fmt: skip
    return _run(trainer, snap, work, data, steps, keys, config)


def run_sft(work, steps=20, batch_size=4, grad_accum=2, lr=1e-3, seed=0, max_grad_norm=1.0) -> dict:
    """TRL SFTTrainer, completion-only loss, on steps·batch_size·grad_accum arithmetic questions."""
    from datasets import load_dataset
    from trl import SFTConfig, SFTTrainer

    n = steps * batch_size * grad_accum
    tok, model, data = _common(work, n, "sft", seed)
    args = _args(SFTConfig, work, steps, batch_size, grad_accum, lr, seed, max_grad_norm,
                 completion_only_loss=True, packing=False, max_length=None)  # fmt: skip
    snap = _Weights()
    dataset = load_dataset("json", data_files=data, split="train")
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=dataset, processing_class=tok, callbacks=[snap]
    )
    config = dict(objective="sft", steps=steps, batch_size=batch_size, grad_accum=grad_accum, lr=lr,
                  seed=seed, max_grad_norm=max_grad_norm, records=n)  # fmt: skip
    return _run(trainer, snap, work, data, steps, ("loss", "grad_norm"), config)


if __name__ == "__main__":
    import tempfile

    which = sys.argv[1] if len(sys.argv) > 1 else "dpo"
    with tempfile.TemporaryDirectory() as d:
        out = (run_dpo if which == "dpo" else run_sft)(d)
        for s in out["steps"]:
            print(json.dumps(s))
