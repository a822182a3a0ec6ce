"""Strict readers for the JSON files of a Hugging Face model directory: config.json and
model.safetensors.index.json (tokenizer_config.json is data/tokenizer.py's).

A value of the wrong JSON type is never taken at face value: `"tie_word_embeddings": "false"`
is a true string in Python and would silently tie the embeddings; `"num_attention_heads": 0`
would divide by zero deep inside the model. Each reader checks every key meshspeed reads for
its type and range, and sizes for plausibility, before anything is built or allocated (so a
`--dry-run` refuses an absurd model too), and says in one line the file, the key, the value and
what is valid. models/hf.py maps the checked dict to a ModelConfig.
"""

from __future__ import annotations

import json
import math
import os

from meshspeed.comm.errors import ConfigError

_MAX_DIM = 1 << 17  # 131072: twice the widest published model
_MAX = {
    "vocab_size": 1 << 24,
    "hidden_size": _MAX_DIM,
    "intermediate_size": 1 << 20,
    "num_hidden_layers": 4096,
    "num_attention_heads": 4096,
    "num_key_value_heads": 4096,
    "head_dim": 4096,
    "max_position_embeddings": 1 << 24,
    "sliding_window": 1 << 24,
    "num_local_experts": 4096,
    "num_experts_per_tok": 4096,
    "max_window_layers": 4096,
}
_NULLABLE = {"num_key_value_heads", "head_dim", "sliding_window", "max_window_layers"}
_BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window", "output_router_logits")
_POSITIVE = ("rms_norm_eps", "rope_theta")
_NONNEG = ("router_aux_loss_coef", "router_jitter_noise", "attention_dropout")
MAX_PARAMS = 10**13  # ten trillion: a larger count is a typo, not a model


class HFConfigError(ConfigError):
    """A Hugging Face config file holds a value meshspeed cannot read; one line names it."""


def _load(path: str):
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except (OSError, ValueError, RecursionError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
        raise HFConfigError(f"{path} is not readable JSON ({why})") from None


def read_config_json(path: str) -> dict:
    """config.json as a dict, each key meshspeed maps checked (see the module docstring)."""
    cfg = _load(path)
    if not isinstance(cfg, dict):
        raise HFConfigError(f"{path} holds a JSON {type(cfg).__name__}; a config.json is an object")

    def bad(key, want: str):
        return HFConfigError(f"{path}: {key}={cfg[key]!r} is not valid; expected {want}")

    for key, top in _MAX.items():
        v = cfg.get(key)
        if key not in cfg or (v is None and key in _NULLABLE):
            continue
        if type(v) is not int or not 1 <= v <= top:
            raise bad(key, f"an integer in [1, {top:,}]" + (" or null" if key in _NULLABLE else ""))
    for key in _BOOLS:
        if key in cfg and not isinstance(cfg[key], bool):
            raise bad(key, "true or false")
    for key in _POSITIVE + _NONNEG:
        v = cfg.get(key)
        number = type(v) in (int, float) and math.isfinite(v)
        if key in cfg and (not number or v < 0 or (v == 0 and key in _POSITIVE)):
            raise bad(key, f"a finite number {'> 0' if key in _POSITIVE else '≥ 0'}")
    for key in ("model_type", "hidden_act"):
        if key in cfg and not isinstance(cfg[key], str):
            raise bad(key, "a string")
    for key in ("rope_scaling", "rope_parameters"):
        if cfg.get(key) is not None and not isinstance(cfg[key], dict):
            raise bad(key, "an object or null")
    if cfg.get("layer_types") is not None and not (
        isinstance(cfg["layer_types"], list) and all(isinstance(t, str) for t in cfg["layer_types"])
    ):
        raise bad("layer_types", "a list of strings or null")
    _plausible(path, cfg)
    return cfg


def _plausible(path: str, cfg: dict) -> None:
    """Head counts that divide, and a parameter count a machine could hold, before any allocation."""
    heads, hidden = cfg.get("num_attention_heads"), cfg.get("hidden_size")
    kv = cfg.get("num_key_value_heads") or heads
    if heads and kv and heads % kv:
        raise HFConfigError(
            f"{path}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}; "
            f"each key/value head serves a whole group of query heads"
        )
    if heads and hidden and not cfg.get("head_dim") and hidden % heads:
        raise HFConfigError(
            f"{path}: hidden_size={hidden} is not divisible by num_attention_heads={heads} (and no head_dim)"
        )
    n = (cfg.get("vocab_size") or 0) * (hidden or 0) * 2
    per_layer = 4 * (hidden or 0) ** 2 + 3 * (hidden or 0) * (cfg.get("intermediate_size") or 0) * max(
        1, cfg.get("num_local_experts") or 1
    )
    n += per_layer * (cfg.get("num_hidden_layers") or 0)
    if n > MAX_PARAMS:
        raise HFConfigError(
            f"{path} describes a model of about {n:.2e} parameters, past the {MAX_PARAMS:.0e} meshspeed "
            f"treats as plausible; check hidden_size, intermediate_size, num_hidden_layers and vocab_size"
        )


def read_index(path: str, model_dir: str) -> dict[str, str]:
    """{tensor: shard path} from model.safetensors.index.json, every shard a plain file name that
    stays inside `model_dir` (a weight_map naming `../x` or `/etc/x` is refused, not read)."""
    index = _load(path)
    wm = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wm, dict) or not wm:
        raise HFConfigError(f"{path}: expected an object with a non-empty 'weight_map' of tensor name → file")
    top = os.path.realpath(model_dir)
    homes = {top}
    # The Hugging Face hub cache: models--org--name/snapshots/<revision>/<file> are links to
    # ../../blobs/<sha256>; a link may lead there, inside the same models-- tree, and nowhere else.
    snaps = os.path.dirname(top)
    repo = os.path.dirname(snaps)
    if os.path.basename(snaps) == "snapshots" and os.path.basename(repo).startswith("models--"):
        homes.add(os.path.join(repo, "blobs"))
    out = {}
    for name, file in wm.items():
        ok = isinstance(file, str) and file not in ("", ".", "..") and not any(c in file for c in "/\\\0")
        real = os.path.realpath(os.path.join(model_dir, file)) if ok else ""
        if not ok or os.path.dirname(real) not in homes:
            raise HFConfigError(
                f"{path}: weight_map[{name!r}] = {file!r}; expected a safetensors file name in {model_dir}"
            )
        out[name] = os.path.join(model_dir, file)
    return out
