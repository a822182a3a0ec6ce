"""Memory features: recompute, counted activation bytes, chunked loss.

Sits beside parallel/ and sparse/: it transforms a built model from outside (by module shape
and the recipe's pipeline units) and never imports models/.
"""

from .chunked_loss import chunked_loss, chunked_model_loss, hidden_states_out
from .count import SavedBytes, count_saved
from .recompute import RECOMPUTE_MODES, apply_recompute

__all__ = [
    "RECOMPUTE_MODES",
    "SavedBytes",
    "apply_recompute",
    "chunked_loss",
    "chunked_model_loss",
    "count_saved",
    "hidden_states_out",
]
