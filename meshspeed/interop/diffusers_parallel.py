"""Context parallelism over a diffusers DiTTransformer2DModel's image tokens (`parallelize` with
cp > 1): the same pieces meshspeed's own dit uses (parallel/context.py), put on diffusers' modules.

    pos_embed     its output [B, N, dim] (patches + fixed positions) cut to this rank's N/cp tokens
    attn1         a processor running q/k/v/out as diffusers' AttnProcessor2_0 does, with the
                  attention itself meshspeed's cp core (ring, Ulysses or hybrid; full attention)
    proj_out_2    its output [B, N/cp, p·p·C] gathered whole for the model's own unpatchify

The conditioning (timestep and class embeddings, adaLN modulations) is per sample and whole on
every rank. Every cp rank then computes the whole output and the same loss; the gather's
backward keeps this rank's rows times cp and data parallelism averages over dp × cp, so the
gradients are the whole model's (context_comm._GatherTokens).
"""

from __future__ import annotations

from torch import nn

from meshspeed.comm.errors import ConfigError
from meshspeed.parallel.context import context_parallel, split_tokens

CLASS = "DiTTransformer2DModel"


class ContextAttnProcessor:
    """diffusers' self-attention (AttnProcessor2_0 without the options DiT does not use) over
    this rank's tokens, the attention itself through the cp core."""

    def __init__(self, core):
        self.core = core

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, **kw):
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ConfigError(
                "parallelize: cp over a diffusers DiT's image tokens runs self-attention without a "
                "mask; this call passed encoder_hidden_states or attention_mask"
            )
        b = hidden_states.shape[0]
        q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        hd = k.shape[-1] // attn.heads
        q, k, v = (t.view(b, -1, attn.heads, hd) for t in (q, k, v))  # [B, N/cp, heads, hd]
        out = self.core(q, k, v).reshape(b, -1, attn.heads * hd).to(q.dtype)
        return attn.to_out[1](attn.to_out[0](out))  # the output Linear, then its (no-op) dropout


def _check(model: nn.Module) -> list[nn.Module]:
    """The attn1 modules, after one-line refusals of what the processor does not reproduce."""
    if type(model).__name__ != CLASS:
        raise ConfigError(
            f"parallelize: cp > 1 on {type(model).__name__}: context parallelism through parallelize "
            f"takes a diffusers {CLASS} (its image tokens); use cp=1, or meshspeed train for its families"
        )
    attns = [m for n, m in model.named_modules() if n.endswith(".attn1")]
    for a in attns:
        odd = [
            name
            for name, bad in (
                ("spatial_norm", a.spatial_norm is not None),
                ("group_norm", a.group_norm is not None),
                ("norm_q/norm_k", a.norm_q is not None or a.norm_k is not None),
                ("residual_connection", a.residual_connection),
                ("rescale_output_factor", a.rescale_output_factor != 1.0),
                ("scale", abs(a.scale - (a.inner_dim // a.heads) ** -0.5) > 1e-12),
            )
            if bad
        ]
        if odd:
            raise ConfigError(
                f"parallelize: cp over this {CLASS}: its attention uses {odd[0]}, which the cp "
                "processor does not reproduce; use cp=1"
            )
    return attns


def check_context(model: nn.Module, mesh) -> None:
    """Refuse (before anything changes) what cp over a diffusers DiT cannot run."""
    _check(model)
    if mesh["tp"].size > 1:
        raise ConfigError("parallelize: cp with tp > 1 on a diffusers DiT is not built; use tp=1")


def apply_context(model: nn.Module, mesh, impl: str = "ring", ulysses: int = 1) -> None:
    """Cut the tokens after pos_embed, run attn1 through the cp core, gather after proj_out_2."""
    core = context_parallel(mesh, impl, ulysses, None, causal=False)  # DiT: full attention
    attns = _check(model)
    split_tokens(model, core, "pos_embed", "proj_out_2")
    for a in attns:
        a.set_processor(ContextAttnProcessor(core))
