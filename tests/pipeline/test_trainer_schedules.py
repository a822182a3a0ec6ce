"""Every pipeline schedule the run plan accepts, through the trainer, against one process.

The schedules' own runtime tests (test_dualpipev_runtime.py, tests/parallel/test_pipeline_runtime.py)
build their stages by hand; the trainer builds them from the run plan, which is where DualPipeV
once went missing (the plan cut the stages for Megatron's "loop" placement, and rank 0 died in
the runtime's placement check). Here each schedule goes through `Trainer`, as the CLI's workers
run it: its float32 losses and gradient norms over a few steps equal one process's within the
harness tolerances (losses 1e-5, norms 1e-4: tests/train/test_trainer.py), with
parallel.pp_overlap off and on. DualPipeV also at pp 2 × ep 2 and pp 2 × dp 2, where the overlap
must have run pairs and, with experts, handed over at the all-to-alls.
"""

from __future__ import annotations

import sys

import pytest

from meshspeed import comm
from meshspeed.parallel.pipeline.schedules import SCHEDULES, get_schedule
from meshspeed.plan import config
from meshspeed.plan.run_plan import make_plan
from meshspeed.train.trainer import Trainer
from tests import harness, warm
from tests.train.test_trainer import assert_rows_close

STEPS = 3
# 4 layers fill pp 2 × vpp 2; micro-batches of 1 give 8 per step in one process, 4 per rank at
# dp 2: DualPipeV needs >= 2 pp, the interleaved schedules a multiple of pp
BASE = [
    ("model.n_layers", "4"),
    ("parallel.tp", "1"),
    ("train.seq_len", "32"),
    ("train.global_batch_size", "8"),
    ("train.micro_batch_size", "1"),
    ("train.dtype", "float32"),
    ("train.eval_interval", "0"),
    ("train.warmup_steps", "2"),
    ("data.max_mb", "1"),
]
PP2 = [("parallel.pp", "2")]


def schedule_settings(name: str) -> list[tuple[str, str]]:
    """The settings a schedule needs besides pp: its model chunks per rank."""
    fn = get_schedule(name)
    vpp = (fn.chunks or 2) if fn.interleaved else 1
    return [("parallel.pp_schedule", name), ("parallel.vpp", str(vpp))]


def job_runs(ctx, run_dir: str, runs: list) -> list:
    """Per run (its settings): (losses, gradient norms, overlapped pairs in the last step, their
    hand-overs)."""
    out = []
    for i, extra in enumerate(runs):
        cfg = config.load(None, BASE + extra + [("run.dir", f"{run_dir}/{i}"), ("train.steps", str(STEPS))])
        trainer = Trainer(cfg, ctx)
        rows = [trainer.train_step(s) for s in range(STEPS)]
        rt = trainer.pipeline.runtime if trainer.pipeline is not None else None
        duets = rt.last_duets if rt is not None else []
        out.append(
            (
                [r["loss"] for r in rows],
                [r["grad_norm"] for r in rows],
                len(duets),
                sum(d.switches for d in duets),
            )
        )
    return out


_REF: dict = {}


def _reference(tmp_path_factory, preset: str) -> tuple[list, list]:
    if preset not in _REF:
        run_dir = str(tmp_path_factory.mktemp(f"ref-{preset}"))
        got = harness.run(1, job_runs, run_dir, [[("model.preset", preset)]])[0][0]
        _REF[preset] = got[:2]
    return _REF[preset]


def _check(results: list, want, names: list[str]) -> None:
    """Every run on every rank against one process."""
    for k, name in enumerate(names):
        assert_rows_close([rank[k][:2] for rank in results], want, name)


def test_every_schedule_trains_like_one_process_pp2(tmp_path, tmp_path_factory):
    """pp 2 (world 2): each registered schedule, the overlap off and on (1F1B has no pair to
    overlap: the plan refuses it, tested below)."""
    runs, names = [], []
    for name in SCHEDULES:
        for overlap in (False, True):
            if overlap and name == "1f1b":
                continue
            runs.append(PP2 + schedule_settings(name) + [("parallel.pp_overlap", str(overlap).lower())])
            names.append(f"{name} overlap={overlap}")
    results = harness.run(2, job_runs, str(tmp_path), runs)
    _check(results, _reference(tmp_path_factory, "tiny"), names)
    for k, name in enumerate(names):  # GPipe's one pair is on the last rank: count over ranks
        pairs = sum(rank[k][2] for rank in results)
        assert (pairs > 0) == name.endswith("True"), f"{name}: {pairs} overlapped pairs"


@pytest.mark.parametrize(
    "preset,dims",
    [("tiny-moe", [("parallel.dp", "2"), ("parallel.ep", "2")]), ("tiny", [("parallel.dp", "2")])],
    ids=["pp2-ep2", "pp2-dp2"],
)
def test_dualpipev_trains_like_one_process(tmp_path, tmp_path_factory, preset, dims):
    """World 4, the issue's layout: DualPipeV without and with the F&B overlap; with experts the
    overlapped pairs handed over at the all-to-alls."""
    extra = [("model.preset", preset)] + PP2 + dims + schedule_settings("dualpipev")
    runs = [extra + [("parallel.pp_overlap", "false")], extra + [("parallel.pp_overlap", "true")]]
    results = harness.run(4, job_runs, str(tmp_path), runs)
    _check(results, _reference(tmp_path_factory, preset), ["dualpipev", "dualpipev overlap"])
    for rank in results:
        assert rank[0][2] == 0 and rank[1][2] > 0, "the overlap did not run pairs (or ran them when off)"
        if preset == "tiny-moe":
            assert rank[1][3] > 0, "no hand-over at the all-to-alls"


def test_plan_places_dualpipev_stages_in_a_v():
    """The run plan holds the stages where DualPipeV places them: rank r holds stages r and
    2pp-1-r, so rank 0 embeds and computes the loss (what the trainer builds, and what the
    dry run prints and the memory estimate counts)."""
    cfg = config.load(None, BASE + PP2 + schedule_settings("dualpipev"))
    stages = [
        (s["stage"], s["rank"], s["chunk"], s["embedding"], s["head"]) for s in make_plan(cfg, 2).stages
    ]
    assert stages == [
        (0, 0, 0, True, False),
        (1, 1, 0, False, False),
        (2, 1, 1, False, False),
        (3, 0, 1, False, True),
    ]


@pytest.mark.parametrize(
    "ws,extra,needle",
    [
        (1, [("parallel.pp_overlap", "true")], "parallel.pp_overlap=true needs parallel.pp > 1"),
        (2, PP2 + [("parallel.pp_overlap", "true")], "the schedule has no independent forward/backward pair"),
    ],
    ids=["pp1", "1f1b"],
)
def test_overlap_refused_where_it_would_do_nothing(ws, extra, needle):
    with pytest.raises(comm.ConfigError) as err:
        make_plan(config.load(None, BASE + extra), ws)
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_cli_dualpipev_command_from_issue_44_trains(tmp_path):
    """The command that passed the run plan and died on rank 0, as a user types it (2 steps)."""
    out = warm.run(
        [sys.executable, "-m", "meshspeed", "train", "--model.preset", "tiny-moe", "--model.n_layers", "4"]
        + ["--nproc", "4", "--parallel.pp", "2", "--parallel.dp", "2", "--parallel.ep", "2"]
        + ["--parallel.tp", "1", "--parallel.pp_schedule", "dualpipev", "--parallel.vpp", "2"]
        + ["--train.global_batch_size", "8", "--train.micro_batch_size", "1", "--train.seq_len", "32"]
        + ["--train.steps", "2", "--data.max_mb", "1", "--run.dir", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "final train loss" in out.stdout, out.stdout[-2000:]
