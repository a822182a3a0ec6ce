"""Guards of the training loop: a step whose loss or gradient norm is not finite."""

from __future__ import annotations

import sys

from meshspeed.comm.errors import echo


class NonFiniteError(RuntimeError):
    """Too many steps in a row had a non-finite loss or gradient norm; the run stopped."""

    one_line = True


def check_bad(t, row: dict, bad_in_row: int, lead: bool) -> None:
    """Log a skipped step; stop the run (on every rank alike) after too many in a row.
    t: the train section."""
    step = row["step"]
    loss, norm = row["loss"], row["grad_norm"]
    if lead:
        print(
            f"meshspeed: step {step}: loss {loss:.4g}, grad norm {norm:.4g}: not finite, update "
            f"skipped ({bad_in_row} in a row of train.max_bad_steps={t.max_bad_steps})",
            file=sys.stderr,
            flush=True,
        )
    if bad_in_row >= t.max_bad_steps:
        raise echo(
            NonFiniteError(
                f"step {step}: loss {loss:.4g}, grad norm {norm:.4g}: not finite for {bad_in_row} "
                f"steps in a row (train.max_bad_steps={t.max_bad_steps}), run stopped without saving; "
                f"lower --train.lr "
                f"(now {t.lr:g}) or --train.grad_clip, then resume from the last checkpoint with "
                f"--checkpoint.resume latest"
            ),
            not lead,
        )
