"""meshspeed: train large transformer and MoE models across many devices on plain torch.distributed."""

__version__ = "0.1.0"
