"""Memory features: recompute, counted activation bytes, chunked loss, fp32/bf16 parameter
storage sharing, optimizer offload, activation swap.

Sits beside parallel/ and sparse/: it transforms a built model from outside (by module shape
and the recipe's pipeline units) and never imports models/.
"""

from .chunked_loss import chunked_loss, chunked_model_loss, hidden_states_out
from .count import SavedBytes, count_saved, cpu_peak_bytes
from .fp32_reuse import share_fp32_masters
from .offload import offload_optimizer
from .recompute import RECOMPUTE_MODES, apply_recompute
from .swap import apply_swap_activations

__all__ = [
    "RECOMPUTE_MODES",
    "SavedBytes",
    "apply_recompute",
    "apply_swap_activations",
    "chunked_loss",
    "chunked_model_loss",
    "count_saved",
    "cpu_peak_bytes",
    "hidden_states_out",
    "offload_optimizer",
    "share_fp32_masters",
]
