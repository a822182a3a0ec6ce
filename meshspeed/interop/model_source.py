"""Where a run's model comes from, as a ModelConfig: a preset with overrides, or the config a
meshspeed checkpoint recorded. Kept apart from the trainer, the pipeline checks, the Hugging
Face import and the export, which all need it, so none of them imports another for it.
"""

from __future__ import annotations

import os

from meshspeed.checkpoint.dirs import CheckpointError, resolve
from meshspeed.comm.errors import ConfigError
from meshspeed.models import ModelConfig, get_preset

SIZE_OVERRIDES = ("n_layers", "dim", "n_heads", "n_kv_heads")


def preset_config(preset: str, overrides: dict, seq_len: int) -> ModelConfig:
    """Preset + overrides, with max_seq_len raised to seq_len when it is longer. A bad preset
    name or override is one ConfigError line (ModelConfig names the field and what would work)."""
    try:
        base = get_preset(preset, **overrides)
        if seq_len > base.max_seq_len:
            base = get_preset(preset, **overrides, max_seq_len=seq_len)
    except ValueError as e:
        given = ", ".join(f"model.{k}={v}" for k, v in {"preset": preset, **overrides}.items())
        raise ConfigError(f"{given}: {e}") from None
    return base


def checkpoint_state(path: str) -> tuple[str, dict]:
    """(checkpoint directory, its state.pt) for a checkpoint or a run directory (its latest);
    plain data only, as the checkpoint loader reads it."""
    # Here, not at the top: the run plan imports this module, and torch's distributed
    # checkpoint (3 s to import on 2 CPU cores) is needed only when there is a checkpoint.
    from meshspeed.checkpoint.dcp import STATE, load_state

    resolved = resolve(path)
    return resolved, load_state(os.path.join(resolved, STATE))


def checkpoint_model_config(path: str, setting: str = "--checkpoint") -> ModelConfig:
    """The ModelConfig a meshspeed checkpoint was saved from: recorded by convert and by the
    trainer, else derived from the training config it holds (preset + overrides)."""
    try:
        _, state = checkpoint_state(path)
    except (CheckpointError, OSError) as e:
        raise ConfigError(
            f"{setting}={path!r} is neither a Hugging Face directory (config.json) nor a meshspeed "
            f"checkpoint: {e}"
        ) from None
    extra = state.get("extra") or {}
    if extra.get("model_config"):
        recorded = extra["model_config"]
        try:
            if not isinstance(recorded, dict):
                raise TypeError(f"a {type(recorded).__name__}, not a dict")
            return ModelConfig(**recorded)
        except (TypeError, ValueError) as e:  # an altered state.pt: one line, not a traceback
            raise ConfigError(
                f"{setting}={path!r}: the model config its state.pt records is not valid ({e}); "
                f"restore the checkpoint from a copy"
            ) from None
    run = extra.get("config") or {}
    if run.get("model"):  # older checkpoints: the trainer's own derivation from its settings
        model = run["model"]
        overrides = {k: model[k] for k in SIZE_OVERRIDES if model.get(k)}
        return preset_config(model["preset"], overrides, run["train"]["seq_len"])
    raise ConfigError(
        f"{setting}={path!r}: the checkpoint records no model config; it was not written by "
        f"meshspeed train or meshspeed convert"
    )
