"""The packages only some features use (matplotlib, wandb, transformers, torchao), imported when a feature asks."""
from __future__ import annotations

import importlib
from types import ModuleType

from nanogpt.errors import UserError


def optional_import(package: str, needed_by: str) -> ModuleType:
    """Import a package that only some features use; missing, a UserError that names the pip command to install it.
    `needed_by`: what the user asked for that needs it ("plot.py", "wandb_log=True")."""
    try:
        return importlib.import_module(package)
    except ImportError as e:
        missing = isinstance(e, ModuleNotFoundError) and e.name == package
        why = "which is not installed" if missing else f"which fails to import ({e})"
        raise UserError(f"{needed_by} needs {package}, {why}: pip install {package}") from None


def pyplot(needed_by: str) -> ModuleType:
    """matplotlib.pyplot drawing into files only (no window). Scripts call it before their slow work, so a missing
    package fails first."""
    matplotlib = optional_import("matplotlib", needed_by)
    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")
