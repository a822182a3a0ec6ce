"""diffusers DiTTransformer2DModel directories in and out (issue 41 item 7): a tiny random model
(built from a config, nothing downloaded) saved with save_pretrained loads into the dit family
(one forward equals diffusers' within 1e-5, single file or sharded index); `--model.init_from`
that directory starts the trainer from its weights under tp 2 + SP (each rank reading only its
slices) and dp 2 ZeRO-3, equal to one process; `meshspeed convert` imports it, and exports a
trained dit run back (its EMA by default, --no-ema the trained weights) to what
`DiTTransformer2DModel.from_pretrained` loads, whose forward equals meshspeed's."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from meshspeed.plan import config
from tests import harness

# diffusers imported in the tests, not here: the spawned ranks import this module to find the
# jobs, and diffusers takes seconds to import.
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("diffusers") is None, reason="diffusers is a dev extra (the dit oracle)"
)

# digits-shaped (1 channel, 8 × 8, 10 classes) so the trainer's default data fits; learn_sigma
# (out = 2 · in) so the channel order of the unpatchify shows
TINY = dict(
    num_attention_heads=2,
    attention_head_dim=16,
    in_channels=1,
    out_channels=2,
    num_layers=2,
    sample_size=8,
    patch_size=2,
    num_embeds_ada_norm=10,
)
BASE = [
    ("train.objective", "flow"),
    ("train.seq_len", "16"),
    ("train.global_batch_size", "8"),
    ("train.micro_batch_size", "2"),
    ("train.dtype", "float32"),
    ("train.eval_interval", "0"),
    ("train.warmup_steps", "1"),
    ("train.lr", "1e-2"),
    ("parallel.tp", "1"),
    ("flow.ema_decay", "0.5"),
]


def diffusers_model(seed: int = 0, shared: bool = True):
    import diffusers

    torch.manual_seed(seed)
    model = diffusers.DiTTransformer2DModel(**TINY).eval()
    with torch.no_grad():
        for p in model.parameters():  # diffusers zero-inits the adaLN paths: make every weight live
            p.add_(0.02 * torch.randn_like(p))
        if shared:  # one conditioning embedder, as DiT's checkpoints have (dit requires it)
            first = model.transformer_blocks[0].norm1.emb
            for block in model.transformer_blocks[1:]:
                block.norm1.emb.load_state_dict(first.state_dict())
    return model


def inputs(n: int = 3):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(n, TINY["in_channels"], 8, 8, generator=gen)
    return x, torch.tensor([0.0, 0.37, 1.0])[:n], torch.tensor([0, 7, 10])[:n]  # 10: the null class


def diffusers_forward(model, x, t, y) -> torch.Tensor:
    with torch.no_grad():  # diffusers' timestep is 1000·t (models/dit.py)
        return model(x, timestep=t * 1000.0, class_labels=y).sample


def dit_forward(weights: dict, x, t, y) -> torch.Tensor:
    from meshspeed.interop.diffusers_dit import config_from_diffusers
    from meshspeed.models import build_model

    dit = build_model(config_from_diffusers(TINY)).eval()
    dit.load_state_dict(weights)
    with torch.no_grad():
        return dit(x, t, y)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{"model": the diffusers model, "dir": its save_pretrained directory}."""
    model = diffusers_model()
    path = tmp_path_factory.mktemp("diffusers") / "dit"
    model.save_pretrained(str(path))
    return {"model": model, "dir": str(path)}


@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "index"])
def test_directory_loads_into_dit_and_forward_equals_diffusers(tmp_path, sharded):
    from meshspeed import comm
    from meshspeed.interop.diffusers_io import DiffusersCheckpoint, diffusers_recipe
    from meshspeed.parallel.materialize import build_parallel_model

    model = diffusers_model(seed=1)
    model.save_pretrained(str(tmp_path), max_shard_size="20KB" if sharded else "10GB")
    assert os.path.isfile(tmp_path / "diffusion_pytorch_model.safetensors.index.json") == sharded
    mesh = comm.ParallelDims().build(comm.init(device="cpu"))
    dit = build_parallel_model(diffusers_recipe(DiffusersCheckpoint(str(tmp_path))), mesh).eval()
    x, t, y = inputs()
    with torch.no_grad():
        got = dit(x, t, y)
    want = diffusers_forward(model, x, t, y)
    assert got.shape == want.shape == (3, 2, 8, 8)
    assert (got - want).abs().max().item() < 1e-5 and want.abs().max().item() > 1e-2


def job_start(ctx, run_dir: str, init_from: str, extra: list):
    """(whole weights before any step on rank 0, first loss, elements this rank read from the
    safetensors files: counted where the files are read, below the dit-name mapping)."""
    from meshspeed.interop.hf_import import SafetensorsFiles
    from meshspeed.train.trainer import Trainer
    from tests.train.test_dit_trainer import whole_weights

    read, orig = [], SafetensorsFiles.read

    def counting(self, name, window):
        out = orig(self, name, window)
        read.append(out.numel())
        return out

    SafetensorsFiles.read = counting
    try:
        cfg = config.load(None, BASE + [("run.dir", run_dir), ("model.init_from", init_from)] + extra)
        trainer = Trainer(cfg, ctx)
    finally:
        SafetensorsFiles.read = orig
    weights = whole_weights(trainer)
    return (weights if ctx.rank == 0 else None), trainer.train_step(0)["loss"], sum(read)


LAYOUTS = {
    "tp2-sp": [("parallel.tp", "2"), ("parallel.sequence_parallel", "true")],
    "dp2-zero3": [("parallel.zero", "3")],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_init_from_diffusers_dir_starts_every_layout_from_its_weights(saved, tmp_path, layout):
    from meshspeed.interop.diffusers_dit import config_from_diffusers, from_diffusers

    want = from_diffusers(saved["model"].state_dict(), config_from_diffusers(TINY))
    solo = harness.run(1, job_start, str(tmp_path / "one"), saved["dir"], [], timeout=120)[0]
    got = harness.run(2, job_start, str(tmp_path / layout), saved["dir"], LAYOUTS[layout], timeout=120)
    for weights in (solo[0], got[0][0]):
        assert set(weights) == set(want)
        for n, w in want.items():
            assert torch.equal(weights[n], w), f"{layout}: {n} is not diffusers' weight"
    for rank, (_, loss, _) in enumerate(got):
        assert abs(loss - solo[1]) <= 2e-5 * abs(solo[1]), f"{layout} rank {rank}: {loss} vs {solo[1]}"
    if layout.startswith("tp"):  # each rank reads its slices: less than one process reads
        assert all(r[2] < solo[2] for r in got), [r[2] for r in got] + [solo[2]]


def job_train(ctx, run_dir: str, init_from: str):
    """Two steps from the diffusers directory, checkpointed at the end: (weights, EMA)."""
    from meshspeed.train.trainer import Trainer
    from tests.train.test_dit_trainer import whole_weights

    cfg = config.load(
        None, BASE + [("run.dir", run_dir), ("model.init_from", init_from), ("train.steps", "2")]
    )
    trainer = Trainer(cfg, ctx)
    trainer.run()
    return whole_weights(trainer), trainer.ema.whole()


def test_convert_imports_the_directory_and_exports_a_run_with_its_ema(saved, tmp_path, capsys):
    import diffusers

    from meshspeed.cli import main
    from meshspeed.interop.diffusers_dit import config_from_diffusers, from_diffusers
    from meshspeed.interop.model_source import checkpoint_model_config, checkpoint_state

    # in: the checkpoint holds the diffusers weights and the config; training starts from it too
    ck = str(tmp_path / "ck")
    assert main(["convert", "--from-hf", saved["dir"], "--out", ck]) == 0
    assert checkpoint_model_config(ck) == config_from_diffusers(TINY)
    want = from_diffusers(saved["model"].state_dict(), config_from_diffusers(TINY))
    solo = harness.run(1, job_start, str(tmp_path / "from-ck"), ck, [], timeout=120)[0]
    assert all(torch.equal(solo[0][n], w) for n, w in want.items())

    # out: a run trained from the diffusers directory, exported with its EMA and without
    run = str(tmp_path / "run")
    weights, ema = harness.run(1, job_train, run, saved["dir"], timeout=120)[0]
    assert checkpoint_state(run)[1]["extra"]["ema"] is not None
    x, t, y = inputs()
    capsys.readouterr()
    for flag, expect in (([], ema), (["--no-ema"], weights)):
        out = str(tmp_path / f"out{len(flag)}")
        assert main(["convert", "--checkpoint", run, "--to-hf", out, *flag]) == 0
        line = capsys.readouterr().out
        assert ("the EMA of the weights" in line) == (not flag), line
        back = diffusers.DiTTransformer2DModel.from_pretrained(out).eval()
        err = (diffusers_forward(back, x, t, y) - dit_forward(expect, x, t, y)).abs().max().item()
        assert err < 1e-5, f"{flag}: diffusers' forward of the export is {err:.2e} off meshspeed's"
        got = from_diffusers(back.state_dict(), config_from_diffusers(TINY))
        assert all(torch.equal(got[n], w) for n, w in expect.items()), flag
        assert json.load(open(os.path.join(out, "config.json")))["_class_name"] == "DiTTransformer2DModel"
    assert any(not torch.equal(ema[n], weights[n]) for n in ema)  # the two exports differ


def test_refusals_are_one_line(saved, tmp_path, capsys):
    from meshspeed.cli import main

    def refused(argv) -> str:
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "Traceback" not in err, err
        return err

    unet = tmp_path / "unet"
    unet.mkdir()
    (unet / "config.json").write_text(json.dumps({"_class_name": "UNet2DModel"}))
    err = refused(["convert", "--from-hf", str(unet), "--out", str(tmp_path / "a")])
    assert "a diffusers UNet2DModel directory" in err and "DiTTransformer2DModel" in err
    pipe = tmp_path / "pipe"  # a pipeline's root: the transformer is in its subfolder
    diffusers_model().save_pretrained(str(pipe / "transformer"))
    (pipe / "config.json").write_text(json.dumps({"_class_name": "DiTPipeline"}))
    assert "transformer" in refused(["convert", "--from-hf", str(pipe), "--out", str(tmp_path / "b")])
    own = tmp_path / "own"  # diffusers' own init: each block its own embedder
    diffusers_model(shared=False).save_pretrained(str(own))
    err = refused(["convert", "--from-hf", str(own), "--out", str(tmp_path / "c")])
    assert "shares one conditioning embedder" in err
    dropout = tmp_path / "dropout"
    dropout.mkdir()
    cfg = json.load(open(os.path.join(saved["dir"], "config.json")))
    (dropout / "config.json").write_text(json.dumps({**cfg, "dropout": 0.1}))
    assert "dropout=0.1" in refused(["convert", "--from-hf", str(dropout), "--out", str(tmp_path / "d")])
    ck = str(tmp_path / "ck")
    assert main(["convert", "--from-hf", saved["dir"], "--out", ck]) == 0
    assert "tokenizer" in refused(
        ["convert", "--checkpoint", ck, "--to-hf", str(tmp_path / "e"), "--tokenizer", "x"]
    )
