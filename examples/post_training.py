"""Post-training on a laptop (issue 42): SFT of the `tiny` preset on the built-in arithmetic task,
then DPO from the SFT checkpoint, with held-out figures before SFT, after SFT and after DPO:

    python examples/post_training.py                      # one process
    meshspeed run --nproc 2 examples/post_training.py     # the same run, data parallel over 2

The task (meshspeed/data/arith.py): "What is 17+25?" → "42"; DPO pairs reject a near miss (±1,
±2, ±10, digits swapped); the held-out questions are in no training file. Both stages are the
Trainer (train.objective sft, then dpo with model.init_from = the SFT run's checkpoint), so this is
what `meshspeed train` runs; the figures are computed here on the held-out files, every record:

- prefers chosen: share of held-out pairs whose chosen answer the model finds more likely than
  the rejected one (summed log-probabilities; a random model is at chance, ~50%);
- DPO accuracy: TRL's rewards/accuracies over every held-out pair — the chosen answer's
  log-ratio to the reference (the SFT model) above the rejected one's (0 before DPO: no ratio);
- exact match: greedy answers equal to the right one, end-of-turn included (teacher forcing,
  which equals greedy decoding whenever every position is right).

Writes `<out>/figures.json` and `<out>/figures.png` (a bar per stage); the runs' metrics and
checkpoints are in `<out>/sft` and `<out>/dpo`.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch

from meshspeed import comm
from meshspeed.data.arith import write_arith
from meshspeed.data.chat import load_chat, load_pairs
from meshspeed.losses import sequence_logps
from meshspeed.plan import config
from meshspeed.train.trainer import Trainer

SEQ_LEN = 48  # the longest record, "<|user|>\nWhat is 99+99?\n<|assistant|>\n198\0", is 42 bytes


def settings(args, objective: str, run_dir: str, data: str, steps: int, lr: float) -> list:
    return [
        ("train.objective", objective),
        ("data.path", data),
        ("model.preset", "tiny"),
        ("parallel.tp", "1"),  # data parallel over whatever `meshspeed run --nproc` gives
        ("train.seq_len", str(SEQ_LEN)),
        ("train.global_batch_size", str(args.batch)),
        ("train.micro_batch_size", str(args.micro)),
        ("train.steps", str(steps)),
        ("train.lr", str(lr)),
        ("train.warmup_steps", str(min(20, steps // 10))),
        ("train.weight_decay", "0"),
        ("train.eval_interval", "0"),
        ("train.eval_batches", "1"),
        ("run.dir", run_dir),
        ("run.overwrite", "true"),
        ("run.log_interval", str(max(1, steps // 5))),
        ("dpo.beta", str(args.beta)),
        # RPO (TRL's rpo_alpha): the chosen answers' NLL beside the DPO loss keeps teaching the
        # arithmetic the pairs hinge on; plain DPO from a weak SFT model did not move (~50%)
        ("dpo.sft_weight", str(args.sft_weight)),
    ]


@torch.no_grad()
def pair_logps(model, pairs: dict, batch: int = 256) -> torch.Tensor:
    """[N, 2] summed log-probabilities of each held-out pair's chosen and rejected answer."""
    out = []
    for i in range(0, len(pairs["chosen_tokens"]), batch):
        s = slice(i, i + batch)
        c = sequence_logps(model(pairs["chosen_tokens"][s]), pairs["chosen_labels"][s])
        r = sequence_logps(model(pairs["rejected_tokens"][s]), pairs["rejected_labels"][s])
        out.append(torch.stack([c, r], 1).double())
    return torch.cat(out)


@torch.no_grad()
def exact_match(model, chat: dict, batch: int = 256) -> float:
    right = 0
    for i in range(0, len(chat["tokens"]), batch):
        labels = chat["labels"][i : i + batch]
        pred = model(chat["tokens"][i : i + batch]).argmax(-1)
        right += ((pred == labels) | (labels == -100)).all(1).sum().item()
    return right / len(chat["tokens"])


def figures(trainer, held: dict, reference: torch.Tensor | None) -> tuple[dict, torch.Tensor]:
    """The stage's figures from its model (whole on every rank: tp 1) and its pair log-probs."""
    model = trainer.model
    was = model.training
    model.eval()
    lp = pair_logps(model, held["pairs"])
    fig = {
        "prefers_chosen": float((lp[:, 0] > lp[:, 1]).double().mean()),
        "dpo_accuracy": 0.0,
        "exact_match": exact_match(model, held["chat"]),
    }
    if reference is not None:  # rewards = beta × log-ratios; their sign is the log-ratio's
        ratio = lp - reference
        fig["dpo_accuracy"] = float((ratio[:, 0] > ratio[:, 1]).double().mean())
    model.train(was)
    return fig, lp


def plot(stages: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    names = list(stages)
    keys = (
        ("prefers_chosen", "prefers chosen"),
        ("dpo_accuracy", "DPO accuracy"),
        ("exact_match", "exact match"),
    )
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(keys)
    for k, (key, label) in enumerate(keys):
        xs = [i + (k - 1) * width for i in range(len(names))]
        bars = ax.bar(xs, [100 * stages[n][key] for n in names], width, label=label)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("% of held-out questions")
    ax.set_ylim(0, 105)
    ax.axhline(50, color="grey", lw=0.5, ls="--")
    ax.set_title("tiny on arithmetic: SFT, then DPO (held-out)")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="post_training_out", help="runs, figures.json and figures.png")
    ap.add_argument("--count", type=int, default=15050, help="arithmetic questions (15,050 exist)")
    ap.add_argument("--heldout", type=float, default=0.04, help="fraction of questions held out")
    ap.add_argument("--sft-steps", type=int, default=1500)
    ap.add_argument("--dpo-steps", type=int, default=600)
    ap.add_argument("--sft-lr", type=float, default=3e-3)
    ap.add_argument("--dpo-lr", type=float, default=2e-3)
    ap.add_argument("--beta", type=float, default=0.1)
    ap.add_argument("--sft-weight", type=float, default=1.0, help="DPO's SFT term (dpo.sft_weight)")
    ap.add_argument("--batch", type=int, default=64, help="pairs or conversations per step")
    ap.add_argument("--micro", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="per process; 1 holds up best on a shared CPU")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)  # 2 threads contending on 2 busy cores ran 10x slower

    ctx = comm.init()
    lead = ctx.rank == 0
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="meshspeed-arith-") as tmp:  # each rank its own copy
        data = os.path.join(tmp, "arith")
        write_arith(data, count=args.count, seed=0, val_fraction=args.heldout)
        sft_cfg = config.load(None, settings(args, "sft", os.path.join(args.out, "sft"), data,
                                             args.sft_steps, args.sft_lr))  # fmt: skip
        sft = Trainer(sft_cfg, ctx)
        held = {
            "pairs": load_pairs(os.path.join(data, "pairs.val.jsonl"), sft.tokenizer, SEQ_LEN),
            "chat": load_chat(os.path.join(data, "sft.val.jsonl"), sft.tokenizer, SEQ_LEN),
        }
        stages = {}
        stages["before SFT"], _ = figures(sft, held, None)
        sft.run()
        stages["after SFT"], ref = figures(sft, held, None)
        t_sft = time.perf_counter() - t0
        del sft
        dpo_cfg = config.load(None, settings(args, "dpo", os.path.join(args.out, "dpo"), data,
                                             args.dpo_steps, args.dpo_lr)
                              + [("model.init_from", os.path.join(args.out, "sft"))])  # fmt: skip
        dpo = Trainer(dpo_cfg, ctx)
        dpo.run()
        stages["after DPO"], _ = figures(dpo, held, ref)
    total = time.perf_counter() - t0
    if lead:
        n = len(held["pairs"]["chosen_tokens"])
        print(f"held-out: {n} pairs, {len(held['chat']['tokens'])} questions; {ctx.world_size} rank(s)")
        for name, f in stages.items():
            print(
                f"{name:>10}: prefers chosen {100 * f['prefers_chosen']:5.1f}%  DPO accuracy "
                f"{100 * f['dpo_accuracy']:5.1f}%  exact match {100 * f['exact_match']:5.1f}%"
            )
        print(f"time: SFT {t_sft:.0f} s, DPO {total - t_sft:.0f} s, total {total:.0f} s")
        out = {"stages": stages, "seconds": {"sft": t_sft, "total": total}, "args": vars(args)}
        with open(os.path.join(args.out, "figures.json"), "w") as f:
            json.dump(out, f, indent=1)
        plot(stages, os.path.join(args.out, "figures.png"))
        print(f"wrote {os.path.join(args.out, 'figures.png')} and figures.json")
    ctx.close()


if __name__ == "__main__":
    main()
