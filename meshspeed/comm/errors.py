"""Errors raised by meshspeed.comm. Each message is meant to be read once and acted on.

Two attributes tell a launcher how to report an error (see comm.launch):
- `one_line` (class): the message is a diagnosis, not a bug; print it, not a traceback.
- `echo` (instance, via `echo()`): this rank raises it only because another rank failed, or
  every rank raises the same error; another rank reports it, so this one stays quiet.
"""


class CommError(RuntimeError):
    """Base class for communication errors."""

    one_line = True


class CollectiveTimeout(CommError):
    """A collective did not complete in time; the message names the ranks that never arrived."""


class DesyncError(CommError):
    """Ranks of one group called different collectives (or incompatible shapes) at the same step."""


class ConfigError(ValueError):
    """A setting has a value that cannot work; the message names the setting, the value and the fix."""

    one_line = True


def echo(err: BaseException, is_echo: bool = True) -> BaseException:
    """Mark `err` as an echo of a failure another rank reports (returns it: `raise echo(e)`)."""
    err.echo = is_echo
    return err
