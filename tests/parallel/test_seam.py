"""The seam between two module meshes (meshspeed/parallel/seam.py): a vision-language model
whose encoder and decoder run in different layouts equals the one-device model — loss, every
encoder gradient and every decoder gradient — colocated with per-module degrees (encoder dp 4
while the decoder runs tp 2 x dp 2) and disaggregated (the encoder on its own ranks, its
features sent point to point), at world sizes 2, 3 and 4.

The vlm family's own modules (models/vlm.py), shrunk: the step is benchmarks/vlm_layouts.py's,
the one the benchmark times. Batches divide unevenly where they can (6 images over 4 encoder
ranks: one encodes none) to catch off-by-one slices.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.vlm_layouts import Layout, Modules, batch, is_encoder, reference
from meshspeed.comm.placement import full_grad
from meshspeed.models import ModelConfig
from tests import harness

# 6 heads, text and vision (the recipe checks both for any tp), so tp 2 and 3 divide; 8 x 8
# images in 2 x 2 patches merged 2 x 2: 4 tokens each
CFG = dict(
    family="vlm", dim=48, n_layers=1, n_heads=6, n_kv_heads=6, vocab_size=66, ffn_hidden=96,
    max_seq_len=32, image_size=8, patch_size=2, vision_dim=24, vision_layers=1, vision_heads=6,
    merge_size=2, image_token_id=65,
)  # fmt: skip


def _close(got, want, what: str) -> list[str]:
    scale = max(1.0, want.abs().max().item())  # float32 sums reassociated over ranks
    if got is None or not torch.allclose(got, want, rtol=1e-4, atol=1e-6 * scale):
        err = None if got is None else (got - want).abs().max().item()
        return [f"{what}: max err {err}"]
    return []


def job_seam(ctx, layout: Layout, n: int) -> list[str]:
    cfg = ModelConfig(**CFG)
    data = batch(cfg, n, text=5)
    ref, ref_loss, want = reference(cfg, data)
    mods = Modules(ctx, ref, layout)
    bad = []
    for _ in range(2):  # twice: a send left pending by the first step must not corrupt the second
        mods.zero_grad()
        loss = mods.step(data)
    if loss is not None:
        bad += _close(loss, ref_loss, "loss")
    checked = 0
    for model, mesh, mine in ((mods.enc, mods.enc_mesh, True), (mods.dec, mods.dec_mesh, False)):
        if model is None:
            continue
        for name, p in model.named_parameters():
            if is_encoder(name) == mine:
                bad += _close(full_grad(p, mesh), want[name], f"{'encoder' if mine else 'decoder'} {name}")
                checked += 1
    if not checked:
        bad.append("this rank checked no gradient")
    return bad


# (world size, layout, images): every world size colocated and disaggregated. Images divide the
# decoder dp (its ranks average equal-sized means), not always the encoder dp.
CASES = [
    (2, Layout((0, 1), 2, 1, (0, 1), 1, 2), 3),  # encoder dp 2, decoder tp 2
    (2, Layout((0,), 1, 1, (1,), 1, 1), 2),  # disaggregated 1 + 1
    (3, Layout((0, 1, 2), 3, 1, (0, 1, 2), 1, 3), 4),  # encoder dp 3, decoder tp 3
    (3, Layout((0,), 1, 1, (1, 2), 2, 1), 4),  # encoder on 0, decoder dp 2 on 1-2
    (4, Layout((0, 1, 2, 3), 4, 1, (0, 1, 2, 3), 2, 2), 6),  # encoder dp 4, decoder tp 2 x dp 2
    (4, Layout((0, 1), 2, 1, (2, 3), 1, 2), 3),  # encoder dp 2 on 0-1, decoder tp 2 on 2-3
    (4, Layout((0, 1), 1, 2, (2, 3), 2, 1), 4),  # encoder tp 2 on 0-1, decoder dp 2 on 2-3
    (4, Layout((0,), 1, 1, (1, 2, 3), 3, 1), 3),  # encoder on 0, decoder dp 3 on 1-3
]


@pytest.mark.parametrize("ws,layout,n", CASES, ids=[f"ws{c[0]}-{c[1]}".replace(" ", "") for c in CASES])
def test_seam_layouts_equal_one_device(ws, layout, n):
    assert harness.run(ws, job_seam, layout, n) == [[]] * ws, str(layout)


# --- the routing table alone (no processes): every layout, every row ---------------------------


class _FakeMesh:
    """What Seam's routing reads of a ModuleMesh: dims, ranks, coords_of."""

    def __init__(self, dims, ranks):
        self.dims, self.ranks = dims, tuple(ranks)

    def coords_of(self, r):
        return self.dims.coords(self.ranks.index(r))


def _routes(enc: _FakeMesh, dec: _FakeMesh, world: int, n: int):
    from meshspeed.parallel.seam import Seam

    out = {}
    for me in range(world):
        s = Seam.__new__(Seam)  # the routing only: no groups
        s.producer, s.consumer, s.me, s._routes = enc, dec, me, {}
        out[me] = s.route(n)
    return out


ROUTE_CASES = [  # (world, encoder (ranks, dp, tp), decoder (ranks, dp, tp), rows)
    (4, ((0, 1, 2, 3), 4, 1), ((0, 1, 2, 3), 2, 2), 6),
    (4, ((0, 1, 2, 3), 2, 2), ((0, 1, 2, 3), 4, 1), 5),
    (4, ((0, 1), 1, 2), ((2, 3), 1, 2), 3),
    (5, ((0, 1), 2, 1), ((2, 3, 4), 3, 1), 7),
    (6, ((0, 1, 2, 3, 4, 5), 3, 2), ((0, 1, 2, 3, 4, 5), 2, 3), 5),
]


@pytest.mark.parametrize("world,enc,dec,n", ROUTE_CASES)
def test_every_row_goes_once_and_its_gradient_comes_back_once(world, enc, dec, n):
    """Forward: each consumer rank receives every row of its dp slice exactly once (fan-in), and
    every send has its receive. Backward: each row's gradient reaches each replica of its
    producer block exactly once per consumer dp slice holding it — one tp peer returns it, not
    all of them (tp peers hold the same gradient: returning it from each would count it tp times)."""
    from collections import Counter

    from meshspeed.comm import ParallelDims
    from meshspeed.comm.placement import chunk_bounds

    E = _FakeMesh(ParallelDims(dp=enc[1], tp=enc[2]), enc[0])
    D = _FakeMesh(ParallelDims(dp=dec[1], tp=dec[2]), dec[0])
    routes = _routes(E, D, world, n)
    sends = Counter((me, peer, lo, hi) for me, rt in routes.items() for peer, lo, hi in rt.fwd_send)
    recvs = Counter((peer, me, lo, hi) for me, rt in routes.items() for peer, lo, hi in rt.fwd_recv)
    assert sends == recvs
    offs = chunk_bounds(n, D.dims.dp)
    for r in D.ranks:
        got = sorted(row for _, lo, hi in routes[r].fwd_recv for row in range(lo, hi))
        i = D.coords_of(r)["dp"]
        assert got == list(range(offs[i], offs[i + 1])), r
    bsend = Counter((me, peer, lo, hi) for me, rt in routes.items() for peer, lo, hi in rt.bwd_send)
    brecv = Counter((peer, me, lo, hi) for me, rt in routes.items() for peer, lo, hi in rt.bwd_recv)
    assert bsend == brecv
    eoffs = chunk_bounds(n, E.dims.dp)
    for h in E.ranks:
        j = E.coords_of(h)["dp"]
        per_row = Counter(row for _, lo, hi in routes[h].bwd_recv for row in range(lo, hi))
        assert per_row == Counter(range(eoffs[j], eoffs[j + 1])), h  # once each: no tp double count


# --- disaggregated: neither side waits for the other's receive --------------------------------


def job_nonblocking(ctx) -> list[str]:
    """The encoder (rank 0) returns from the forward before the decoder (rank 1) has posted its
    receive, and the decoder returns from its backward before the encoder receives the gradient:
    each side announces its return in the store and the other waits for that before posting its
    receive, so a seam that blocked on its sends would hang (and time out) here. 4 MiB of rows:
    more than a socket buffers, so a blocking send could not complete early."""
    from datetime import timedelta

    from meshspeed.comm import ParallelDims
    from meshspeed.comm.module_mesh import ModuleMesh
    from meshspeed.parallel import seam as S

    enc = ModuleMesh("nb_enc", ParallelDims(), (0,), ctx)
    dec = ModuleMesh("nb_dec", ParallelDims(), (1,), ctx)
    seam, n, row = S.Seam(enc, dec), 4, (256, 1024)
    store, wait = ctx.store, lambda key: ctx.store.wait([key], timedelta(seconds=15))
    if ctx.rank == 0:
        x = torch.arange(n * 256 * 1024, dtype=torch.float32).view(n, *row).requires_grad_()
        y = S.reslice(seam, x * 1.0, n)
        store.set("seam_nb/fwd", "1")  # returned: the decoder has not received yet
        wait("seam_nb/bwd")  # the decoder's backward returned before this rank receives
        S.drive(y)
        seam.flush()
        return [] if torch.equal(x.grad, torch.full_like(x, 3.0)) else ["encoder gradient wrong"]
    wait("seam_nb/fwd")
    y = S.reslice(seam, S.placeholder(row), n)
    (3.0 * y).sum().backward()
    store.set("seam_nb/bwd", "1")
    seam.flush()  # done once rank 0 received: it has read both keys, so a rerun starts clean
    for key in ("seam_nb/fwd", "seam_nb/bwd"):
        store.delete_key(key)
    want = torch.arange(n * 256 * 1024, dtype=torch.float32).view(n, *row)
    return [] if torch.equal(y.detach(), want) else ["decoder rows wrong"]


def test_disaggregated_seam_never_waits_for_the_other_side():
    assert harness.run(2, job_nonblocking) == [[], []]
