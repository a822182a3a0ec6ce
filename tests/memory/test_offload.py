"""`--memory.offload_optimizer`: the optimizer state lives on the host between steps and comes to
the device bucket by bucket (the next bucket's copy started while the current one updates);
training is bit-identical to keeping it on the device (bf16 on one process, dp 2 × tp 2 with
ZeRO-1, pp 2 × dp 2 with ZeRO-2; float32 at zero 0, whose parameters are their own master); the
device holds no optimizer state and the dry run reports its bytes as host memory."""

from __future__ import annotations

import json

import pytest

from meshspeed import cli
from meshspeed.plan import config
from tests import harness
from tests.memory.test_fp32_reuse import BF16, LAYOUTS, assert_identical, check_resume_across, job_rows
from tests.memory.test_trainer_recompute import BASE


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_bf16_training_is_bit_identical_with_the_state_on_the_host(tmp_path, name):
    ranks, extra = LAYOUTS[name]
    variants = [[], [("memory.offload_optimizer", "true")]]
    for got in harness.run(ranks, job_rows, str(tmp_path), BF16 + extra, variants, 3, timeout=300):
        assert_identical(got, name)


def test_float32_zero0_offloads_the_moments_only(tmp_path):
    variants = [[], [("memory.offload_optimizer", "true")]]
    got = harness.run(1, job_rows, str(tmp_path), BASE + [("parallel.tp", "1")], variants, 3, timeout=120)[0]
    assert_identical(got, "float32")


def job_copies(ctx, run_dir: str) -> dict:
    from meshspeed.train.trainer import Trainer

    out = {}
    for offload in ("false", "true"):
        over = BF16 + [
            ("run.dir", f"{run_dir}/{offload}"),
            ("parallel.tp", "1"),
            ("parallel.bucket_mb", "0.05"),
        ]
        trainer = Trainer(config.load(None, over + [("memory.offload_optimizer", offload)]), ctx)
        opt = trainer.opt
        r = {"device_bytes": opt.state_bytes(), "buckets": len(opt.shards), "device": str(ctx.device)}
        if offload == "true":
            state = opt.offload
            r["host_bytes"] = state.host_bytes()
            r["pinned"] = any(sh.host.is_pinned() for sh in state.shards)
            before = dict(state.stats)
            trainer.train_step(0)
            r["step"] = {k: state.stats[k] - before[k] for k in state.stats}
            r["outside"] = [
                sh._dev is None and sh.exp_avg.data_ptr() == sh.host[1].data_ptr() for sh in state.shards
            ]
        out[offload] = r
    return out


def test_the_state_is_on_the_host_and_each_bucket_crosses_once_each_way(tmp_path):
    r = harness.run(1, job_copies, str(tmp_path), timeout=120)[0]
    plain, off = r["false"], r["true"]
    n = off["buckets"]
    assert n > 2 and off["device_bytes"] == 0 and off["host_bytes"] == plain["device_bytes"]
    # pinned only where a device copies from it: the trainer's device, not whether the machine
    # has a GPU (these workers train on the CPU even there; the GPU report found that out)
    assert off["pinned"] is (off["device"] == "cuda")
    # one trip in and one out per bucket; every bucket after the first was fetched ahead
    assert off["step"] == {
        "to_device_bytes": off["host_bytes"],
        "to_host_bytes": off["host_bytes"],
        "prefetched": n - 1,
    }
    assert all(off["outside"])  # after the step every shard's attributes are its host rows again


def test_dry_run_reports_the_optimizer_bytes_as_host_memory(tmp_path, capsys):
    args = [
        "train",
        "--nproc",
        "4",
        "--parallel.tp",
        "2",
        "--train.dtype",
        "bfloat16",
        "--parallel.zero",
        "1",
    ]
    args += ["--run.dir", str(tmp_path / "r"), "--dry-run", "--json"]
    plans = []
    for offload in ("false", "true"):
        assert cli.main(args + ["--memory.offload_optimizer", offload]) == 0
        plans.append(json.loads(capsys.readouterr().out))
    for plain, off in zip(plans[0]["ranks"], plans[1]["ranks"]):
        p, o = plain["memory"], off["memory"]
        assert o["optimizer"] == 0 and o["host"] == p["optimizer"] > 0 and p["host"] == 0
        # a tiny model's state fits the two buckets the step brings over: nothing saved at the peak
        assert o["buffers"] - p["buffers"] == p["optimizer"] and o["saved"] == {"offload_optimizer": 0}
        assert o["total"] == sum(o[k] for k in ("params", "grads", "optimizer", "activations", "buffers"))


def test_checkpoints_move_between_host_and_device_state(tmp_path):
    check_resume_across(tmp_path, ("memory.offload_optimizer", "true"))
