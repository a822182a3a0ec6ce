"""A vision-language model's training step under per-module layouts, driven through the seam:
the encoder (ViT + projector) on its own ModuleMesh, the decoder on another, the image features
re-sliced between them (meshspeed/parallel/seam.py). Model-level, not the trainer: the parity
tests (tests/parallel/test_seam.py) and the benchmark (benchmarks/vlm.py) share it, so the
benchmark times exactly what the tests prove equal to one device.

A layout is data: `Layout(enc_ranks, enc_dp, enc_tp, dec_ranks, dec_dp, dec_tp)`; the encoder and
decoder ranks are the same (colocated, per-module degrees) or disjoint (disaggregated).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from meshspeed import comm
from meshspeed.comm.module_mesh import ModuleMesh
from meshspeed.comm.placement import chunk_bounds
from meshspeed.models import ModelConfig, build_model, recipe_for
from meshspeed.models.vlm import mrope_positions, mrope_tables, scatter_image_features
from meshspeed.models.vlm_config import image_tokens
from meshspeed.parallel import seam as S
from meshspeed.parallel.tensor import loss_fn, parallelize

ENCODER = ("embed.vision", "embed.projector")  # the encoder's FQN prefixes inside the vlm family


@dataclass(frozen=True)
class Layout:
    enc_ranks: tuple[int, ...]
    enc_dp: int
    enc_tp: int
    dec_ranks: tuple[int, ...]
    dec_dp: int
    dec_tp: int

    @property
    def disaggregated(self) -> bool:
        return not set(self.enc_ranks) & set(self.dec_ranks)

    def __str__(self) -> str:
        mode = "disaggregated" if self.disaggregated else "colocated"
        r = lambda t: f"{t[0]}-{t[-1]}" if len(t) > 1 else str(t[0])  # noqa: E731
        return (
            f"{mode}: encoder ranks {r(self.enc_ranks)} dp{self.enc_dp} tp{self.enc_tp}, "
            f"decoder ranks {r(self.dec_ranks)} dp{self.dec_dp} tp{self.dec_tp}"
        )


def is_encoder(name: str) -> bool:
    return name.startswith(ENCODER)


def batch(cfg: ModelConfig, n: int, text: int, seed: int = 7):
    """n samples of one image each: tokens [n, img + text] (the image's placeholders first),
    targets (-100 on the placeholders: the loss is on the text), images [n, 3, H, W]."""
    gen = torch.Generator().manual_seed(seed)
    k = image_tokens(cfg)
    words = torch.randint(0, cfg.image_token_id, (n, text), generator=gen)
    tokens = torch.cat([torch.full((n, k), cfg.image_token_id), words], 1)
    answer = torch.randint(0, cfg.image_token_id, (n, text), generator=gen)
    targets = torch.cat([torch.full((n, k), -100), answer], 1)
    images = torch.randn(n, 3, cfg.image_size, cfg.image_size, generator=gen)
    return tokens, targets, images


def decode(model, tokens: torch.Tensor, feats) -> torch.Tensor:
    """The vlm decoder on image features [n, img_tok, dim] from the seam: the model's own forward
    with `embed.image_features` replaced by `feats()`, called once the text embedding and the
    rotary tables are done, so they run while the features are in flight."""
    cfg = model.config
    h = model.embed.tok_embeddings(tokens)
    cos, sin = mrope_tables(model, mrope_positions(tokens, cfg))
    h = scatter_image_features(h, tokens == cfg.image_token_id, feats())
    for layer in model.layers.values():
        h = layer(h, cos, sin)
    return model.output(model.norm(h))


def reference(cfg: ModelConfig, data, seed: int = 3):
    """The one-device model (every weight random, so every gradient path carries signal), its
    loss and gradients on the whole batch."""
    ref = build_model(cfg, seed=seed)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    tokens, targets, images = data
    loss = loss_fn(ref)(ref(tokens, images), targets)
    loss.backward()
    return ref, loss.detach(), {n: p.grad for n, p in ref.named_parameters()}


class Modules:
    """This rank's parts of a layout: the encoder and decoder copies (None off their ranks),
    their meshes and the seam."""

    def __init__(self, ctx, ref, layout: Layout):
        cfg, recipe = ref.config, recipe_for(ref.config)
        L = layout
        self.layout = L
        self.enc_mesh = ModuleMesh("encoder", comm.ParallelDims(dp=L.enc_dp, tp=L.enc_tp), L.enc_ranks, ctx)
        self.dec_mesh = ModuleMesh("decoder", comm.ParallelDims(dp=L.dec_dp, tp=L.dec_tp), L.dec_ranks, ctx)
        self.seam = S.Seam(self.enc_mesh, self.dec_mesh)
        plan = recipe.tp_plan
        self.enc = self.dec = None
        if self.enc_mesh.member:  # the whole model copied, only its encoder used (tiny here)
            enc_plan = [(p, s) for p, s in plan if is_encoder(p)]
            self.enc = parallelize(copy.deepcopy(ref), self.enc_mesh, recipe, plan=enc_plan)
        if self.dec_mesh.member:
            dec_plan = [(p, s) for p, s in plan if not is_encoder(p)]
            self.dec = parallelize(copy.deepcopy(ref), self.dec_mesh, recipe, plan=dec_plan)
        self.zero_grad()  # the copies carry the reference's gradients
        self.row_shape = (image_tokens(cfg), cfg.dim)

    def enc_params(self):
        return [p for n, p in self.enc.named_parameters() if is_encoder(n)] if self.enc else []

    def dec_params(self):
        return [p for n, p in self.dec.named_parameters() if not is_encoder(n)] if self.dec else []

    def step(self, data) -> torch.Tensor | None:
        """Forward and backward of one global batch; gradients reduced over each module's own
        dp group. Returns the decoder's loss (dp-averaged) on decoder ranks, else None."""
        tokens, targets, images = data
        n = images.shape[0]
        x = S.placeholder(self.row_shape)  # no images here (not an encoder rank, or an empty chunk:
        # the ViT cannot take an empty batch)
        if self.enc is not None:
            offs = chunk_bounds(n, self.enc_mesh.dims.dp)
            j = self.enc_mesh.coords["dp"]
            if offs[j + 1] > offs[j]:
                x = self.enc.embed.image_features(images[offs[j] : offs[j + 1]])  # [my images, tok, dim]
        pending = S.start(self.seam, x, n)  # the decoder's own work below overlaps the transfers
        loss = None
        if self.dec is not None:
            offs = chunk_bounds(n, self.dec_mesh.dims.dp)
            i = self.dec_mesh.coords["dp"]
            tok, tgt = tokens[offs[i] : offs[i + 1]], targets[offs[i] : offs[i + 1]]
            loss = loss_fn(self.dec)(decode(self.dec, tok, lambda: S.wait(pending)), tgt)
            loss.backward()
        else:
            S.drive(S.wait(pending))
        self.seam.flush()
        S.reduce_producer_grads(self.enc_params(), self.seam)
        dp = self.dec_mesh["dp"] if self.dec is not None else None
        if dp is not None and dp.size > 1:  # the decoder's own dp: mean loss per rank, averaged
            grads = [p.grad for p in self.dec_params() if p.grad is not None]
            flat = comm.all_reduce(torch.cat([g.reshape(-1) for g in grads]), dp)  # one call, not one each
            for g, piece in zip(grads, flat.div_(dp.size).split([g.numel() for g in grads])):
                g.copy_(piece.view_as(g))
            loss = comm.all_reduce(loss.detach().clone(), dp) / dp.size
        return None if loss is None else loss.detach()

    def zero_grad(self) -> None:
        for m in (self.enc, self.dec):
            if m is not None:
                m.zero_grad(set_to_none=True)
