"""Errors raised by meshspeed.comm. Each message is meant to be read once and acted on."""


class CommError(RuntimeError):
    """Base class for communication errors."""


class CollectiveTimeout(CommError):
    """A collective did not complete in time; the message names the ranks that never arrived."""


class DesyncError(CommError):
    """Ranks of one group called different collectives (or incompatible shapes) at the same step."""


class ConfigError(ValueError):
    """A setting has a value that cannot work; the message names the setting, the value and the fix."""
