"""The run plan (issue 10): every bad setting is one line before any worker starts, `--dry-run`
prints the plan for any world size, and the plan is what the workers run and what meta.json
records."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from meshspeed import cli
from meshspeed.comm import ConfigError, launch
from meshspeed.models import get_preset, preset_names
from meshspeed.models.flops import param_count
from meshspeed.plan import config
from meshspeed.plan.run_plan import make_plan
from tests import warm

SMALL = ["--train.seq_len", "32", "--train.global_batch_size", "8", "--train.micro_batch_size", "2"]


@pytest.fixture
def no_workers(monkeypatch):
    """A setting that gets past the plan would spawn workers: make that a test failure."""

    def spawn(*a, **k):
        raise AssertionError("a worker was spawned")

    monkeypatch.setattr(launch, "spawn", spawn)
    monkeypatch.setattr(launch, "run_worker", spawn)


def _cli(args, capsys) -> tuple[int, str, str]:
    rc = cli.main(["train", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


BAD = [
    (["--train.lr", "inf"], "train.lr=inf is not a finite number"),
    (["--train.lr", "nan"], "train.lr=nan is not a finite number"),
    (["--train.lr", "0"], "train.lr=0.0 must be > 0"),
    (["--train.grad_clip", "-1"], "train.grad_clip=-1.0 must be ≥ 0"),
    (["--data.max_mb", "0"], "data.max_mb=0.0 must be > 0"),
    (["--run.log_interval", "0"], "run.log_interval=0 must be ≥ 1"),
    (["--train.eval_batches", "0"], "train.eval_batches=0 must be ≥ 1"),
    (["--train.beta2", "1"], "train.beta2=1.0 must be in [0, 1)"),
    (["--train.weight_decay", "-0.1"], "train.weight_decay=-0.1 must be ≥ 0"),
    (["--parallel.bucket_mb", "0"], "parallel.bucket_mb=0.0 must be > 0"),
    (["--train.steps", "0"], "train.steps=0 must be ≥ 1"),
    (["--train.steps", "ten"], "train.steps='ten' is not an integer"),
    (["--parallel.zero", "4"], "parallel.zero='4' is not valid"),
    (["--parallel.zero", "3", "--sparsity.pattern", "2:4"], "parallel.zero=3 with sparsity.pattern=2:4"),
    (["--parallel.zero", "3", "--parallel.zero_prefetch", "true"], "ZeRO-3 always prefetches"),
    (["--nproc", "3", "--parallel.tp", "3"], "parallel.tp=3 does not divide n_heads=4"),
    (["--nproc", "4", "--parallel.tp", "4", "--model.n_kv_heads", "2"], "parallel.tp=4 does not divide"),
    (
        [
            "--nproc",
            "2",
            "--parallel.tp",
            "2",
            "--parallel.sequence_parallel",
            "true",
            "--train.seq_len",
            "33",
        ],
        "train.seq_len=33 is not divisible by parallel.tp=2",
    ),
    (["--nproc", "3", "--parallel.tp", "2"], "does not divide the world size 3"),
    (["--nproc", "4", "--parallel.tp", "2", "--parallel.dp", "4"], "set parallel.dp=2"),
    (["--train.global_batch_size", "6", "--train.micro_batch_size", "4"], "micro_batch_size × parallel.dp"),
    (["--nproc", "4", "--train.global_batch_size", "10"], "use train.global_batch_size=8 or 12"),
    (
        ["--nproc", "2", "--parallel.tp", "1", "--parallel.pp", "2", "--parallel.pp_layout", "3,3"],
        "places 6 layers but the model has n_layers=2",
    ),
    (
        ["--nproc", "2", "--parallel.tp", "1", "--parallel.pp", "2", "--parallel.pp_schedule", "interleaved"],
        "needs parallel.vpp >= 2",
    ),
    (
        ["--nproc", "4", "--parallel.tp", "1", "--parallel.pp", "2", "--model.n_layers", "4"]
        + ["--parallel.vpp", "2", "--parallel.pp_schedule", "interleaved", "--train.global_batch_size", "2"]
        + ["--train.micro_batch_size", "1"],
        "e.g. train.global_batch_size=4",
    ),
    (["--parallel.vpp", "2"], "parallel.vpp=2 needs parallel.pp > 1"),
    (["--model.preset", "nope"], "model.preset=nope: unknown model preset 'nope'"),
    (["--model.dim", "100"], "model.dim=100: ModelConfig.n_heads=4 gives head_dim=25"),
    (["--run.overwrite", "true", "--checkpoint.resume", "latest"], "choose one of them"),
    (["--json"], "--json prints the plan of --dry-run"),
    (["--data.path", "/no/such/tokens.bin"], "data.path='/no/such/tokens.bin' does not exist"),
    (["--nproc", "2", "--parallel.tp", "1", "--parallel.ep", "2"], "parallel.ep=2 needs a mixture-of"),
    (
        ["--model.preset", "tiny-moe", "--nproc", "3", "--parallel.tp", "1", "--parallel.ep", "3"]
        + ["--train.global_batch_size", "6", "--train.micro_batch_size", "2"],
        "parallel.ep=3 does not divide the model's 4 experts; use one of 1, 2, 4",
    ),
    (
        ["--model.preset", "tiny-moe", "--nproc", "4", "--parallel.ep", "2", "--moe.tp_extend_ep", "true"]
        + ["--parallel.etp", "2"],
        "moe.tp_extend_ep=True with parallel.etp=2: folding tp into the expert-parallel group keeps",
    ),
    (
        ["--model.preset", "tiny-moe", "--nproc", "8", "--parallel.ep", "4", "--moe.tp_extend_ep", "true"],
        "parallel.ep=4 × parallel.tp=2 (moe.tp_extend_ep) does not divide the model's 4 experts",
    ),
    (["--model.preset", "tiny-moe", "--nproc", "4", "--parallel.etp", "3"], "parallel.etp=3 must be 1"),
    (
        ["--model.preset", "tiny-moe", "--nproc", "4", "--parallel.etp", "1", "--moe.capacity_factor", "1"],
        "moe.capacity_factor=1 with parallel.tp=2 needs each expert split over tp",
    ),
    (["--nproc", "4", "--parallel.tp", "1", "--parallel.ep", "3"], "parallel.ep=3 must divide dp×cp = 4"),
    (
        ["--model.preset", "tiny-moe", "--parallel.tp", "1", "--moe.capacity_factor", "1"]
        + ["--moe.dispatcher", "allgather"],
        "needs moe.dispatcher=alltoall",
    ),
    (
        ["--model.preset", "tiny-moe", "--moe.balance", "bias", "--moe.bias_update_rate", "0"],
        "moe.bias_update_rate=0 must be > 0 with moe.balance=bias",
    ),
    (["--model.preset", "tiny-moe", "--moe.capacity_factor", "-1"], "moe.capacity_factor=-1 must be > 0"),
    (["--memory.reuse_fp32_param", "true"], "memory.reuse_fp32_param=true needs train.dtype=bfloat16"),
    (
        ["--train.dtype", "bfloat16", "--memory.reuse_fp32_param", "true"]
        + ["--memory.offload_optimizer", "true"],
        "the offloaded masters take no device memory to share",
    ),
    (
        ["--memory.swap_activations", "true", "--memory.recompute", "selective"],
        "memory.swap_activations=true with memory.recompute=selective",
    ),
    (["--memory.swap_layers", "-1"], "memory.swap_layers=-1 must be ≥ 0"),
    (["--model.preset", "tiny-moe", "--moe.replicate_hot", "-1"], "moe.replicate_hot=-1 must be >= 0"),
    (
        ["--model.preset", "tiny-moe", "--moe.replicate_hot", "2"],
        "moe.replicate_hot=2 needs parallel.ep >= 2",
    ),
    (
        ["--model.preset", "tiny-moe", "--nproc", "2", "--parallel.tp", "1", "--parallel.ep", "2"]
        + ["--moe.replicate_hot", "2", "--moe.dispatcher", "allgather"],
        "moe.replicate_hot=2 needs moe.dispatcher=alltoall",
    ),
    (
        ["--model.preset", "tiny-moe", "--nproc", "2", "--parallel.tp", "1", "--parallel.ep", "2"]
        + ["--moe.replicate_hot", "1", "--moe.capacity_factor", "1"],
        "moe.replicate_hot=1 needs dropless routing (moe.capacity_factor=0)",
    ),
    (
        ["--model.preset", "tiny-moe", "--nproc", "4", "--parallel.ep", "2", "--moe.replicate_hot", "1"],
        "moe.replicate_hot=1 needs parallel.tp=1",
    ),
]


@pytest.mark.parametrize("args,needle", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_setting_is_one_line_and_no_worker(args, needle, tmp_path, capsys, no_workers):
    rc, out, err = _cli(SMALL + ["--run.dir", str(tmp_path / "run"), *args], capsys)
    assert rc == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in err, err


def test_run_dir_that_is_a_file_and_unknown_model_key(tmp_path, capsys, no_workers):
    f = tmp_path / "file"
    f.write_text("x")
    rc, _, err = _cli(SMALL + ["--run.dir", str(f)], capsys)
    assert rc == 2 and err.count("\n") == 1 and "is a file" in err, err
    rc, _, err = _cli(SMALL + ["--run.dir", str(f / "below")], capsys)
    assert rc == 2 and err.count("\n") == 1 and "which is a file" in err, err
    toml = tmp_path / "c.toml"
    toml.write_text('[model]\npreset = "tiny"\nvocab = 3\n')
    rc, _, err = _cli(["--config", str(toml), "--run.dir", str(tmp_path / "r")], capsys)
    assert rc == 2 and err.count("\n") == 1 and "unknown setting 'model.vocab'" in err, err


def test_dry_run_prints_the_plan_and_starts_nothing(tmp_path, capsys, no_workers):
    args = ["--nproc", "4", "--parallel.tp", "1", "--parallel.pp", "2", "--model.n_layers", "4"]
    rc, out, err = _cli(SMALL + args + ["--run.dir", str(tmp_path / "r"), "--dry-run"], capsys)
    assert rc == 0, err
    assert "pp 2 × dp 2 × cp 1 × tp 1" in out and "bubble" in out and "stage 1" in out, out
    assert not (tmp_path / "r").exists()  # a dry run writes nothing


def test_pipeline_with_fewer_micro_batches_than_stages_warns(tmp_path):
    over = [("parallel.pp", "2"), ("parallel.tp", "1"), ("train.global_batch_size", "2")]
    over += [("train.micro_batch_size", "2"), ("run.dir", str(tmp_path))]
    plan = make_plan(config.load(None, over), 2, ranks=False)
    assert plan.microbatches == 1 and len(plan.warnings) == 1 and "idles 50%" in plan.warnings[0]


@pytest.mark.parametrize("preset", preset_names())
def test_dry_run_json_for_every_preset_at_64_ranks(preset, capsys, no_workers, tmp_path):
    c = get_preset(preset)
    tp = 8 if c.n_kv_heads % 8 == 0 and c.n_heads % 8 == 0 else 1
    pp = 4 if c.n_layers % 4 == 0 and c.n_layers >= 8 and not c.tie_embeddings else 1
    if c.family == "dit" and c.text_dim:  # text tokens are not carried between stages (refused)
        pp = 1
    dp = 64 // (tp * pp)
    args = ["--model.preset", preset, "--nproc", "64", "--parallel.tp", str(tp), "--parallel.pp", str(pp)]
    args += ["--train.objective", "flow"] if c.family == "dit" else []  # diffusion trains on flow
    args += ["--train.objective", "sft"] if c.family == "vlm" else []  # the caption loss
    args += ["--train.global_batch_size", str(dp * 4), "--train.micro_batch_size", "1"]
    seq = "512" if c.family == "vlm" else "128"  # a vlm's sequence holds its image tokens (256 at 7B)
    args += ["--train.seq_len", seq, "--run.dir", str(tmp_path / "r"), "--dry-run", "--json"]
    rc, out, err = _cli(args, capsys)
    assert rc == 0, err
    plan = json.loads(out)
    ranks = plan["ranks"]
    assert [r["rank"] for r in ranks] == list(range(64))
    assert plan["dims"] == {"dp": dp, "pp": pp, "cp": 1, "tp": tp, "ep": 1, "etp": 0, "tp_extend_ep": False}
    for r in ranks:
        assert set(r["coords"]) >= {"pp", "dp", "tp"} and r["params"] > 0
        mem = r["memory"]
        assert mem["total"] == sum(mem[k] for k in ("params", "grads", "optimizer", "activations", "buffers"))
    # one data-parallel replica (dp coordinate 0) holds the whole model, each parameter once
    replica = sum(r["params"] for r in ranks if r["coords"]["dp"] == 0)
    assert plan["total_params"] == param_count(c)
    if tp == 1 or not c.tie_embeddings:
        assert replica == plan["total_params"] + _replicated(c, tp, pp), preset


def _replicated(c, tp: int, pp: int) -> int:
    """Parameters each tp rank holds whole (norms, the router): counted tp times in a replica."""
    if c.family == "dit":  # patch, timestep and class embedders, row-parallel biases, final Linear
        d, out = c.dim, c.patch_size**2 * c.in_channels * (2 if c.learn_sigma else 1)
        whole = (c.in_channels * c.patch_size**2 + 1) * d + (256 + 1) * d + (d + 1) * d
        whole += (c.n_classes + 1) * d if c.n_classes else 0
        whole += c.n_layers * (3 if c.text_dim else 2) * d + (d + 1) * out  # wo, fc2 (, cross.wo) biases
        return (tp - 1) * whole
    norms = (2 * c.n_layers + 1) * c.dim
    router = sum(c.dim * c.n_experts for i in range(c.n_layers) if c.is_moe_layer(i)) if c.n_experts else 0
    return (tp - 1) * (norms + router)


def test_plan_layout_matches_the_world_and_model():
    cfg = config.load(None, [("parallel.tp", "2"), ("train.global_batch_size", "16")])
    plan = make_plan(cfg, 8)
    assert plan.dims["dp"] == 4 and plan.microbatches == 1 and len(plan.ranks) == 8
    assert plan.model_config() == get_preset("tiny")
    with pytest.raises(ConfigError, match="does not divide the world size 3"):
        make_plan(cfg, 3)


def test_the_run_records_its_plan_in_meta_json(tmp_path):
    """A real run (one spawned worker): meta.json of its checkpoint holds the resolved plan."""
    run = tmp_path / "run"
    args = ["--nproc", "1", "--parallel.tp", "1", "--train.steps", "1", "--data.max_mb", "0.2"]
    out = warm.run(
        [sys.executable, "-m", "meshspeed", "train", *SMALL, *args, "--run.dir", str(run)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    meta = json.loads((run / "step-000001" / "meta.json").read_text())
    plan = meta["config"]
    assert plan["dims"]["dp"] == 1 and plan["microbatches"] == 4 and plan["world_size"] == 1
    assert plan["config"]["train"]["seq_len"] == 32 and plan["model"]["n_layers"] == 2


def test_torchrun_bad_setting_is_one_line_from_one_rank(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "meshspeed", "train"]
        + ["--train.lr", "inf", "--run.dir", str(tmp_path / "r")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert out.returncode != 0
    ours = [ln for ln in out.stderr.splitlines() if ln.startswith("meshspeed train:")]
    assert ours == ["meshspeed train: train.lr=inf is not a finite number; default 0.003"], out.stderr[-2000:]


@pytest.mark.parametrize("family", ["llama", "qwen2", "mixtral"])
def test_dry_run_of_a_hugging_face_directory_counts_its_parameters(family, tmp_path, capsys, no_workers):
    """The plan's model is read from config.json; its parameter count is transformers' own."""
    pytest.importorskip("transformers")
    from tests.interop.test_hf import make_hf

    model = make_hf(family, str(tmp_path / "hf"), vocab_size=256)  # the byte tokenizer fits
    args = ["--model.init_from", str(tmp_path / "hf"), "--nproc", "4", "--parallel.tp", "2"]
    rc, out, err = _cli(SMALL + args + ["--run.dir", str(tmp_path / "r"), "--dry-run", "--json"], capsys)
    assert rc == 0, err
    plan = json.loads(out)
    assert plan["total_params"] == model.num_parameters()
    assert plan["model"]["vocab_size"] == model.config.vocab_size
