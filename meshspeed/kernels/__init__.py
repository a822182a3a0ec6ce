"""Pure math: the reference torch version of each kernel, and the fast version where one exists.
Imports only `meshspeed.comm` (and torch)."""

from meshspeed.kernels.loss import cross_entropy_loss

__all__ = ["cross_entropy_loss"]
