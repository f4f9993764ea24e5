"""Imports of the packages that only some parts of bam-pyro need, failing with the extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType

#: the pip extra that brings each optional package
EXTRAS = {
    "torch_geometric": "pyg",
    "lightning": "lightning",
    "transformers": "transformers",
    "arviz": "diagnostics",
    "xarray": "diagnostics",
    "pandas": "diagnostics",
    "scipy": "diagnostics",
    "sklearn": "diagnostics",
    "matplotlib": "diagnostics",
}


def require(package: str, user: str) -> ModuleType:
    """``package`` imported, or an ``ImportError`` of one line naming ``user`` (the part of
    bam-pyro that needs it) and the extra that installs it."""
    try:
        return importlib.import_module(package)
    except ImportError as error:
        root = package.split(".")[0]
        extra = EXTRAS[root]
        raise ImportError(
            f"{user} needs {root}, which is not installed: pip install 'bam-pyro[{extra}]'"
        ) from error
