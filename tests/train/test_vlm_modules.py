"""Per-module layouts in the real trainer (`[modules]`, train/modules_run.py): the vision encoder in
a layout of its own, joined to the decoder through the seam, equals one process — per-step
caption losses, gradient norms (over both modules: clipping is the one-device model's) and the
validation loss — colocated (the encoder at its own dp over every rank while the decoder runs
tp or tp x dp) and disaggregated (the encoder on its own ranks, one micro-batch ahead of the
decoder), at world sizes 2, 3 and 4. A `[modules]` checkpoint holds both modules under their
one-device names: one process resumes it and continues exactly.
What the trainer does not run with `[modules]` is refused in one line before any worker starts.

The one-process reference and the run settings are test_vlm_trainer.py's (gbs 12, micro 2: the
4-rank layouts run 3 micro-batches a step, so the seam's sends cross micro-batches).
"""

from __future__ import annotations

import pytest

from meshspeed.comm import ConfigError
from meshspeed.plan import config
from meshspeed.plan.run_plan import make_plan
from meshspeed.train.modules_run import EncoderWorker, encoder_only
from meshspeed.train.trainer import Trainer
from tests import harness
from tests.train.test_vlm_trainer import BASE, STEPS, assert_rows_equal, reference


def _build(ctx, run_dir: str, extra: list, steps: int = STEPS):
    cfg = config.load(None, BASE + [("run.dir", run_dir), ("train.steps", str(steps))] + extra)
    plan = make_plan(cfg, ctx.world_size, ranks=False)
    plan.device, plan.device_info["backend"] = ctx.device.type, ctx.backend
    return (EncoderWorker if encoder_only(plan, ctx) else Trainer)(cfg, ctx, plan)


def job_rows(ctx, run_dir: str, extra: list):
    """Every step's [loss, grad norm] and the validation loss on the decoder's ranks; None on an
    encoder-only rank (which runs the same steps and validation in step with them)."""
    trainer = _build(ctx, run_dir, extra)
    rows = [trainer.train_step(s) for s in range(STEPS)]
    val = trainer.validate()
    if isinstance(trainer, EncoderWorker):
        return None
    return [[r["loss"], r["grad_norm"]] for r in rows] + [[val]]


LAYOUTS = [  # (name, world, settings, decoder ranks)
    ("ws2-colocated-enc-dp2-dec-tp2", 2, [("modules.encoder_dp", "2"), ("parallel.tp", "2")], 2),
    ("ws2-disaggregated-enc-1", 2, [("modules.encoder_ranks", "1")], 1),
    ("ws3-colocated-enc-dp3-zero2", 3, [("modules.encoder_dp", "3"), ("parallel.zero", "2")], 3),
    ("ws3-disaggregated-enc-2-dec-dp2", 3, [("modules.encoder_ranks", "2")], 2),
    ("ws4-colocated-enc-dp4-dec-tp2xdp2", 4, [("modules.encoder_dp", "4"), ("parallel.tp", "2")], 4),
    ("ws2-colocated-enc-tp2-dec-dp2", 2, [("modules.encoder_tp", "2")], 2),
    ("ws2-colocated-enc-dp2-dec-pp2", 2, [("modules.encoder_dp", "2"), ("parallel.pp", "2")], 2),
    ("ws3-disaggregated-enc-2-dec-pp2", 3, [("modules.encoder_ranks", "2"), ("parallel.pp", "2")], 2),
    (
        "ws4-colocated-enc-dp2xtp2-dec-pp2xtp2",
        4,
        [
            ("modules.encoder_dp", "2"),
            ("modules.encoder_tp", "2"),
            ("parallel.pp", "2"),
            ("parallel.tp", "2"),
        ],
        4,
    ),
    (
        "ws4-disaggregated-enc-dp2-dec-pp2-gpipe",
        4,
        [("modules.encoder_ranks", "2-3"), ("parallel.pp", "2"), ("parallel.pp_schedule", "gpipe")],
        2,
    ),
    (
        "ws4-colocated-enc-dp2xtp2-dec-tp2xdp2-zero3",
        4,
        [
            ("modules.encoder_dp", "2"),
            ("modules.encoder_tp", "2"),
            ("parallel.tp", "2"),
            ("parallel.zero", "3"),
        ],
        4,
    ),
    (
        "ws4-disaggregated-enc-tp2-dec-dp2",
        4,
        [("modules.encoder_ranks", "2-3"), ("modules.encoder_tp", "2")],
        2,
    ),
    (
        "ws4-disaggregated-enc-dp2-dec-tp2",
        4,
        [("modules.encoder_ranks", "2-3"), ("parallel.tp", "2"), ("parallel.zero", "1")],
        2,
    ),
]


@pytest.mark.parametrize("name,ws,extra,n_dec", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_module_layout_equals_one_process(tmp_path_factory, name, ws, extra, n_dec):
    want = reference(tmp_path_factory)
    got = harness.run(ws, job_rows, str(tmp_path_factory.mktemp(f"vlm-mod-{name}")), extra)
    dec = [g for g in got if g is not None]
    assert len(dec) == n_dec, f"{name}: {len(dec)} decoder ranks reported"
    assert_rows_equal(dec, want, name)  # the decoder's ranks


def job_save(ctx, run_dir: str, extra: list) -> None:
    trainer = _build(ctx, run_dir, extra, steps=STEPS + 1)
    trainer.train_step(0)
    trainer.train_step(1)
    checkpointing_save(trainer, 2)


def checkpointing_save(trainer, step: int) -> None:
    from meshspeed.train.checkpointing import save

    save(trainer, step)


def job_resume_one_process(ctx, run_dir: str):
    """One process, no [modules]: resume the layout's checkpoint at step 2, run step 2."""
    cfg = config.load(
        None, BASE + [("run.dir", run_dir), ("train.steps", str(STEPS + 1)), ("checkpoint.resume", "latest")]
    )
    trainer = Trainer(cfg, ctx)
    assert trainer.start_step == 2
    row = trainer.train_step(2)
    return [row["loss"], row["grad_norm"]]


def job_rows3(ctx, run_dir: str):
    cfg = config.load(None, BASE + [("run.dir", run_dir), ("train.steps", str(STEPS + 1))])
    trainer = Trainer(cfg, ctx)
    row = [trainer.train_step(s) for s in range(3)][-1]
    return [row["loss"], row["grad_norm"]]


RESUMES = [  # (world, settings): encoder tp 2 in both modes, so its tensors are placed on its own mesh
    (4, [("modules.encoder_ranks", "2-3"), ("modules.encoder_tp", "2"), ("parallel.tp", "2")]),
    (2, [("modules.encoder_tp", "2")]),  # colocated: encoder tp 2 beside decoder dp 2
]


@pytest.mark.parametrize("ws,extra", RESUMES, ids=["ws4-disaggregated", "ws2-colocated"])
def test_modules_checkpoint_resumes_in_one_process(tmp_path, ws, extra):
    """Two steps in the layout, saved; one process resumes it: step 2's loss and norm equal an
    uninterrupted one process's (the encoder's weights and AdamW state were saved, under the
    one-device names, whichever mesh split them)."""
    harness.run(ws, job_save, str(tmp_path / "run"), extra)
    got = harness.run(1, job_resume_one_process, str(tmp_path / "run"))[0]
    want = harness.run(1, job_rows3, str(tmp_path / "ref"))[0]
    assert_rows_equal([[got]], [want], "resumed vs uninterrupted step 2")


def job_resume_in_layout(ctx, run_dir: str, extra: list):
    """Resume a one-process checkpoint at step 2 under [modules], run step 2 (None off the decoder)."""
    trainer = _build(ctx, run_dir, extra + [("checkpoint.resume", "latest")], steps=STEPS + 1)
    assert trainer.start_step == 2
    row = trainer.train_step(2)
    return None if row is None else [row["loss"], row["grad_norm"]]


def test_one_process_checkpoint_resumes_under_modules(tmp_path):
    """The other way: one process saves at step 2; the encoder at tp 2 on its own ranks (and the
    decoder at tp 2) takes its weights and AdamW state from it and continues exactly."""
    harness.run(1, job_save, str(tmp_path / "run"), [])
    extra = [("modules.encoder_ranks", "2-3"), ("modules.encoder_tp", "2"), ("parallel.tp", "2")]
    got = [g for g in harness.run(4, job_resume_in_layout, str(tmp_path / "run"), extra) if g is not None]
    want = harness.run(1, job_rows3, str(tmp_path / "ref"))[0]
    assert len(got) == 2
    assert_rows_equal([[g] for g in got], [want], "resumed vs uninterrupted step 2")


@pytest.mark.parametrize(
    "extra,match",
    [
        ([("modules.encoder_tp", "2"), ("checkpoint.export_safetensors", "true")], "gathers over one mesh"),
        ([("modules.encoder_ranks", "0")], "rank 0 logs the loss .* e.g. '1'"),
        ([("modules.encoder_ranks", "1"), ("checkpoint.export_safetensors", "true")], "use checkpoint.exp"),
        ([("modules.encoder_dp", "2"), ("parallel.pp", "2"), ("parallel.pp_schedule", "dualpipev")], "1f1b"),
    ],
)
def test_train_refuses_what_modules_do_not_run_in_one_line(tmp_path, extra, match):
    cfg = config.load(None, BASE + [("run.dir", str(tmp_path))] + extra)
    with pytest.raises(ConfigError, match=match) as err:
        make_plan(cfg, 2, ranks=False)
    assert "\n" not in str(err.value)


def test_cli_trains_the_dist_train_shape_and_exports_qwen2_vl(tmp_path):
    """`meshspeed train` as docs/vlm.md shows it: the ViT on its own rank, the decoder a 2-stage
    pipeline on the others, `checkpoint.export_hf` — the launcher converts the final checkpoint,
    which transformers loads with every weight matched."""
    from tests.data.test_vlm_records import _train  # the CLI run those tests make, shapes data

    extra = ["--nproc", "3", "--modules.encoder_ranks", "2", "--parallel.pp", "2"]
    done = _train(
        tmp_path, "shapes", *extra, "--train.micro_batch_size", "8", "--checkpoint.export_hf", "true"
    )
    assert "decoder ranks 0-1 pp 2" in done.stdout and "hugging face" in done.stdout
    from transformers import Qwen2VLForConditionalGeneration

    model, info = Qwen2VLForConditionalGeneration.from_pretrained(
        str(tmp_path / "run" / "hf"), output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
