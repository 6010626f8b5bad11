"""The API reference's view of the package layout (a griffe extension, named in mkdocs.yml).

The wheel installs the repository's top-level ``strategies/`` as ``fedsim.strategies``; an editable install
maps it there with an import hook that griffe's static loader does not follow. This extension loads the folder
and attaches it to the ``fedsim`` package, so the reference documents ``fedsim.strategies.*`` under the names
users import, without importing (running) any of fedsim's code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import griffe

ROOT = Path(__file__).resolve().parents[1]


class StrategiesUnderFedsim(griffe.Extension):
    """Attach ``strategies/`` to the ``fedsim`` package as its ``strategies`` subpackage."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if pkg.name != "fedsim" or "strategies" in pkg.members:
            return
        sub = griffe.load(
            "strategies",
            search_paths=[str(ROOT)],
            docstring_parser=loader.docstring_parser,
            docstring_options=loader.docstring_options,
        )
        pkg.set_member("strategies", sub)
