"""Flower's keyword names for fedsim's strategy parameters, resolved in one place.

fedsim's strategies accept the name their ``flwr.serverapp.strategy`` counterpart uses (``num_malicious_nodes``
for Krum's ``num_malicious``, ``clipping_norm`` for ``clip_norm``, ...), so code written for Flower's classes
runs unchanged. Defaults that differ from Flower's are listed in the README (Flower interoperability).
"""

from __future__ import annotations

from typing import Any

from fedsim.errors import ConfigError


def alias(name: str, value: Any, default: Any, flower_name: str, flower_value: Any) -> Any:
    """The value of parameter ``name``, given by fedsim's name or by Flower's ``flower_name``.

    ``flower_value`` is None when Flower's name was not used. Both names with different values (fedsim's not
    at its default) is a ``ConfigError`` naming both.
    """
    if flower_value is None:
        return value
    if value != default and value != flower_value:
        raise ConfigError(
            flower_name,
            flower_value,
            f"the same value as {name}={value!r}, or only one of the two",
            f"{flower_name} is Flower's name for fedsim's {name}.",
        )
    return flower_value
