"""`meshspeed eval --pairs FILE`: held-out preference accuracy and mean margin of a policy against
its reference, under any layout.

A pair is scored as DPO's validation scores it: the summed log-probabilities of the chosen and the
rejected completion under the policy (the checkpoint) and under the reference, rewards
β·(policy − reference), accuracy = the share of pairs whose chosen reward is strictly above the
rejected one (TRL's `rewards/accuracies`), margin = chosen − rejected reward (TRL's
`rewards/margins`). Every pair of the file is scored exactly once (no batch padding, no cyclic
reading), so the figures are the file's, whatever the batch sizes.

**The reference** (`--reference`): `init` (the default) is the run's starting point, as DPO's
reference is: the `model.init_from` the checkpoint's run recorded (a Hugging Face directory or the
SFT checkpoint it started from), or, when it recorded none, the seeded initialisation of its
recorded preset and `train.seed`. A directory (checkpoint, run directory, Hugging Face model)
names another reference. A Hugging Face `--checkpoint` records no run, so it needs a directory.

**Any layout, by the trainer's own machinery**: the policy and the reference are each built by a
`Trainer` (the plan's tp/pp/cp/ep/dp layout, born sharded, `model.init_from` loading) and score the
pairs with DPO's reference pass (`train/reference.py`: `Reference.precompute`, each dp rank its
share, summed over dp; through the pipeline runtime when pp > 1). The two are built one after the
other, so at most one policy and its frozen copy are in memory at once.
"""

from __future__ import annotations

import json
import os
import tempfile

import torch

from meshspeed import comm
from meshspeed.comm import ConfigError
from meshspeed.train.objectives.dpo import REF_KEYS


def recorded_run(checkpoint: str) -> dict | None:
    """The training config a meshspeed checkpoint's run recorded (None for a Hugging Face dir)."""
    from meshspeed.checkpoint.dirs import CheckpointError
    from meshspeed.interop.hf_import import is_hf_dir
    from meshspeed.interop.model_source import checkpoint_state

    if is_hf_dir(checkpoint):
        return None
    try:
        _, state = checkpoint_state(checkpoint)
    except (CheckpointError, OSError) as e:
        raise ConfigError(f"--checkpoint={checkpoint!r} is not a meshspeed checkpoint: {e}") from None
    return (state.get("extra") or {}).get("config") or {}


def reference_model(checkpoint: str, reference: str) -> tuple[dict, int | None]:
    """(model section values, train.seed or None) that build the reference (module docstring)."""
    if reference != "init":
        if not os.path.exists(reference):
            raise ConfigError(f"--reference={reference!r} does not exist; give init or a model directory")
        return {"init_from": reference}, None
    run = recorded_run(checkpoint)
    if run is None:
        raise ConfigError(
            f"--checkpoint={checkpoint!r} is a Hugging Face directory: it records no starting point; "
            "give --reference DIR (the model it was trained from)"
        )
    model = dict(run.get("model") or {})
    if model.get("init_from"):
        return {"init_from": model["init_from"]}, None
    return {**model, "init_from": ""}, int((run.get("train") or {}).get("seed", 0))


def pairs_configs(checkpoint: str, reference: str, pairs: str, config_file, overrides: list):
    """(policy Config, reference Config): the eval's settings (the run's recorded ones, its dpo
    beta among them, < --config < overrides) as DPO scoring runs on `pairs`, each in a scratch
    run.dir; the reference's model is `reference_model`'s."""
    from meshspeed.plan import config
    from meshspeed.train.evaluate import eval_config
    from meshspeed.train.job import from_dict

    run = recorded_run(checkpoint) or {}
    recorded_dpo = [(f"dpo.{k}", str(v)) for k, v in (run.get("dpo") or {}).items()]
    scoring = [("train.objective", "dpo"), ("data.path", pairs), ("dpo.precompute_reference", "false")]
    policy = eval_config(checkpoint, config_file, recorded_dpo + overrides + scoring)
    model, seed = reference_model(checkpoint, reference)
    d = policy.to_dict()
    d["model"] = {**d["model"], **model}
    if seed is not None:
        d["train"]["seed"] = seed
    d["run"]["dir"] = tempfile.mkdtemp(prefix="meshspeed-eval-")
    ref = from_dict(d)
    config.validate(ref)
    return policy, ref


def load_pair_records(path: str, tokenizer, seq_len: int) -> dict:
    """The pairs to score: every pair of a JSON-lines file; the validation split of a prepared
    pairs record file or of a directory `meshspeed data prepare --kind arith` wrote."""
    from meshspeed.data import chat
    from meshspeed.train.batches import arith_split

    if os.path.isdir(path):
        return arith_split(path, "pairs", tokenizer, seq_len, False)[1]
    if path.endswith((".jsonl", ".ndjson", ".json")):
        return chat.load_pairs(path, tokenizer, seq_len)
    from meshspeed.data.record_file import load_records

    f = load_records(path)
    if f.kind != "pairs":
        raise ConfigError(f"--pairs={path!r} holds {f.kind} records; give preference pairs")
    return f.val


def score(trainer, records: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """([N] chosen, [N] rejected) summed log-probabilities of every pair under `trainer`'s
    starting weights (its frozen copy: the same weights as its policy), in its layout."""
    from meshspeed.data.records import RecordValidation

    t, mesh = trainer.cfg.train, trainer.mesh
    args = (t.global_batch_size, t.micro_batch_size, mesh.coords["dp"], mesh.dims.dp)
    out = trainer.reference.precompute(records, RecordValidation, args, trainer.item)
    return out[REF_KEYS[0]].double(), out[REF_KEYS[1]].double()


def pair_figures(policy: tuple, reference: tuple, beta: float) -> dict:
    """Accuracy, mean margin and mean rewards from per-pair log-probabilities (float64)."""
    chosen = beta * (policy[0] - reference[0])
    rejected = beta * (policy[1] - reference[1])
    return {
        "pairs": int(chosen.numel()),
        "accuracy": float((chosen > rejected).double().mean()),
        "margin": float((chosen - rejected).mean()),
        "chosen_reward": float(chosen.mean()),
        "rejected_reward": float(rejected.mean()),
        "beta": beta,
    }


def _build_and_score(cfg, ctx, pairs: str) -> tuple[torch.Tensor, torch.Tensor]:
    import shutil

    from meshspeed.train.trainer import Trainer

    trainer = Trainer(cfg, ctx)
    records = load_pair_records(pairs, trainer.tokenizer, cfg.train.seq_len)
    logps = score(trainer, records)
    trainer.metrics.close()
    if trainer.lead:
        shutil.rmtree(cfg.run.dir, ignore_errors=True)
    del trainer
    return logps


def pairs_worker(policy_cfg: dict, reference_cfg: dict, device: str, pairs: str, out_json) -> None:
    """Every rank: score the pairs under the policy, then under the reference; rank 0 prints."""
    from meshspeed.train.job import from_dict

    pol, ref = from_dict(policy_cfg), from_dict(reference_cfg)
    ctx = comm.init(timeout_s=pol.run.timeout or None, device=device)  # the parent plan's choice
    policy = _build_and_score(pol, ctx, pairs)
    reference = _build_and_score(ref, ctx, pairs)
    figures = pair_figures(policy, reference, pol.dpo.beta)
    if ctx.rank == 0:
        p = pol.parallel
        print(
            f"meshspeed eval: preference accuracy {100 * figures['accuracy']:.2f}% over "
            f"{figures['pairs']} pairs, mean margin {figures['margin']:.4f} (chosen reward "
            f"{figures['chosen_reward']:.4f}, rejected {figures['rejected_reward']:.4f}, beta "
            f"{figures['beta']:g}) against {ref.model.init_from or 'the seeded initialisation'}; "
            f"{ctx.world_size} rank(s), tp {p.tp} pp {p.pp} cp {p.cp}",
            flush=True,
        )
        if out_json:
            result = {"checkpoint": pol.model.init_from, "reference": ref.model.init_from or "init"}
            with open(out_json, "w") as f:
                json.dump({**result, **figures, "world_size": ctx.world_size}, f, indent=1)
    ctx.close()
