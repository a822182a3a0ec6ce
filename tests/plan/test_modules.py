"""[modules] in the run plan (meshspeed/plan/modules.py): the settings' spellings, the one-line
checks before spawn, the per-module meshes, memory and predicted step in the dry run, and the
refusal of a run the trainer cannot build yet."""

from __future__ import annotations

import pytest

from meshspeed.comm import ConfigError
from meshspeed.comm.module_mesh import parse_ranks
from meshspeed.plan import config
from meshspeed.plan.run_plan import describe, make_plan

VLM = [("model.preset", "vlm-tiny"), ("train.objective", "sft"), ("train.seq_len", "64")]
VLM += [("train.global_batch_size", "8"), ("train.micro_batch_size", "2"), ("run.dir", "/tmp/ms-modules")]


def _plan(*settings, world=4, run=False):
    cfg = config.load(None, VLM + list(settings))
    return make_plan(cfg, world, ranks=not run, need_data=run)


def test_rank_lists_parse_like_launchers_write_them():
    assert parse_ranks("0-1") == (0, 1)
    assert parse_ranks("0,2-3") == (0, 2, 3)
    with pytest.raises(ConfigError, match="not like"):
        parse_ranks("a-b")


def test_settings_take_megatron_spelling_and_toml_tables(tmp_path):
    cfg = config.load(None, [("modules.encoder.ranks", "0-1"), ("modules.encoder_tp", "2")])
    assert (cfg.modules.encoder_ranks, cfg.modules.encoder_tp) == ("0-1", 2)
    f = tmp_path / "c.toml"
    f.write_text('[modules.encoder]\nranks = "0"\ndp = 1\n')
    cfg = config.load(str(f))
    assert (cfg.modules.encoder_ranks, cfg.modules.encoder_dp) == ("0", 1)


def test_colocated_plan_has_both_meshes_memory_and_a_step():
    plan = _plan(("parallel.tp", "2"), ("modules.encoder.dp", "4"))
    m = plan.modules
    assert m["mode"] == "colocated" and m["encoder"] == {"ranks": [0, 1, 2, 3], "dp": 4, "tp": 1}
    assert (m["decoder"]["dims"]["dp"], m["decoder"]["dims"]["tp"]) == (2, 2)
    assert m["memory"]["rank"]["total"] == m["memory"]["encoder"]["total"] + m["memory"]["decoder"]["total"]
    text = describe(plan)
    assert "modules      colocated" in text and "each rank (both)" in text and "predicted step" in text


def test_disaggregated_plan_lays_the_decoder_over_the_other_ranks():
    plan = _plan(("parallel.tp", "2"), ("modules.encoder.ranks", "0-1"))
    m = plan.modules
    assert m["mode"] == "disaggregated" and m["decoder"]["ranks"] == [2, 3]
    assert plan.dims["tp"] == 2 and plan.dims["dp"] == 1  # parallel.* over the decoder's 2 ranks
    assert m["predicted"]["seam_s"] > 0 and m["predicted"]["step_s"] > m["predicted"]["seam_exposed_s"]
    assert "encoder ranks 0-1 dp 2" in describe(plan)


@pytest.mark.parametrize(
    "settings,words",
    [
        ([("modules.encoder.ranks", "0-4")], "must be distinct and in 0..3"),
        ([("modules.encoder.ranks", "0-3")], "takes every rank"),
        ([("parallel.tp", "2"), ("modules.encoder.dp", "3")], "must equal the encoder's 4 ranks"),
        ([("parallel.tp", "1"), ("modules.encoder.ranks", "0-2"), ("modules.encoder.tp", "3")], "tp=3"),
        (
            [
                ("parallel.tp", "1"),
                ("parallel.pp", "2"),
                ("parallel.pp_schedule", "zero-bubble"),
                ("modules.encoder.ranks", "2-3"),
            ],
            "gpipe",
        ),
    ],
)
def test_bad_module_layouts_fail_in_one_line(settings, words):
    with pytest.raises(ConfigError, match=words) as err:
        _plan(*settings)
    assert "\n" not in str(err.value)


def test_family_without_an_encoder_is_refused():
    cfg = config.load(None, [("modules.encoder.dp", "2"), ("run.dir", "/tmp/ms-modules")])
    with pytest.raises(ConfigError, match="has no encoder"):
        make_plan(cfg, 2, ranks=False, need_data=False)


def test_a_run_that_starts_plans_what_the_trainer_runs():
    """A run that starts gets the layout the trainer builds (tests/train/test_vlm_modules.py);
    what it does not build yet is refused in one line (the dry run plans it)."""
    plan = _plan(("parallel.tp", "2"), ("modules.encoder.dp", "4"), run=True)
    assert plan.modules["encoder"]["dp"] == 4 and plan.modules["mode"] == "colocated"
    with pytest.raises(ConfigError, match="modules.encoder_ranks='0-1' with \\[modules\\]: rank 0 logs"):
        _plan(("parallel.tp", "2"), ("modules.encoder.ranks", "0-1"), run=True)


def test_the_planner_predicts_a_per_module_layout_on_its_machine():
    """planner.evaluate on settings with [modules]: the per-module memory and step (seam included)
    on the planner's machine, in the planner's result shape."""
    from meshspeed.plan.machine import get_machine
    from meshspeed.plan.planner import evaluate

    cfg = config.load(None, VLM + [("modules.encoder.ranks", "2-3")])  # not rank 0: train refuses it
    r = evaluate(cfg, 4, get_machine("h100"), {"parallel.tp": 2, "parallel.dp": 0})
    p = r["predicted"]
    assert p["modules"] == "disaggregated" and p["comm_s"]["seam"] > 0 and p["step_s"] > p["optimizer_s"] > 0
    tiny = evaluate(cfg, 4, get_machine("h100", memory_gib=1e-4), {"parallel.tp": 2, "parallel.dp": 0})
    assert tiny["rejected"].startswith("memory")


def test_the_step_charges_small_tiles_attention_and_the_waits_it_measured():
    """predict on a machine with a measured wait per blocking exchange (plan --calibrate's
    sync_us): every seam message, tp all-reduce, gradient reduction and the joint norm pays it;
    a smaller tile (bigger matmuls reach their rate) is faster; attention is charged its own rate."""
    import dataclasses

    from meshspeed.plan.machine import get_machine
    from meshspeed.plan.modules import predict

    plan = _plan(("parallel.tp", "2"), ("modules.encoder.dp", "4"))
    cfg, config_ = (
        config.load(None, VLM + [("parallel.tp", "2"), ("modules.encoder.dp", "4")]),
        plan.model_config(),
    )
    cpu = get_machine("cpu")
    base = predict(cfg, config_, plan.modules, cpu, plan.microbatches)
    waits = predict(
        cfg, config_, plan.modules, dataclasses.replace(cpu, sync_us={"2": 1000.0}), plan.microbatches
    )
    m = plan.microbatches
    assert waits["seam_s"] - base["seam_s"] == pytest.approx(m * 2 * 1e-3)  # both directions each micro-batch
    assert waits["tp_s"] - base["tp_s"] == pytest.approx(m * (4 * 2 + 2) * 1e-3)  # 2 layers + the loss
    assert waits["dp_s"] - base["dp_s"] == pytest.approx(3 * 1e-3)  # encoder dp 4, decoder dp 2, norm
    big = predict(cfg, config_, plan.modules, dataclasses.replace(cpu, tile=1e-6), plan.microbatches)
    assert big["encoder_s"] < base["encoder_s"] and big["decoder_s"] < base["decoder_s"]
    fast_attn = predict(cfg, config_, plan.modules, dataclasses.replace(cpu, attn_eff=cpu.matmul_eff), m)
    assert fast_attn["encoder_s"] < base["encoder_s"] and fast_attn["decoder_s"] < base["decoder_s"]
