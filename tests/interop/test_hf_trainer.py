"""`--model.init_from` a Hugging Face directory: the first loss under tp 2 and pp 2 equals one
process's, each rank reads only its slices, and `--checkpoint.export_hf` writes what
transformers loads; a tokenizer whose vocabulary the model cannot hold is one line."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from meshspeed import comm
from meshspeed.comm.errors import ConfigError
from meshspeed.plan import config
from meshspeed.train.trainer import Trainer
from tests import harness

# Imported in the tests, not here: the spawned ranks import this module to find the jobs, and
# transformers takes seconds to import.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")

BASE = [
    ("train.seq_len", "32"),
    ("train.global_batch_size", "8"),
    ("train.micro_batch_size", "2"),
    ("train.dtype", "float32"),
    ("train.eval_interval", "0"),
    ("train.warmup_steps", "3"),
    ("data.max_mb", "1"),
    ("parallel.tp", "1"),
]


def _cfg(run_dir: str, extra: list) -> config.Config:
    return config.load(None, BASE + [("run.dir", run_dir)] + extra)


def job_first_loss(ctx, run_dir: str, extra: list):
    """(first loss, elements this rank read from the Hugging Face files)."""
    from meshspeed.interop.hf_import import HFCheckpoint

    read, orig = [], HFCheckpoint.read

    def counting(self, name, window):
        out = orig(self, name, window)
        read.append(out.numel())
        return out

    HFCheckpoint.read = counting
    try:
        trainer = Trainer(_cfg(run_dir, extra), ctx)
    finally:
        HFCheckpoint.read = orig
    return trainer.train_step(0)["loss"], sum(read)


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """Tiny Llama (GQA, 4/2 heads) and Mixtral directories, byte vocabulary."""
    import transformers

    root = tmp_path_factory.mktemp("hf")
    common = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    out = {}
    for name, cls, cfg in (
        ("llama", "LlamaForCausalLM", transformers.LlamaConfig(**common)),
        (
            "mixtral",
            "MixtralForCausalLM",
            transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2),
        ),
    ):
        torch.manual_seed(0)
        getattr(transformers, cls)(cfg).save_pretrained(str(root / name), max_shard_size="50KB")
        out[name] = str(root / name)
    return out


LAYOUTS = [
    ("llama", "tp2", 2, [("parallel.tp", "2")]),
    ("llama", "pp2", 2, [("parallel.pp", "2")]),
    ("mixtral", "tp2", 2, [("parallel.tp", "2")]),
]


@pytest.mark.parametrize("family,name,ws,extra", LAYOUTS, ids=[f"{f}-{n}" for f, n, _, _ in LAYOUTS])
def test_init_from_first_loss_equals_one_process(tmp_path, hf_models, family, name, ws, extra):
    init = [("model.init_from", hf_models[family])]
    ((want, full),) = harness.run(1, job_first_loss, str(tmp_path / "one"), init)
    got = harness.run(ws, job_first_loss, str(tmp_path / name), init + extra)
    for loss, _ in got:
        assert abs(loss - want) <= 1e-5 * abs(want), f"{family} {name}: {loss} vs one process {want}"
    # each rank read its own slices: about half of what one process read (norms, router replicated)
    assert all(n < 0.6 * full for _, n in got), ([n for _, n in got], full)


def job_export(ctx, run_dir: str, extra: list, out: str):
    from meshspeed.interop.hf_export import export_hf

    trainer = Trainer(_cfg(run_dir, extra), ctx)
    return export_hf(trainer.model, trainer.mesh, out, trainer.model_config, max_shard_bytes=40_000)


def test_round_trip_through_pipeline_stages_is_exact(tmp_path, hf_models):
    """Read as pieces by each rank, written back per stage (shard numbers agreed across stages):
    every tensor bit for bit. (Under tp, test_sparse_tp_run_exports_what_it_computes.)"""
    from meshspeed.checkpoint.safetensors_io import read_safetensors

    src, out = hf_models["mixtral"], str(tmp_path / "out")
    files = harness.run(
        2, job_export, str(tmp_path / "run"), [("model.init_from", src), ("parallel.pp", "2")], out
    )[0]
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 2 and os.path.isfile(os.path.join(out, "model.safetensors.index.json"))

    def tensors(paths):
        out = {}
        for f in paths:
            out.update(read_safetensors(f)[0])
        return out

    a = tensors(os.path.join(src, f) for f in os.listdir(src) if f.endswith(".safetensors"))
    b = tensors(shards)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_init_from_a_converted_checkpoint_under_tp2(tmp_path, hf_models):
    """`convert --from-hf` then `--model.init_from RUN_DIR`: the same start as from the directory."""
    from meshspeed.interop.hf_import import convert_from_hf

    conv = str(tmp_path / "conv")
    convert_from_hf(hf_models["llama"], conv)
    ((want, _),) = harness.run(
        1, job_first_loss, str(tmp_path / "a"), [("model.init_from", hf_models["llama"])]
    )
    got = harness.run(
        2, job_first_loss, str(tmp_path / "b"), [("model.init_from", conv), ("parallel.tp", "2")]
    )
    assert all(abs(loss - want) <= 1e-5 * abs(want) for loss, _ in got), (got, want)


WORDS = "the a model of data one two three four five six seven eight nine ten rank shard layer head".split()


@pytest.fixture(scope="module")
def word_data(tmp_path_factory):
    """Text files of words and a Hugging Face word-level tokenizer for them (vocabulary 22)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    root = tmp_path_factory.mktemp("words")
    g = torch.Generator().manual_seed(0)
    os.makedirs(root / "text")
    for f in range(4):
        ids = torch.randint(0, len(WORDS), (3000,), generator=g).tolist()
        (root / "text" / f"doc{f}.txt").write_text(" ".join(WORDS[i] for i in ids))
    vocab = {w: i for i, w in enumerate(WORDS + ["[UNK]", "<|endoftext|>"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    os.makedirs(root / "tok")
    tok.save(str(root / "tok" / "tokenizer.json"))
    return str(root / "text"), str(root / "tok")


def test_text_is_tokenized_with_a_hf_tokenizer(word_data):
    from meshspeed.data.loader import load_tokens
    from meshspeed.data.tokenizer import load_tokenizer

    text, tok_dir = word_data
    tok = load_tokenizer(tok_dir)
    assert (tok.vocab_size, tok.eot) == (len(WORDS) + 2, len(WORDS) + 1)
    train, val = load_tokens(text, "text", tokenizer=tok, cache_dir=None)
    assert (
        int((train == tok.eot).sum()) == 3 and int((val == tok.eot).sum()) == 1
    )  # 3 train files, 1 validation
    ids = torch.cat([train, val]).tolist()
    docs, start = [], 0
    for i, t in enumerate(ids):
        if t == tok.eot:
            docs.append(tok.decode(ids[start:i]).split())
            start = i + 1
    files = [open(os.path.join(text, f)).read().split() for f in os.listdir(text)]
    assert sorted(docs) == sorted(files)


def job_train_then_logits(ctx, run_dir: str, extra: list, x: torch.Tensor):
    """Train (Trainer.run: checkpoints, exports), then the trained tp model's full logits on x."""
    from meshspeed import comm as c

    trainer = Trainer(_cfg(run_dir, extra), ctx)
    trainer.run()
    trainer.model.eval()
    with torch.no_grad():
        logits = trainer.model(x)  # [batch, seq, vocab / tp]: the output layer is split over the vocabulary
    return c.all_gather(logits.contiguous(), trainer.mesh["tp"], dim=-1)


def test_sparse_tp_run_exports_what_it_computes(tmp_path, hf_models, word_data):
    """tp 2, 2:4 sparsity, a Hugging Face tokenizer: run.dir/hf loads in transformers with the
    trained model's logits, masked weights and the tokenizer; `convert --checkpoint` of the last
    checkpoint writes the same tensors."""
    import transformers

    from meshspeed.checkpoint.safetensors_io import read_safetensors
    from meshspeed.cli import main

    run, x = str(tmp_path / "run"), torch.randint(0, 22, (1, 16), generator=torch.Generator().manual_seed(1))
    got = harness.run(
        2,
        job_train_then_logits,
        run,
        [
            ("model.init_from", hf_models["llama"]),
            ("parallel.tp", "2"),
            ("train.steps", "2"),
            ("checkpoint.export_hf", "true"),
            ("data.path", word_data[0]),
            ("data.tokenizer", word_data[1]),
            ("train.eval_batches", "1"),
            ("sparsity.pattern", "2:4"),
        ],
        x,
    )[0]
    hf = os.path.join(run, "hf")
    assert os.path.isfile(os.path.join(hf, "tokenizer.json"))  # the run's tokenizer goes with it
    model = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
    with torch.no_grad():
        assert (model(x).logits - got).abs().max() <= 1e-4
    w = model.model.layers[0].mlp.gate_proj.weight.detach()
    assert ((w.view(-1, 4) != 0).sum(-1) <= 2).all()  # 2:4 along the input dim, as masked in training
    assert main(["convert", "--checkpoint", run, "--to-hf", str(tmp_path / "conv")]) == 0
    a, b = (
        read_safetensors(os.path.join(hf, "model.safetensors"))[0],
        read_safetensors(str(tmp_path / "conv" / "model.safetensors"))[0],
    )
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert os.path.isfile(tmp_path / "conv" / "tokenizer.json")


def test_tokenizer_vocabulary_must_fit_the_model(tmp_path, hf_models):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(300)} | {"[UNK]": 300}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ConfigError) as e:
        Trainer(
            _cfg(
                str(tmp_path / "run"),
                [("model.init_from", hf_models["llama"]), ("data.tokenizer", str(tmp_path))],
            ),
            comm.init(),
        )
    assert "has 301 tokens but the model's vocab_size is 256" in str(e.value) and "\n" not in str(e.value)


def test_init_from_under_expert_parallelism_reads_only_this_ranks_experts(tmp_path, hf_models):
    """Mixtral at ep 2: experts born sharded from the file's slices, first loss as one process."""
    init = [("model.init_from", hf_models["mixtral"]), ("parallel.tp", "1")]
    ((want, full),) = harness.run(1, job_first_loss, str(tmp_path / "one"), init)
    got = harness.run(2, job_first_loss, str(tmp_path / "ep2"), init + [("parallel.ep", "2")])
    for loss, _ in got:
        assert abs(loss - want) <= 1e-5 * abs(want), f"ep2: {loss} vs one process {want}"
    # the dense weights are replicated, the routed experts (~70% here) split: well under a full read
    assert all(n < 0.75 * full for _, n in got), ([n for _, n in got], full)
