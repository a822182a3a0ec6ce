"""diffusers' `DiTTransformer2DModel` <-> meshspeed's `dit` family: configs and state dicts.

Pure tensor renaming (no diffusers import here: the caller brings the model or its state dict and
config), so `meshspeed.models.dit` run on the converted weights equals diffusers' forward within
1e-5 in float32 (tests/interop/test_diffusers_dit.py):

    pos_embed.proj (Conv2d [dim, C, p, p])           x_embedder.proj (Linear [dim, C·p·p])
    transformer_blocks.0.norm1.emb.timestep_embedder t_embedder            (linear_1, linear_2)
    transformer_blocks.0.norm1.emb.class_embedder    y_embedder            (embedding_table)
    transformer_blocks.i.norm1.linear                blocks.i.modulation
    transformer_blocks.i.attn1.to_q/to_k/to_v/to_out.0   blocks.i.attention.wq/wk/wv/wo
    transformer_blocks.i.ff.net.0.proj / ff.net.2    blocks.i.mlp.fc1 / fc2
    proj_out_1 / proj_out_2                          final_layer.modulation / final_layer.linear

diffusers gives every block its own timestep/class embedder; DiT (and the official checkpoints,
whose conversion copies one embedder into every block) shares one. Importing a model whose
blocks' embedders differ is refused (one forward could not match); export copies ours into each.

Timesteps: diffusers' DiT takes DDPM timesteps in [0, 1000); `dit` takes t in [0, 1] and embeds
1000·t, so diffusers(x, timestep=1000·t, class_labels=y) == dit(x, t, y) (models/dit.py).
"""

from __future__ import annotations

import torch

from meshspeed.models.config import ModelConfig

_EMB = "transformer_blocks.{i}.norm1.emb."
_SHARED = {
    "timestep_embedder.linear_1": "t_embedder.linear_1",
    "timestep_embedder.linear_2": "t_embedder.linear_2",
    "class_embedder.embedding_table": "y_embedder.embedding_table",
}
_BLOCK = {
    "norm1.linear": "modulation",
    "attn1.to_q": "attention.wq",
    "attn1.to_k": "attention.wk",
    "attn1.to_v": "attention.wv",
    "attn1.to_out.0": "attention.wo",
    "ff.net.0.proj": "mlp.fc1",
    "ff.net.2": "mlp.fc2",
}
_TOP = {"proj_out_1": "final_layer.modulation", "proj_out_2": "final_layer.linear"}


def config_from_diffusers(dcfg: dict) -> ModelConfig:
    """The dit ModelConfig of a diffusers DiTTransformer2DModel config (its `model.config`)."""
    for key, want in (
        ("norm_type", "ada_norm_zero"),
        ("activation_fn", "gelu-approximate"),
        ("attention_bias", True),
        ("norm_elementwise_affine", False),
        ("dropout", 0.0),  # dit has no dropout: training from it would not be diffusers' training
    ):
        if dcfg.get(key, want) != want:
            raise ValueError(
                f"diffusers DiT config {key}={dcfg[key]!r}: the dit family implements {want!r} only"
            )
    c_in = dcfg.get("in_channels", 4)
    c_out = dcfg.get("out_channels") or c_in
    if c_out not in (c_in, 2 * c_in):
        raise ValueError(
            f"diffusers DiT config out_channels={c_out} with in_channels={c_in}: dit predicts "
            f"{c_in} (learn_sigma false) or {2 * c_in} (learn_sigma true) channels"
        )
    heads, head_dim = dcfg.get("num_attention_heads", 16), dcfg.get("attention_head_dim", 72)
    return ModelConfig(
        family="dit",
        dim=heads * head_dim,
        n_heads=heads,
        n_layers=dcfg.get("num_layers", 28),
        image_size=dcfg.get("sample_size", 32),
        patch_size=dcfg.get("patch_size", 2),
        in_channels=c_in,
        learn_sigma=c_out == 2 * c_in,
        n_classes=dcfg.get("num_embeds_ada_norm", 1000),
        norm_eps=dcfg.get("norm_eps", 1e-5),
    )


def config_to_diffusers(config: ModelConfig) -> dict:
    """Keyword arguments of `DiTTransformer2DModel(**kwargs)` for a dit config."""
    if config.family != "dit" or config.text_dim or not config.n_classes:
        raise ValueError(
            "export to diffusers' DiTTransformer2DModel needs a class-conditional dit without text "
            f"(family={config.family!r}, n_classes={config.n_classes}, text_dim={config.text_dim})"
        )
    if config.ffn_hidden not in (None, 4 * config.dim):
        raise ValueError(f"ModelConfig.ffn_hidden={config.ffn_hidden}: diffusers' DiT MLP is 4 * dim wide")
    return dict(
        num_attention_heads=config.n_heads,
        attention_head_dim=config.head_dim,
        in_channels=config.in_channels,
        out_channels=config.in_channels * (2 if config.learn_sigma else 1),
        num_layers=config.n_layers,
        sample_size=config.image_size,
        patch_size=config.patch_size,
        num_embeds_ada_norm=config.n_classes,
        norm_eps=config.norm_eps,
    )


def from_diffusers(sd: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """dit state dict from a diffusers DiT state dict (tensors shared, conv weight reshaped)."""
    out: dict[str, torch.Tensor] = {}
    for suffix in ("weight", "bias"):
        w = sd[f"pos_embed.proj.{suffix}"]
        out[f"x_embedder.proj.{suffix}"] = w.reshape(config.dim, -1) if suffix == "weight" else w
        for d, m in _TOP.items():
            out[f"{m}.{suffix}"] = sd[f"{d}.{suffix}"]
        for i in range(config.n_layers):
            for d, m in _BLOCK.items():
                out[f"blocks.{i}.{m}.{suffix}"] = sd[f"transformer_blocks.{i}.{d}.{suffix}"]
    for d, m in _SHARED.items():
        for suffix in ("weight", "bias") if "linear" in d else ("weight",):
            first = sd[_EMB.format(i=0) + f"{d}.{suffix}"]
            for i in range(1, config.n_layers):
                if not torch.equal(sd[_EMB.format(i=i) + f"{d}.{suffix}"], first):
                    raise ValueError(
                        f"diffusers DiT block {i}'s norm1.emb.{d}.{suffix} differs from block 0's: dit "
                        "shares one conditioning embedder (as DiT's checkpoints do); copy block 0's "
                        "embedder into every block first"
                    )
            out[f"{m}.{suffix}"] = first
    unused = set(sd) - _used_keys(config)
    if unused:
        raise ValueError(
            f"diffusers DiT state dict has {len(unused)} keys dit does not use, e.g. {sorted(unused)[0]}"
        )
    return out


def to_diffusers(sd: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """diffusers DiT state dict from a dit state dict (the shared embedder copied into each block)."""
    config_to_diffusers(config)  # refuses what diffusers' DiT cannot hold
    c, p = config.in_channels, config.patch_size
    out: dict[str, torch.Tensor] = {}
    for suffix in ("weight", "bias"):
        w = sd[f"x_embedder.proj.{suffix}"]
        out[f"pos_embed.proj.{suffix}"] = w.reshape(config.dim, c, p, p) if suffix == "weight" else w
        for d, m in _TOP.items():
            out[f"{d}.{suffix}"] = sd[f"{m}.{suffix}"]
        for i in range(config.n_layers):
            for d, m in _BLOCK.items():
                out[f"transformer_blocks.{i}.{d}.{suffix}"] = sd[f"blocks.{i}.{m}.{suffix}"]
    for d, m in _SHARED.items():
        for suffix in ("weight", "bias") if "linear" in d else ("weight",):
            for i in range(config.n_layers):
                out[_EMB.format(i=i) + f"{d}.{suffix}"] = sd[f"{m}.{suffix}"].clone()
    return out


def diffusers_sources(config: ModelConfig) -> dict[str, tuple[str, ...]]:
    """dit parameter -> the diffusers tensors holding it: one, or (the shared conditioning
    embedder) every block's copy, which must be equal. x_embedder.proj.weight is the Conv2d's
    [dim, C, p, p] weight flattened to [dim, C·p·p] (row-major, so rows stay rows)."""
    out = {}
    for suffix in ("weight", "bias"):
        out[f"x_embedder.proj.{suffix}"] = (f"pos_embed.proj.{suffix}",)
        out.update({f"{m}.{suffix}": (f"{d}.{suffix}",) for d, m in _TOP.items()})
        for i in range(config.n_layers):
            for d, m in _BLOCK.items():
                out[f"blocks.{i}.{m}.{suffix}"] = (f"transformer_blocks.{i}.{d}.{suffix}",)
    for d, m in _SHARED.items():
        for suffix in ("weight", "bias") if "linear" in d else ("weight",):
            out[f"{m}.{suffix}"] = tuple(_EMB.format(i=i) + f"{d}.{suffix}" for i in range(config.n_layers))
    return out


def _used_keys(config: ModelConfig) -> set[str]:
    keys = {f"pos_embed.proj.{s}" for s in ("weight", "bias")} | {
        f"{d}.{s}" for d in _TOP for s in ("weight", "bias")
    }
    for i in range(config.n_layers):
        keys |= {f"transformer_blocks.{i}.{d}.{s}" for d in _BLOCK for s in ("weight", "bias")}
        keys |= {
            _EMB.format(i=i) + f"{d}.{s}"
            for d in _SHARED
            for s in ("weight", "bias")
            if "linear" in d or s == "weight"
        }
    return keys


def load_diffusers_dit(model) -> torch.nn.Module:
    """A meshspeed dit holding a diffusers DiTTransformer2DModel's weights (float32, CPU)."""
    from meshspeed.models import build_model

    config = config_from_diffusers(dict(model.config))
    dit = build_model(config)
    dit.load_state_dict(from_diffusers({k: v.float() for k, v in model.state_dict().items()}, config))
    return dit
