"""`meshspeed.parallelize` on a `transformers` MixtralForCausalLM with its experts split over ep
(interop/hf_experts.py): the plain loop of test_parallelize.py gives the first ten losses and gradient
norms of the same loop on one process without meshspeed within 1e-5, and `save_pretrained` of
`gather_for_save` (Hugging Face's per-expert files) loads with `from_pretrained` and gives the
one-process model's logits. Layouts this path does not build are one line, before any change."""

from __future__ import annotations

import pytest
import torch

from meshspeed import comm
from tests import harness
from tests.interop.test_parallelize import EPS, TOL, job_loop, logits_of, needs_hf, one_process, tiny_llama

STEPS = 10  # the first ten losses, as for the Llama of test_parallelize.py


def job_experts(ctx, dims: dict, kw: dict, out: str):
    """The loop through parallelize at `dims`: (global losses, gradient norms) per step."""
    losses, norms, _ = job_loop(ctx, "mixtral", dims, kw, out, STEPS)
    return losses, norms


@needs_hf
@pytest.mark.parametrize(
    "ws, dims, kw",
    [
        pytest.param(2, dict(dp=2, ep=2), dict(zero=1), id="ep2"),
        pytest.param(4, dict(dp=4, ep=2), dict(zero=2), id="dp4-ep2-zero2"),
        # and the memory options with experts: each block rerun, the loss without logits
        pytest.param(
            3, dict(dp=3, ep=3), dict(zero=3, recompute="full", chunked_loss=True), id="ep3-zero3-mem"
        ),
    ],
)
def test_mixtral_expert_parallel_loop_equals_one_process(tmp_path, ws, dims, kw):
    import transformers

    results = harness.run(ws, job_experts, dims, {**kw, "eps": EPS}, str(tmp_path / "out"), timeout=180)
    want_losses, want_norms, want_logits, _ = one_process("mixtral", STEPS, EPS)
    for losses, norms in results:
        assert max(abs(a - b) for a, b in zip(losses, want_losses)) < TOL, (losses, want_losses)
        assert max(abs(a - b) for a, b in zip(norms, want_norms)) < TOL, (norms, want_norms)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).float()
    assert type(loaded).__name__ == "MixtralForCausalLM"
    torch.testing.assert_close(logits_of(loaded, True), want_logits, atol=TOL, rtol=0)


def job_split(ctx):
    """What ep 2 leaves on each member: its experts' rows, and, for the grouped matmul and the
    loop over experts, the largest difference from the whole module's output on this member's
    tokens (routed to every expert)."""
    from meshspeed.interop import hf_experts

    group = comm.ParallelDims(dp=2, ep=2).build(ctx)["ep"]
    torch.manual_seed(1 + ctx.rank)  # each member its own tokens, as dp ranks have
    x = torch.randn(8, 64)
    idx = torch.stack([torch.arange(8) % 6, (torch.arange(8) + 1 + ctx.rank) % 6], 1)
    w = torch.rand(8, 2)
    shape, err = None, {}
    for impl in ("auto", "loop"):
        model = tiny_llama("mixtral")
        whole = model.model.layers[0].mlp.experts
        ref = type(whole).__new__(type(whole))
        ref.__dict__.update(whole.__dict__)  # the unsplit module, sharing its weights
        assert hf_experts.split_experts(model, group, impl) == 2  # one per layer
        split = model.model.layers[0].mlp.experts
        shape = tuple(split.gate_up_proj.shape)
        err[impl] = float((split(x, idx, w) - ref(x, idx, w)).abs().max())
    return shape, err


@needs_hf
def test_each_member_holds_its_block_and_computes_the_whole_modules_output():
    for shape, err in harness.run(2, job_split, timeout=120):
        assert shape == (3, 96, 64), shape  # 6 experts over ep 2, gate and up stacked
        assert err["auto"] < 1e-6 and err["loop"] < 1e-6, err  # auto: torch._grouped_mm on the CPU


REFUSED = [  # (model, dims, parallelize keywords, words the one line must hold)
    ("llama", dict(dp=2, ep=2), {}, ("ep=2", "LlamaForCausalLM", "no experts", "ep=1")),
    ("mixtral", dict(tp=2), {}, ("tp=2", "MixtralForCausalLM", "ep=E", "tp=1")),
    ("mixtral", dict(dp=2, ep=2), {"load_from": "ckpt"}, ("load_from", "'ckpt'", "from_pretrained")),
]


def job_refused(ctx):
    """Each refused layout through the real parallelize: (message, model left as it was)."""
    import meshspeed
    from meshspeed.comm.errors import ConfigError

    out = []
    for kind, dims, kw, _ in REFUSED:
        model = tiny_llama(kind)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        try:
            meshspeed.parallelize(model, comm.ParallelDims(**dims).build(ctx), **kw)
            out.append((None, False))
        except ConfigError as e:
            same = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
            out.append((str(e), same and not hasattr(model, "meshspeed")))
    return out


@needs_hf
def test_layouts_the_expert_path_does_not_build_are_one_line_before_any_change():
    for rank_result in harness.run(2, job_refused, timeout=120):
        for (msg, untouched), (kind, dims, _, words) in zip(rank_result, REFUSED):
            assert msg is not None and "\n" not in msg and all(w in msg for w in words), (kind, dims, msg)
            assert untouched, (kind, dims)
