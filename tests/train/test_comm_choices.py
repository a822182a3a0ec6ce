"""The trainer under every collective algorithm a calibrated machine can choose.

The rest of the suite runs with the built-in link parameters (tests/harness.py pins
MESHSPEED_LINK_PARAMS=none) so that every run makes the same choices; users run with the
choices their own `meshspeed bench comm` saved. Here the expert-parallel and tensor-parallel
trainers run under each all_to_all, all_gather and reduce_scatter algorithm (forced as
MESHSPEED_ALGO does, and picked by a saved measurement), and must equal one process.
"""

from __future__ import annotations

import json
import math
import os
import sys

import pytest

from meshspeed.comm import cost_model
from tests import harness, warm
from tests.train.test_expert_trainer import MOE, STEPS, _close, _ref
from tests.train.test_trainer import _reference, assert_rows_close, job_losses, job_rows

EP_VARIANTS = [
    ("ep2", 2, [("parallel.ep", "2")]),
    ("ep4-zero2", 4, [("parallel.ep", "4"), ("parallel.zero", "2")]),
    ("tp2-ep2", 4, [("parallel.tp", "2"), ("parallel.ep", "2")]),
    ("tp2-ep2-extend", 4, [("parallel.tp", "2"), ("parallel.ep", "2"), ("moe.tp_extend_ep", "true")]),
    ("ep2-replicate-hot", 2, [("parallel.ep", "2"), ("moe.replicate_hot", "2")]),
    ("ep2-no-shared-overlap", 2, [("parallel.ep", "2"), ("moe.overlap_shared", "false")]),
]


@pytest.mark.parametrize("algo", ["native", "pairwise"])
@pytest.mark.parametrize("name,ws,extra", EP_VARIANTS, ids=[v[0] for v in EP_VARIANTS])
def test_expert_parallel_equals_one_process_under_each_all_to_all(
    tmp_path, tmp_path_factory, name, ws, extra, algo
):
    # MOE pins tp 1; a later ("parallel.tp", "2") overrides it
    got = harness.run(ws, job_losses, str(tmp_path), MOE + extra, STEPS, forced_algos={"all_to_all": algo})
    for rank_losses in got:
        _close(rank_losses, _ref(tmp_path_factory))


TP_SP = [("parallel.tp", "2"), ("parallel.sequence_parallel", "true")]


@pytest.mark.parametrize("algo", ["native", "ring", "bruck"])
def test_tensor_and_sequence_parallel_equal_one_process_under_each_gather_and_scatter(tmp_path_factory, algo):
    """tp 2 + SP × dp 2: the SP all-gathers and reduce-scatters (and dp's reduce-scatter under
    ZeRO-1) all run `algo`."""
    forced = {"all_gather": algo, "reduce_scatter": algo}
    extra = TP_SP + [("parallel.zero", "1")]
    got = harness.run(4, job_rows, str(tmp_path_factory.mktemp(f"sp-{algo}")), extra, 10, forced_algos=forced)
    assert_rows_close(got, _reference(tmp_path_factory, "tiny"), f"tp2-sp-{algo}")


def measured_everywhere(ag: str, rs: str, a2a: str) -> cost_model.LinkParams:
    """Link parameters as `bench comm` saves them, measured on this machine, in which the given
    algorithms won at every size and group size up to 4 ranks (the fit itself says nothing)."""
    p = cost_model.LinkParams.defaults("gloo")
    p.source, p.machine = "test: every non-default algorithm measured faster", cost_model.this_machine()
    p.measured = {}
    for op, algo in (("all_gather", ag), ("reduce_scatter", rs), ("all_to_all", a2a)):
        rows = []
        for ranks in (2, 3, 4):
            for exp in range(4, 31, 2):
                rows.append(
                    {"p": ranks, "link": "intra", "bytes": 1 << exp, "us": {"native": 2.0, algo: 1.0}}
                )
        p.measured[op] = rows
    return p


def test_saved_measurement_choosing_bruck_and_pairwise_trains_equal_to_one_process(tmp_path_factory):
    """ep 2 × tp 2 + SP with choices from saved parameters (not forced): bruck gathers and
    scatters, pairwise all-to-all."""
    params = measured_everywhere("bruck", "bruck", "pairwise")
    assert cost_model.choose("all_to_all", 4096, [0, 0], "gloo", params) == "pairwise"
    extra = [("parallel.ep", "2"), ("moe.aux_loss_coef", "0"), ("moe.z_loss_coef", "0")]
    ref = _ref(tmp_path_factory, [("moe.aux_loss_coef", "0"), ("moe.z_loss_coef", "0")])
    for extra_tp in ([], [("parallel.tp", "2")]):
        run_dir = str(tmp_path_factory.mktemp("saved-choice"))
        got = harness.run(4, job_losses, run_dir, MOE + extra + extra_tp, STEPS, link_params=params)
        for rank_losses in got:
            _close(rank_losses, ref)


def test_readme_moe_example_trains_after_a_saved_pairwise_choice_and_says_so(tmp_path):
    """The README's MoE command, as a user runs it after a `bench comm` whose measurement made
    the pairwise all-to-all (and ring gathers/scatters) win: it trains, and says once which
    file chose its algorithms."""
    path = tmp_path / "link_params.json"
    cost_model.save("gloo", measured_everywhere("ring", "ring", "pairwise"), str(path))
    env = dict(os.environ, MESHSPEED_LINK_PARAMS=str(path))
    env.pop("MESHSPEED_ALGO", None)
    cmd = [
        sys.executable,
        "-m",
        "meshspeed",
        "train",
        "--config",
        "configs/tiny-moe.toml",
        "--parallel.ep",
        "2",
    ]
    cmd += ["--train.steps", "3", "--train.seq_len", "32", "--checkpoint.interval", "0", "--data.max_mb", "1"]
    cmd += ["--run.dir", str(tmp_path / "run")]
    out = warm.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=os.getcwd())
    assert out.returncode == 0, out.stderr[-3000:]
    said = [line for line in out.stderr.splitlines() if "collective algorithms chosen from" in line]
    assert len(said) == 1 and str(path) in said[0], out.stderr[-2000:]
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        losses = [json.loads(line)["loss"] for line in f if '"loss"' in line]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses), losses
