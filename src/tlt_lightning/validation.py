"""Checks of user settings, shared by every config: one message format everywhere.

Every check raises ``ValueError("<name> must be <allowed>, got <value>")``, so an error names the
field, the value received and what is allowed.

Example:
    >>> from tlt_lightning.validation import check, is_int
    >>> check(is_int(4) and 4 > 0, "group_size", 4, "a positive int")
    >>> check(is_int(True), "group_size", True, "an int")
    Traceback (most recent call last):
    ...
    ValueError: group_size must be an int, got True
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["MissingExtraError", "check", "is_int", "is_number", "positive_int"]


class MissingExtraError(ModuleNotFoundError):
    """An optional dependency is not installed: the message names the extra and the command installing it.

    On the command line it ends the command with that message alone (:func:`tlt_lightning.cli.main`).

    Example:
        >>> err = MissingExtraError("the tasks need the `tasks` extra: pip install 'tlt-lightning[tasks]'")
        >>> isinstance(err, ImportError)  # what callers catching ImportError already catch
        True
    """


def check(condition: bool, name: str, value: Any, allowed: str) -> None:
    """Raise ``ValueError("<name> must be <allowed>, got <value>")`` unless ``condition``."""
    if not condition:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def is_int(value: Any) -> bool:
    """An ``int`` and not a ``bool`` (``True`` is an ``int`` to Python, never a count to a user)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite ``int`` or ``float``, not a ``bool``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def positive_int(name: str, value: Any) -> None:
    """Raise ``ValueError`` unless ``value`` is an int > 0."""
    check(is_int(value) and value > 0, name, value, "a positive int")
