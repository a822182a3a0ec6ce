"""What the run plan checks of a diffusion run (family 'dit', train.objective=flow), before any
worker starts: the pairing of family and objective, the layouts built for dit so far, the
[flow] settings and the image data. One line each, naming the setting, its value and what works.
"""

from __future__ import annotations

import os

from meshspeed.comm import ConfigError
from meshspeed.models.dit_config import n_tokens
from meshspeed.parallel.context import check_cp

T_KINDS = ("uniform", "logit_normal")


def check_flow(cfg, config) -> None:
    """Refuse what a dit / flow run cannot do (config: the resolved ModelConfig)."""
    t, p, m, f = cfg.train, cfg.parallel, cfg.memory, cfg.flow
    dit = config.family == "dit"
    if dit and t.objective != "flow":
        raise ConfigError(
            f"train.objective={t.objective} with a 'dit' model ({cfg.model.preset or cfg.model.init_from}): "
            "diffusion transformers train with train.objective=flow"
        )
    if not dit and t.objective == "flow":
        raise ConfigError(
            f"train.objective=flow needs a 'dit' model (e.g. model.preset=dit-tiny); this one is "
            f"family {config.family!r}: use lm, sft or dpo"
        )
    if not dit:
        return
    if p.pp > 1 and config.text_dim:  # the conditioning c travels between stages; text does not yet
        raise ConfigError(
            f"parallel.pp={p.pp} with a text-conditioned dit (model.text_dim={config.text_dim}): the "
            "text tokens are not carried between pipeline stages yet; use pp=1"
        )
    if p.cp > 1:  # over the image tokens, full attention (the recipe's cp_tokens and causal=False)
        n = n_tokens(config)
        if n % p.cp:
            ok = [d for d in range(2, n + 1) if n % d == 0][:8]
            raise ConfigError(
                f"parallel.cp={p.cp} does not divide the {n} image tokens of model.image_size="
                f"{config.image_size} / patch_size={config.patch_size}; use cp among {ok}"
            )
        check_cp(p.cp_impl, p.cp, config.n_heads // p.tp, n, p.cp_ulysses, causal=False)
    for key, on in (
        ("memory.chunked_loss", m.chunked_loss),
        ("train.fused_kernels", t.fused_kernels),
        ("data.packing", cfg.data.packing),
    ):
        if on:  # the cross-entropy head, fused LM kernels, document packing: text-only features
            raise ConfigError(f"{key}=true applies to language models, not family dit; set it to false")
    if f.t_sampling not in T_KINDS:
        raise ConfigError(f"flow.t_sampling={f.t_sampling!r} is invalid; use one of {', '.join(T_KINDS)}")
    if not f.t_std > 0:
        raise ConfigError(f"flow.t_std={f.t_std} must be > 0 (SD3 uses 1.0)")
    if not 0.0 <= f.label_dropout <= 1.0:
        raise ConfigError(f"flow.label_dropout={f.label_dropout} must be a probability in [0, 1] (0.1)")
    if not 0.0 <= f.ema_decay < 1.0:
        raise ConfigError(f"flow.ema_decay={f.ema_decay} must be in [0, 1): 0 = off, e.g. 0.999")
    if f.sample_n < 0 or f.sample_steps < 1:
        raise ConfigError(
            f"flow.sample_n={f.sample_n} / flow.sample_steps={f.sample_steps}: use sample_n ≥ 0 "
            "(0 = no end-of-run samples) and sample_steps ≥ 1"
        )


def check_image_data(cfg, need: bool = True) -> str | None:
    """data.path of a flow run: empty or 'digits' (built in), a folder, an .npz or a prepared
    file. need=False (dry run, planner): a missing path is a note, not an error."""
    path = cfg.data.path
    if not path or path == "digits" or os.path.exists(path):
        return None
    if not need:
        return f"data.path={path!r} not found here; planned without it (training needs it)"
    raise ConfigError(
        f"data.path={path!r} does not exist; give 'digits' (or leave it empty), a folder of class "
        "folders, an .npz or a file from `meshspeed data prepare --images`"
    )
