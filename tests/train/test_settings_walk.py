"""Every setting value the run plan accepts runs a real step (issue 44).

The walk is read off the settings schema (meshspeed/plan/sections.py), so a setting added there is
walked without editing this file: every enumerated value of a string setting (its `choices`),
every boolean switched from its default, every integer feature (default 0 = off or automatic)
at 1, and the values listed in EXTRA for settings whose values the schema does not enumerate
(free strings, float features). A field none of these rules covers must be named in SKIP with
its reason, or the test that checks the schema fails.

For each value, the smallest layout the run plan accepts, in LAYOUTS' order (1 process, dp 2,
tp 2, pp 2, cp 2, ep 2 on tiny-moe) from the first where the setting acts (ACTS_FROM), with the
settings the value needs to mean something (COMPANIONS: a sparsity method needs a pattern,
pp_overlap a schedule with pairs). There the plan, as the launcher hands it to its workers (as
JSON), runs `Trainer.run()` for 2 steps in the harness's pooled workers: it must finish with a
finite loss (and validation loss, where it validates). A value the plan accepts and the workers
cannot run fails here; a value no layout accepts fails too, unless REFUSED names why.

The whole walk is the slow tier (tests/tiers.py); CI runs one value per section (CI_PICKS).
"""

from __future__ import annotations

import json
import math
from dataclasses import fields
from typing import get_type_hints

import pytest

from meshspeed import comm
from meshspeed.parallel.pipeline.schedules import get_schedule
from meshspeed.plan import config
from meshspeed.plan.run_plan import RunPlan, make_plan
from tests import harness

# tiny with 4 layers (pp 2 × vpp 2 has a layer per stage); 4 micro-batches of 2 in one process
# (DualPipeV at pp 2 needs 2pp); one small validation batch
BASE = [
    ("model.n_layers", "4"),
    ("train.steps", "2"),
    ("train.seq_len", "32"),
    ("train.global_batch_size", "8"),
    ("train.micro_batch_size", "2"),
    ("train.warmup_steps", "1"),
    ("train.eval_interval", "0"),
    ("train.eval_batches", "1"),
    ("data.max_mb", "1"),
    ("run.log_interval", "1"),
]

# (name, world size, settings), smallest first
LAYOUTS = [
    ("1", 1, [("parallel.tp", "1")]),
    ("dp2", 2, [("parallel.tp", "1")]),
    ("tp2", 2, [("parallel.tp", "2")]),
    ("pp2", 2, [("parallel.tp", "1"), ("parallel.pp", "2")]),
    ("cp2", 2, [("parallel.tp", "1"), ("parallel.cp", "2")]),
    ("ep2", 2, [("parallel.tp", "1"), ("parallel.ep", "2"), ("model.preset", "tiny-moe")]),
]

# values the schema does not enumerate
EXTRA = {
    "model.preset": ["tiny-moe", "tiny-fine-moe", "tiny-qwen2"],  # the presets that train here
    "checkpoint.resume": ["auto"],  # a fresh start when run.dir holds no checkpoint
    "sparsity.pattern": ["2:4", "unstructured", "1:4"],
    "sparsity.pattern_schedule": ["0:2:4,1:1:4"],  # elastic N:M, changing at step 1
    "sparsity.target": ["0.5"],
    "sparsity.initial": ["0.25"],
    "moe.capacity_factor": ["1.0"],
    "train.peak_tflops": ["100"],
    "run.timeout": ["60"],
    "dpo.beta": ["0.5"],
    "dpo.label_smoothing": ["0.1"],
    "dpo.sft_weight": ["0.5"],
    "flow.t_mean": ["0.5"],
    "flow.t_std": ["0.5"],
    "flow.label_dropout": ["0.5"],
    "flow.ema_decay": ["0.9"],
    "flow.sample_n": ["1"],
    "flow.sample_guidance": ["1.0"],
    "modules.encoder_ranks": ["1"],  # disaggregated: the encoder on rank 1 (EncoderWorker)
    "modules.encoder_tp": ["2"],  # colocated: the encoder at tp 2 beside the decoder's dp 2
}

SKIP = {
    "model.n_layers": "a model shape override, not a feature (the walk's base sets it)",
    "model.dim": "a model shape override, not a feature",
    "model.n_heads": "a model shape override, not a feature",
    "model.n_kv_heads": "a model shape override, not a feature",
    "model.init_from": "a directory to load: tests/interop (Hugging Face) and tests/checkpoint",
    "parallel.dp": "a layout degree: LAYOUTS",
    "parallel.tp": "a layout degree: LAYOUTS",
    "parallel.pp": "a layout degree: LAYOUTS",
    "parallel.cp": "a layout degree: LAYOUTS",
    "parallel.ep": "a layout degree: LAYOUTS",
    "parallel.vpp": "walked with the schedules that need it (COMPANIONS)",
    "parallel.cp_ulysses": "walked with cp_impl=hybrid (COMPANIONS)",
    "parallel.pp_layout": "a layout string: tests/pipeline/test_layout.py",
    "parallel.bucket_mb": "a size, not a feature",
    "run.device": "cpu/cuda: the harness's workers are CPU gloo ranks (tests/train/test_cuda_train.py)",
    "run.dir": "a path: every run here has its own",
    "run.log_interval": "output cadence (the base sets 1)",
    "data.path": "a path: walked with data.format (COMPANIONS)",
    "data.tokenizer": "a tokenizer directory: tests/data",
    "data.max_mb": "a size, not a feature",
    "checkpoint.keep": "a count, not a feature (tests/checkpoint)",
    "sparsity.layers": "a glob over weight names (tests/sparse)",
    "sparsity.update_interval": "walked at 1 with every sparsity value (COMPANIONS)",
    "sparsity.drop_fraction": "a rate of method rigl/set, walked with them",
    "sparsity.sr_ste_lambda": "the decay of method sr-ste, walked with it",
    "memory.loss_chunk": "a size of memory.chunked_loss, walked with it",
    "flow.sample_steps": "a size of the end-of-run sampling, walked with flow.sample_n",
    "moe.bias_update_rate": "a rate of moe.balance=bias, walked with it",
    "moe.aux_loss_coef": "a weight (< 0 = the preset's)",
    "moe.z_loss_coef": "a weight (< 0 = the preset's)",
}
for _key in ("steps", "seed", "global_batch_size", "micro_batch_size", "seq_len", "lr", "min_lr_ratio"):
    SKIP[f"train.{_key}"] = "a size or rate of every run, not a feature"
for _key in ("warmup_steps", "weight_decay", "beta1", "beta2", "grad_clip", "eval_interval"):
    SKIP[f"train.{_key}"] = "a size or rate of every run, not a feature"
for _key in ("eval_batches", "max_bad_steps"):
    SKIP[f"train.{_key}"] = "a count of every run, not a feature"

# settings a value needs to mean something: by section, by key, by key=value (all that match)
MOE = [("model.preset", "tiny-moe")]
SPARSE = [("sparsity.pattern", "2:4"), ("sparsity.update_interval", "1")]
UNSTRUCTURED = [("sparsity.pattern", "unstructured"), ("sparsity.update_interval", "1")]
COMPANIONS = {
    "moe": MOE,
    "sparsity": SPARSE,
    "sparsity.pattern": [("sparsity.update_interval", "1")],
    "sparsity.method=rigl": UNSTRUCTURED,
    "sparsity.method=set": UNSTRUCTURED,
    "sparsity.distribution=erk": UNSTRUCTURED,
    "sparsity.target": UNSTRUCTURED,
    "sparsity.initial": UNSTRUCTURED + [("sparsity.schedule", "cubic"), ("sparsity.ramp_steps", "2")],
    "parallel.etp": MOE,
    "parallel.pp_overlap": [("parallel.pp_schedule", "dualpipev"), ("parallel.vpp", "2")],
    "parallel.tp_overlap": [("parallel.sequence_parallel", "true")],
    "parallel.tp_overlap_chunks": [("parallel.sequence_parallel", "true"), ("parallel.tp_overlap", "true")],
    "parallel.cp_impl=hybrid": [("parallel.cp_ulysses", "2")],
    "parallel.zero_prefetch": [("parallel.zero", "1")],
    "memory.reuse_fp32_param": [("train.dtype", "bfloat16")],
    "memory.recompute_layers": [("memory.recompute", "full")],
    "memory.swap_layers": [("memory.swap_activations", "true")],
    # post-training reads the built-in arithmetic task, whose conversations need 64 tokens
    "train.objective=sft": [("train.seq_len", "64")],
    "train.objective=dpo": [("train.seq_len", "64")],
    "dpo": [("train.objective", "dpo"), ("train.seq_len", "64")],
    "dpo.label_smoothing": [("dpo.loss", "robust")],
    # the rectified-flow objective trains the diffusion transformer on the built-in digits
    "train.objective=flow": [("model.preset", "dit-tiny")],
    "flow": [("train.objective", "flow"), ("model.preset", "dit-tiny")],
    "data.format=uint16": [("data.path", "{tokens_uint16}")],
    "data.format=uint32": [("data.path", "{tokens_uint32}")],
    # per-module layouts are for the vision-language family, which trains the caption loss
    "modules": [("model.preset", "vlm-tiny"), ("train.objective", "sft"), ("train.seq_len", "64")],
}

# where a setting starts to act: the search starts at that layout (the plan accepts, say, a cp_impl
# at cp 1, where it changes nothing)
ACTS_FROM = {
    "parallel.zero": "dp2",
    "parallel.zero_prefetch": "dp2",
    "sparsity.sparse_grad_comm": "dp2",
    "parallel.sequence_parallel": "tp2",
    "parallel.tp_overlap": "tp2",
    "parallel.tp_overlap_chunks": "tp2",
    "parallel.etp": "tp2",
    "moe.tp_extend_ep": "tp2",
    "parallel.pp_schedule": "pp2",
    "parallel.pp_overlap": "pp2",
    "parallel.pp_trace": "pp2",
    "parallel.cp_impl": "cp2",
    "moe.dispatcher": "ep2",
    "moe.overlap_shared": "ep2",
    "moe.replicate_hot": "ep2",
}

# values no layout here accepts, and why (a value refused everywhere without an entry fails)
REFUSED: dict[str, str] = {}

# one value per section for CI
CI_PICKS = [
    "model.preset=tiny-qwen2",
    "parallel.pp_schedule=dualpipev",
    "train.dtype=bfloat16",
    "data.packing=true",
    "run.overwrite=true",
    "checkpoint.export_safetensors=true",
    "sparsity.method=sr-ste",
    "memory.recompute=full",
    "moe.dispatcher=allgather",
    "dpo.loss=ipo",
    "flow.t_sampling=uniform",
    "modules.encoder_ranks=1",  # disaggregated: an EncoderWorker rank beside the trainer
]


def _text(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def walk_values() -> list[tuple[str, str]]:
    """(key, value) for every value the walk runs, read off the schema (module docstring)."""
    out = []
    for section, cls in config.SECTIONS.items():
        hints = get_type_hints(cls)
        for f in fields(cls):
            key, typ, choices = f"{section}.{f.name}", hints[f.name], f.metadata.get("choices")
            if key in SKIP:
                continue
            if key in EXTRA:
                values = EXTRA[key]
            elif choices:
                values = [c for c in choices if c != f.default]
            elif typ is bool:
                values = [not f.default]
            elif typ is int and f.default == 0:
                values = [1]
            else:
                raise AssertionError(f"{key} is not walked: give it values in EXTRA or a reason in SKIP")
            out += [(key, _text(v)) for v in values]
    return out


def companions(key: str, value: str) -> list[tuple[str, str]]:
    section = key.split(".")[0]
    extra = COMPANIONS.get(section, []) + COMPANIONS.get(key, []) + COMPANIONS.get(f"{key}={value}", [])
    if key == "parallel.pp_schedule":  # the model chunks per rank the schedule takes
        fn = get_schedule(value)
        extra = extra + [("parallel.vpp", str((fn.chunks or 2) if fn.interleaved else 1))]
    return [(k, v) for k, v in extra if k != key]


@pytest.fixture(scope="module")
def token_files(tmp_path_factory) -> dict:
    """Token files in each format (`meshspeed data prepare`'s), for data.format's values."""
    from meshspeed.data.prepare import prepare_tokens

    d = tmp_path_factory.mktemp("tokens")
    out = {}
    for fmt in ("uint16", "uint32"):
        out[f"tokens_{fmt}"] = str(d / f"{fmt}.bin")
        prepare_tokens(out[f"tokens_{fmt}"], fmt, None, max_mb=1, workers=1)
    return out


def smallest_layout(key: str, value: str, run_dir: str, files: dict):
    """(layout name, world size, plan) for the first layout the run plan accepts, or (None,
    each layout's refusal, None) when none does."""
    reasons = []
    start = [n for n, _, _ in LAYOUTS].index(ACTS_FROM.get(key, "1"))
    for name, ws, layout in LAYOUTS[start:]:
        settings = BASE + layout + companions(key, value) + [(key, value), ("run.dir", f"{run_dir}/{name}")]
        settings = [(k, v.format(**files)) for k, v in settings]
        try:
            return name, ws, make_plan(config.load(None, settings), ws)
        except comm.ConfigError as err:
            reasons.append(f"{name}: {err}")
    return None, reasons, None


def job_walk(ctx, plan_dict: dict) -> tuple:
    """What the launcher's worker does with the plan it is handed (train/job.py worker), on the
    pool's gloo ranks: (final loss, validation loss)."""
    from meshspeed.train.job import from_dict
    from meshspeed.train.modules_run import EncoderWorker, encoder_only
    from meshspeed.train.trainer import Trainer

    plan = RunPlan.from_dict(plan_dict)
    if encoder_only(plan, ctx):  # [modules] disaggregated: this rank runs the encoder's loop
        EncoderWorker(from_dict(plan.config), ctx, plan).run()
        return None
    summary = Trainer(from_dict(plan.config), ctx, plan).run()
    return summary["final_loss"], summary["val_loss"]


def _walk(key: str, value: str, run_dir: str, files: dict) -> None:
    name, ws, plan = smallest_layout(key, value, run_dir, files)
    what = f"{key}={value}"
    if name is None:
        if what in REFUSED:
            pytest.skip(f"{what}: {REFUSED[what]}")
        raise AssertionError(f"{what}: no layout accepts it:\n  " + "\n  ".join(ws))  # ws: the refusals
    plan_dict = json.loads(json.dumps(plan.to_dict()))  # as the launcher hands it over
    results = harness.run(ws, job_walk, plan_dict, timeout=180)
    for loss, val in [r for r in results if r is not None]:  # None: an encoder-only rank
        # no validation when train.exit_interval ends the run before train.steps
        ok = math.isfinite(loss) and (val is None or math.isfinite(val))
        assert ok, f"{what} at {name}: loss {loss}, val {val}"


def test_every_schema_field_is_walked_or_named():
    """Each field of the schema gives the walk a value or has a reason in SKIP; EXTRA, SKIP,
    COMPANIONS and CI_PICKS name only settings that exist."""
    values = walk_values()  # raises for an unclassified field
    keys = {f"{s}.{f.name}" for s, cls in config.SECTIONS.items() for f in fields(cls)}
    stale = [k for k in [*SKIP, *EXTRA] if k not in keys]
    stale += [k for k in COMPANIONS if k.split("=")[0] not in keys and k not in config.SECTIONS]
    stale += [k for k in ACTS_FROM if k not in keys]
    assert not stale, f"names no setting: {stale}"
    walked = {f"{k}={v}" for k, v in values}
    assert set(CI_PICKS) <= walked, set(CI_PICKS) - walked
    assert {p.split(".")[0] for p in CI_PICKS} == set(config.SECTIONS), "CI picks one value per section"


@pytest.mark.parametrize("what", CI_PICKS)
def test_one_value_per_section_runs_two_steps(what, tmp_path, token_files):
    key, value = what.split("=", 1)
    _walk(key, value, str(tmp_path), token_files)


REST = [f"{k}={v}" for k, v in walk_values() if f"{k}={v}" not in CI_PICKS]


@pytest.mark.parametrize("what", REST)
def test_every_setting_value_runs_two_steps(what, tmp_path, token_files):
    key, value = what.split("=", 1)
    _walk(key, value, str(tmp_path), token_files)
