"""Born-sharded loading through `meshspeed.parallelize(model, dims, load_from=DIR)`: a model built
under `torch.device("meta")` at tp 2 ends with exactly the parameters, and trains with exactly
the losses, of the same model loaded whole by `from_pretrained` and parallelized; each rank
reads from the files only its own pieces (bytes counted at safetensors' `safe_open`, about half
the model), never a whole split tensor. An untied Llama and a tied Qwen2 (its `lm_head.weight`
absent from the files: the embedding's tensor) run in one worker call, and the Llama at dp 2
(tp 1: each rank reads it whole). A meta model without load_from, files lacking a tensor or
holding another shape, and a real model with load_from are refused in one line, the model left
as it was. A custom module split by the user's own plan loads born sharded the same way."""

from __future__ import annotations

import contextlib

import torch

from meshspeed import comm
from tests import harness
from tests.interop.test_parallelize import LR, VOCAB, batches, needs_hf, tiny_llama

KINDS = ("llama", "qwen2")  # untied; tied with q/k/v biases
STEPS = 3


@contextlib.contextmanager
def counting_reads():
    """Every tensor this process reads through safetensors' safe_open, as (name, bytes)."""
    import safetensors

    reads, real = [], safetensors.safe_open

    class Slice:
        def __init__(self, name, s):
            self.name, self.s = name, s

        def get_shape(self):
            return self.s.get_shape()

        def __getitem__(self, index):
            t = self.s[index]
            reads.append((self.name, t.numel() * t.element_size()))
            return t

    class Handle:
        def __init__(self, *a, **kw):
            self.f = real(*a, **kw)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_slice(self, name):
            return Slice(name, self.f.get_slice(name))

        def get_tensor(self, name):
            t = self.f.get_tensor(name)
            reads.append((name, t.numel() * t.element_size()))
            return t

    safetensors.safe_open = Handle
    try:
        yield reads
    finally:
        safetensors.safe_open = real


def job_born_sharded(ctx, dirs: dict):
    import transformers

    import meshspeed

    mesh = comm.ParallelDims(tp=2).build(ctx)
    out = {}
    for kind, path in dirs.items():
        whole = transformers.AutoModelForCausalLM.from_pretrained(path).float()
        config = whole.config
        with torch.device("meta"):
            born = type(whole)(config)
        with counting_reads() as reads:
            born, born_opt = meshspeed.parallelize(born, mesh, lr=LR, load_from=path)
        whole, whole_opt = meshspeed.parallelize(whole, mesh, lr=LR)
        same = {
            n: torch.equal(p, q) and p.device == q.device
            for (n, p), (_, q) in zip(born.named_parameters(), whole.named_parameters(), strict=True)
        }
        pairs = zip(born.named_buffers(), whole.named_buffers(), strict=True)
        buffers = {n: torch.equal(b, c) for (n, b), (_, c) in pairs}
        losses = []
        for model, opt in ((born, born_opt), (whole, whole_opt)):
            run = []
            for x in batches(VOCAB, STEPS):
                loss = model(input_ids=x, labels=x).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                run.append(loss.item())
            losses.append(run)
        local = {n: p.numel() * p.element_size() for n, p in born.named_parameters()}
        out[kind] = dict(same=same, buffers=buffers, losses=losses, reads=reads, local=local)
    # tp 1 (dp 2): no split, so each rank reads the whole model and holds the saved values
    path = dirs["llama"]
    whole = transformers.AutoModelForCausalLM.from_pretrained(path).float()
    with torch.device("meta"):
        born = type(whole)(whole.config)
    with counting_reads() as reads:
        meshspeed.parallelize(born, comm.ParallelDims(dp=2).build(ctx), lr=LR, load_from=path)
    out["dp2"] = dict(
        same=all(torch.equal(p, q) for p, q in zip(born.parameters(), whole.parameters(), strict=True)),
        read=sum(b for _, b in reads),
    )
    return out


@needs_hf
def test_born_sharded_load_equals_whole_load_and_reads_half(tmp_path):
    dirs, whole_bytes = {}, {}
    for kind in KINDS:
        model = tiny_llama(kind)
        model.save_pretrained(str(tmp_path / kind))
        dirs[kind] = str(tmp_path / kind)
        whole_bytes[kind] = sum(p.numel() * p.element_size() for p in model.parameters())
    results = harness.run(2, job_born_sharded, dirs, timeout=180)
    for kind in KINDS:
        for rank, res in enumerate(r[kind] for r in results):
            assert all(res["same"].values()), (kind, rank, res["same"])
            assert all(res["buffers"].values()), (kind, rank, res["buffers"])
            born, whole = res["losses"]
            assert born == whole, (kind, born, whole)
            read = sum(b for _, b in res["reads"])
            # what was read is what the rank holds, and that is about half the model: every
            # weight matrix is split, only norms stay whole
            assert read == sum(res["local"].values()), (kind, read, res["local"])
            assert 0.45 * whole_bytes[kind] < read < 0.55 * whole_bytes[kind], (kind, read, whole_bytes)
            # no read is a whole split tensor: the largest one is a rank's piece of the largest
            assert max(b for _, b in res["reads"]) == max(res["local"].values()), res["reads"]
    for res in results:
        assert res["dp2"] == dict(same=True, read=whole_bytes["llama"]), res["dp2"]
    tied = {name for name, _ in results[0]["qwen2"]["reads"]}
    assert "lm_head.weight" not in tied and "model.embed_tokens.weight" in tied


def job_refused(ctx, llama_dir: str, tied_qwen2_dir: str):
    import transformers

    import meshspeed

    mesh = comm.ParallelDims(tp=2).build(ctx)
    config = transformers.AutoConfig.from_pretrained(llama_dir)
    wider = transformers.AutoConfig.from_pretrained(llama_dir, vocab_size=2 * config.vocab_size)
    cases = [  # (config, on meta, load_from)
        (config, True, None),  # no weights at all
        (config, True, tied_qwen2_dir),  # files lacking lm_head.weight
        (wider, True, llama_dir),  # files with another vocabulary
        (config, False, llama_dir),  # a model that holds its weights already
    ]
    out = []
    for cfg, meta, load_from in cases:
        with torch.device("meta" if meta else "cpu"):
            model = transformers.AutoModelForCausalLM.from_config(cfg)
        before = {n: (p.device, p.shape) for n, p in model.named_parameters()}
        try:
            meshspeed.parallelize(model, mesh, load_from=load_from)
            out.append(None)
        except comm.ConfigError as e:  # and the refused model is left as it was
            after = {n: (p.device, p.shape) for n, p in model.named_parameters()}
            out.append((str(e), after == before, hasattr(model, "meshspeed")))
    return out


@needs_hf
def test_meta_model_without_load_from_or_a_tensor_is_one_line(tmp_path):
    for kind in KINDS:
        tiny_llama(kind).save_pretrained(str(tmp_path / kind))
    results = harness.run(2, job_refused, str(tmp_path / "llama"), str(tmp_path / "qwen2"))[0]
    for res in results:
        assert res is not None, results
        msg, unchanged, parallelized = res
        assert "\n" not in msg and unchanged and not parallelized, res
    no_dir, missing, wider, real = (r[0] for r in results)
    assert "meta device" in no_dir and "load_from=" in no_dir, no_dir
    assert "no tensor 'lm_head.weight'" in missing, missing
    assert "model.embed_tokens.weight has shape [256, 64]" in wider and "[512, 64]" in wider, wider
    assert "torch.device('meta')" in real and "already holds values" in real, real


def job_plan_born_sharded(ctx, path: str):
    """A custom module split by a plan of the user's, born on meta and loaded from `path`: each
    parameter equals the whole-loaded model's piece, and each rank reads only what it holds."""
    import meshspeed
    from tests.interop.test_parallelize import TINYNET_PLAN, tiny_net

    mesh = comm.ParallelDims(tp=2).build(ctx)
    with torch.device("meta"):
        born = tiny_net()
    with counting_reads() as reads:
        born, _ = meshspeed.parallelize(born, mesh, plan=TINYNET_PLAN, load_from=path)
    whole, _ = meshspeed.parallelize(tiny_net(), mesh, plan=TINYNET_PLAN)
    pairs = zip(born.named_parameters(), whole.named_parameters(), strict=True)
    same = {n: torch.equal(p, q) for (n, p), (_, q) in pairs}
    split = {n for n, p in whole.named_parameters() if p.shape != tiny_net().get_parameter(n).shape}
    held = sum(p.numel() * p.element_size() for p in born.parameters())
    return same, split, sum(b for _, b in reads), held


def test_a_plan_of_your_own_is_born_sharded_too(tmp_path):
    from safetensors.torch import save_file

    from tests.interop.test_parallelize import tiny_net

    save_file(tiny_net().state_dict(), str(tmp_path / "model.safetensors"))
    for same, split, read, held in harness.run(2, job_plan_born_sharded, str(tmp_path), timeout=120):
        assert same and all(same.values()), same
        assert {"blocks.0.fc1.weight", "blocks.1.fc2.weight", "head.weight"} <= split, split
        assert read == held, (read, held)  # the plan's pieces only, never a whole split tensor
