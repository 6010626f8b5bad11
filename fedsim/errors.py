"""Exceptions that fedsim turns into one clear line instead of a traceback."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A configuration value is not allowed.

    Parameters
    ----------
    key : str
        Dotted config key, e.g. ``partitioner.alpha``.
    value : Any
        The offending value.
    allowed : str
        What would be accepted, e.g. ``"a float > 0"``.
    hint : str, optional
        One more sentence on how to fix it.
    """

    def __init__(self, key: str, value: Any, allowed: str, hint: str = "") -> None:
        self.key, self.value, self.allowed, self.hint = key, value, allowed, hint
        msg = f"{key}={value!r} is not allowed: expected {allowed}."
        if hint:
            msg += f" {hint}"
        super().__init__(msg)

    def with_prefix(self, prefix: str) -> ConfigError:
        """Return the same error with ``prefix.`` put in front of the key."""
        key = f"{prefix}.{self.key}" if prefix and not self.key.startswith(prefix + ".") else self.key
        return ConfigError(key, self.value, self.allowed, self.hint)


class DataNotFoundError(ConfigError):
    """A data set's files are missing; the message says which files, where, and how to get them."""

    def __init__(self, key: str, value: Any, expected: str, how: str) -> None:
        super().__init__(key, value, f"a folder holding {expected}", how)


class StopRun(Exception):
    """Raised by a strategy (e.g. an exhausted privacy budget) to end the run cleanly, keeping outputs."""


class RunError(RuntimeError):
    """The run cannot go on (no client ever answers, a client stack that cannot start, ...).

    The command line prints its message as one line and exits 1; the run folder keeps what was done.
    """
