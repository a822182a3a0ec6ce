"""The [sparsity] section as the core SparsityConfig, checked before any worker starts (the
trainer's hook that applies it is meshspeed.train.sparsity)."""

from __future__ import annotations

from meshspeed.comm import ConfigError
from meshspeed.sparse import SparsityConfig


def sparsity_config(section, *, total_steps: int | None = None, seed: int = 0) -> SparsityConfig | None:
    """The core SparsityConfig of a [sparsity] section (None for pattern 'none'); ConfigError if invalid."""
    if section.pattern == "none":
        for key in ("async_masks", "pattern_schedule", "sparse_grad_comm"):
            if getattr(section, key):
                raise ConfigError(
                    f"sparsity.{key}={getattr(section, key)!r} needs masks; set sparsity.pattern "
                    f"(e.g. 2:4) or leave sparsity.{key} unset"
                )
        return None
    ramp = section.ramp_steps or max(1, (total_steps or 2) // 2)
    try:
        return SparsityConfig(
            pattern=section.pattern,
            target=section.target or None,
            initial=section.initial,
            schedule=section.schedule,
            ramp_steps=ramp,
            total_steps=total_steps,
            update_interval=section.update_interval,
            method=section.method,
            layers=section.layers,
            sr_ste_lambda=None if section.sr_ste_lambda < 0 else section.sr_ste_lambda,
            warmup_steps=section.warmup_steps,
            dense_finish_steps=section.dense_finish_steps,
            distribution=section.distribution,
            adapter=section.adapter,
            drop_fraction=section.drop_fraction,
            transposable=section.transposable,
            seed=seed,
            pattern_schedule=section.pattern_schedule,
        )
    except ValueError as err:
        raise ConfigError(str(err)) from None
