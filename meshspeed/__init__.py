"""meshspeed: train large transformer and MoE models across many devices on plain torch.distributed."""

__version__ = "0.1.0"

# Bring your own model and loop (interop/parallelize.py). Imported on first use: it pulls in the
# models and parallel layers, which `import meshspeed` (the CLI's first line) should not pay for.
_LAZY = {"parallelize", "gather_for_save", "clip_grad_norm_", "Parallelized"}


def __getattr__(name: str):
    if name in _LAZY:
        from meshspeed.interop import parallelize as _p

        return getattr(_p, name)
    raise AttributeError(f"module 'meshspeed' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_LAZY])
