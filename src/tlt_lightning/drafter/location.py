"""The type of a ``drafter_path`` setting: a drafter directory or an MLflow ``models:/`` / ``runs:/`` URI.

Read from a config file by jsonargparse (``tlt-lightning fit``, LightningCLI), a relative directory is
resolved against the directory of that file, as jsonargparse does for its path types; given on the
command line, against the working directory. A config in ``configs/`` may then name
``../examples/drafters/smollm2-arith`` and run from any working directory. A value that is not an
existing directory (a URI, or a typo that loading the drafter reports) stays the string given.

Example:
    >>> drafter_location(None), drafter_location("models:/tlt-drafter/3")
    (None, 'models:/tlt-drafter/3')
"""

from __future__ import annotations

import os
from pathlib import Path

from jsonargparse.typing import path_type

from tlt_lightning.drafter.mlflow_uri import is_mlflow_uri

__all__ = ["DrafterLocation", "check_drafter_location", "drafter_location"]

DrafterDir = path_type("dr", docstring="an existing, readable drafter directory")
DrafterLocation = DrafterDir | str | os.PathLike


def drafter_location(value: str | os.PathLike | None) -> str | None:
    """``value`` as a string: a resolved path as its absolute path, a URI or plain string as given."""
    return None if value is None else os.fspath(value)


def check_drafter_location(value: str, name: str) -> None:
    """Refuse (``ValueError``) a setting ``name`` whose ``value`` is neither a directory nor a URI,
    saying how relative paths resolve."""
    if not is_mlflow_uri(value) and not Path(value).is_dir():
        raise ValueError(
            f"{name} {value!r} is not a drafter directory (nor a models:/ or runs:/ URI); a relative path "
            "in a config file is resolved against that file's directory, on the command line against "
            "the working directory"
        )
