"""`--memory.reuse_fp32_param`: the fp32 master is rebuilt bit for bit from the bf16 parameter and
its 16-bit residual (every low half of a range of high halves, ties of both parities, random bit
patterns); the parameters live inside the shared storage and the optimizer holds 2 bytes less
per master; bf16 training is bit-identical to the plain bf16 run on one process, dp 2 × tp 2
with ZeRO-1 (and zero_prefetch) and pp 2 × dp 2 with ZeRO-2; checkpoints move between shared and
separate masters exactly; the dry run's saving is 2 bytes × the rank's masters."""

from __future__ import annotations

import json
import re

import pytest
import torch

from meshspeed import cli
from meshspeed.memory.fp32_reuse import decode, encode
from meshspeed.plan import config
from tests import harness
from tests.memory.test_trainer_recompute import BASE

BF16 = BASE + [("train.dtype", "bfloat16")]


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)


def _check_exact(x: torch.Tensor) -> None:
    hi, lo, ties = encode(x)
    # the parameter is what the plain run publishes: round to nearest even
    assert torch.equal(hi.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))
    y = decode(hi, lo, ties)
    nan = torch.isnan(x)
    bad = (_bits(y) != _bits(x)) & ~nan
    assert not bad.any(), f"{int(bad.sum())} values differ, e.g. {hex(int(_bits(x)[bad][0]) & 0xFFFFFFFF)}"
    assert torch.isnan(y[nan]).all()


def test_every_low_half_of_chosen_high_halves_round_trips():
    # zero, denormals, around 1, the largest finite values (which round up to inf), inf, NaN,
    # each positive and negative, even and odd (the tie that needs the list is an even one)
    highs = [0x0000, 0x0001, 0x0002, 0x007F, 0x0080, 0x0081, 0x3F80, 0x3F81, 0x4B00, 0x7F7E, 0x7F7F, 0x7F80]
    highs += [h | 0x8000 for h in highs]
    bits = (torch.tensor(highs, dtype=torch.int64)[:, None] * 65536 + torch.arange(65536)).flatten()
    x = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)
    _check_exact(x)
    _, _, ties = encode(x)
    # exactly halfway (low half 0x8000) and rounded down to an even, finite high half
    finite_even = [h for h in highs if h % 2 == 0 and (h & 0x7FFF) < 0x7F80]
    assert ties.numel() == len(finite_even)


def test_random_values_of_every_magnitude_round_trip():
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(-(2**31), 2**31, (1 << 20,), generator=g, dtype=torch.int64).to(torch.int32)
    _check_exact(raw.view(torch.float32))  # every exponent: tiny, huge, negative, NaN
    for scale in (1e-38, 1e-20, 1e-3, 1.0, 1e20, 3e38):
        _check_exact(torch.randn(1 << 16, generator=g) * scale)
    _check_exact(torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 1.0 + 2**-8, -(1.0 + 2**-8)]))


def job_rows(ctx, run_dir: str, extra: list, variants: list, steps: int) -> list:
    """Per variant (extra settings): losses, gradient norms, and this rank's parameters and
    optimizer state (the per-parameter fp32 masters and moments) after `steps` steps."""
    from meshspeed.train.trainer import Trainer

    out = []
    for j, variant in enumerate(variants):
        over = extra + [("run.dir", f"{run_dir}/{j}"), ("train.steps", str(steps))] + variant
        trainer = Trainer(config.load(None, over), ctx)
        rows = [trainer.train_step(s) for s in range(steps)]
        if trainer.prefetch is not None:  # the last step's parameter gather is still in flight
            trainer.prefetch.wait()
        params = torch.cat([p.detach().float().flatten() for p in trainer.model.parameters()])
        state = trainer.opt.state_dict_per_param()
        state = torch.cat(
            [v.flatten() for n in sorted(k for k in state if k != "__step__") for v in state[n].values()]
        )
        out.append(([r["loss"] for r in rows], [r["grad_norm"] for r in rows], params, state))
    return out


def assert_identical(got: list, name: str) -> None:
    (loss0, norm0, params0, state0), *others = got
    for loss, norm, params, state in others:
        assert loss == loss0 and norm == norm0, f"{name}: {loss} vs {loss0}, {norm} vs {norm0}"
        assert torch.equal(params, params0) and torch.equal(state, state0), name
    assert loss0[-1] < loss0[0]


LAYOUTS = {  # name: (ranks, settings)
    "one-process": (1, [("parallel.tp", "1")]),
    # the parameters' all-gather lands during the next forward (zero_prefetch), after the update
    "dp2-tp2-zero1": (4, [("parallel.tp", "2"), ("parallel.zero", "1"), ("parallel.zero_prefetch", "true")]),
    "pp2-dp2-zero2": (4, [("parallel.tp", "1"), ("parallel.pp", "2"), ("parallel.zero", "2")]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_bf16_training_is_bit_identical_with_shared_masters(tmp_path, name):
    ranks, extra = LAYOUTS[name]
    variants = [[], [("memory.reuse_fp32_param", "true")]]
    for got in harness.run(ranks, job_rows, str(tmp_path), BF16 + extra, variants, 3, timeout=300):
        assert_identical(got, name)


def job_storage(ctx, run_dir: str) -> dict:
    from meshspeed.train.trainer import Trainer

    out = {}
    for reuse in ("false", "true"):
        over = BF16 + [
            ("run.dir", f"{run_dir}/{reuse}"),
            ("parallel.tp", "1"),
            ("parallel.bucket_mb", "0.05"),
        ]
        trainer = Trainer(config.load(None, over + [("memory.reuse_fp32_param", reuse)]), ctx)
        trainer.train_step(0)
        dp, opt = trainer.dp, trainer.opt
        inside, storages = [], {}
        for b in dp.buckets:
            for s in b.spec.slots:  # every distinct storage behind the parameters, counted once
                st = dp.params[s.name].untyped_storage()
                storages[st.data_ptr()] = st.nbytes()
        for i, b in enumerate(dp.buckets):
            storage = getattr(opt.shards[i], "storage", None)
            if storage is not None:
                lo_ptr, hi_ptr = storage.data_ptr(), storage.data_ptr() + storage.nbytes
                inside += [lo_ptr <= dp.params[s.name].data_ptr() < hi_ptr for s in b.spec.slots]
        out[reuse] = {
            "buckets": len(dp.buckets),
            "inside": inside,
            "param_bytes": sum(storages.values()),
            "param_numel": sum(b.spec.numel for b in dp.buckets),
            "masters": sum(hi - lo for lo, hi in map(dp.opt_range, range(len(dp.buckets)))),
            "state_bytes": opt.state_bytes(),
            "ties": sum(getattr(st, "ties", torch.empty(0)).nbytes for st in opt.shards),
            "master": [st.master.clone() for st in opt.shards],
        }
    return out


def test_parameters_live_in_the_master_storage_and_bytes_are_counted(tmp_path):
    r = harness.run(1, job_storage, str(tmp_path), timeout=120)[0]
    plain, shared = r["false"], r["true"]
    assert shared["buckets"] > 2 and shared["inside"] and all(shared["inside"])
    # the moments stay; each fp32 master (4 bytes) is now the bf16 parameter + a 2-byte residual
    # kept beside the parameters, in their storage: 2 bytes less per master on the device
    assert plain["state_bytes"] == 12 * plain["masters"] and plain["param_bytes"] == 2 * plain["param_numel"]
    assert shared["state_bytes"] == plain["state_bytes"] - 4 * shared["masters"] + shared["ties"]
    assert shared["param_bytes"] == plain["param_bytes"] + 2 * shared["masters"]
    for a, b in zip(plain["master"], shared["master"]):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_dry_run_saves_two_bytes_per_parameter_for_llama3_70b(tmp_path, capsys):
    args = [
        "train",
        "--model.preset",
        "llama3-70b",
        "--nproc",
        "64",
        "--parallel.tp",
        "8",
        "--parallel.pp",
        "4",
    ]
    args += ["--train.dtype", "bfloat16", "--run.dir", str(tmp_path / "r"), "--dry-run"]
    assert cli.main(args + ["--memory.reuse_fp32_param", "true"]) == 0
    text = capsys.readouterr().out
    assert "pp 4 × dp 2 × cp 1 × tp 8" in text and "zero 0" in text, text
    # each group line: "ranks 0-15   2,270,756,864  ..." then "... memory.reuse_fp32_param 4.23 GiB (N B)"
    params = [int(n.replace(",", "")) for n in re.findall(r"ranks [\d,-]+\s+([\d,]+)", text)]
    saved = [int(n.replace(",", "")) for n in re.findall(r"reuse_fp32_param [\d.]+ \w+ \(([\d,]+) B\)", text)]
    assert len(params) == len(saved) >= 2 and saved == [2 * n for n in params], text
    plans = []
    for reuse in ("false", "true"):
        assert cli.main(args + ["--json", "--memory.reuse_fp32_param", reuse]) == 0
        plans.append(json.loads(capsys.readouterr().out))
    for plain, shared in zip(plans[0]["ranks"], plans[1]["ranks"]):
        n = shared["params"]
        assert shared["memory"]["saved"] == {"reuse_fp32_param": 2 * n}
        assert plain["memory"]["optimizer"] - shared["memory"]["optimizer"] == 2 * n
        assert plain["memory"]["total"] - shared["memory"]["total"] == 2 * n
    # ZeRO-1 shards the masters over dp: 2 bytes × the rank's 1/dp of them
    assert cli.main(args + ["--json", "--memory.reuse_fp32_param", "true", "--parallel.zero", "1"]) == 0
    for r in json.loads(capsys.readouterr().out)["ranks"]:
        assert r["memory"]["saved"] == {"reuse_fp32_param": 2 * -(-r["params"] // 2)}


def job_run(ctx, run_dir: str, extra: list) -> list[float]:
    """A whole Trainer.run() (checkpoints, exit, resume); the losses of its metrics file."""
    from meshspeed.train.trainer import Trainer

    Trainer(config.load(None, extra + [("run.dir", run_dir)]), ctx).run()
    with open(f"{run_dir}/metrics.jsonl") as f:
        return [json.loads(line)["loss"] for line in f]


def check_resume_across(tmp_path, setting: tuple[str, str]) -> None:
    """A plain bf16 ZeRO-1 run saved at step 2 resumes with the feature on, and one saved with
    it resumes with it off: both give the uninterrupted plain run's losses, bit for bit."""
    base = BF16 + [("parallel.tp", "1"), ("parallel.zero", "1"), ("train.steps", "4")]
    on, off = [setting], [(setting[0], "false")]
    want = harness.run(2, job_run, str(tmp_path / "straight"), base, timeout=200)[0]
    for first, then in ((off, on), (on, off)):
        split = str(tmp_path / f"split-{first[0][1]}")
        harness.run(2, job_run, split, base + first + [("train.exit_interval", "2")], timeout=200)
        got = harness.run(2, job_run, split, base + then + [("checkpoint.resume", "latest")], timeout=200)[0]
        assert got == want, f"saved with {first}, resumed with {then}: {got} vs {want}"


def test_checkpoints_move_between_shared_and_separate_masters(tmp_path):
    check_resume_across(tmp_path, ("memory.reuse_fp32_param", "true"))
