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

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "RESUME_OVERRIDES",
    "MissingExtraError",
    "UserError",
    "check",
    "check_resumed_settings",
    "flat_settings",
    "is_int",
    "is_number",
    "positive_int",
    "read_json_object",
]


class MissingExtraError(ModuleNotFoundError):
    """An optional dependency is not installed: the message names the extra and the command installing it.

    On the command line it ends the command with that message alone (:func:`tlt_lightning.cli.main`).

    Example:
        >>> err = MissingExtraError("the tasks need the `tasks` extra: pip install 'tlt-lightning[tasks]'")
        >>> isinstance(err, ImportError)  # what callers catching ImportError already catch
        True
    """


class UserError(Exception):
    """Base of the errors a user fixes that are not ``ValueError``/``TypeError`` (a reward function that
    returns NaN, a loss that diverged, a tracking store that cannot be opened): the command line answers
    them, like those two, with one short screen (``tlt_lightning.cli.short_error``), not a traceback."""


def check(condition: bool, name: str, value: Any, allowed: str) -> None:
    """Raise ``ValueError("<name> must be <allowed>, got <value>")`` unless ``condition``."""
    if not condition:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def is_int(value: Any) -> bool:
    """An ``int`` and not a ``bool`` (``True`` is an ``int`` to Python, never a count to a user)."""
    return isinstance(value, int) and not isinstance(value, bool)


def read_json_object(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON object in the file ``path``.

    Raises:
        ValueError: the file is not valid JSON, or holds something other than an object.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def is_number(value: Any) -> bool:
    """A finite ``int`` or ``float``, not a ``bool``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def positive_int(name: str, value: Any) -> None:
    """Raise ``ValueError`` unless ``value`` is an int > 0."""
    check(is_int(value) and value > 0, name, value, "a positive int")


RESUME_OVERRIDES = ("refuse", "apply", "checkpoint")
"""What a resumed run does with settings that differ from the checkpoint's (``tlt-lightning fit
--resume_overrides``): refuse to resume (default), apply the new values, or keep the checkpoint's."""


def flat_settings(settings: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``settings`` with nested mappings flattened to dotted keys (tuples as lists, as a checkpoint has them).

    Example:
        >>> flat_settings({"kind": "eagle1", "training": {"lr": 0.1}})
        {'kind': 'eagle1', 'training.lr': 0.1}
    """
    out: dict[str, Any] = {}
    for key, value in settings.items():
        if isinstance(value, Mapping):
            out.update(flat_settings(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = list(value) if isinstance(value, tuple) else value
    return out


def check_resumed_settings(
    what: str,
    saved: Mapping[str, Any] | None,
    current: Mapping[str, Any],
    mode: str = "refuse",
    fixed: Mapping[str, str] | None = None,
) -> dict[str, tuple[Any, Any]]:
    """The settings of ``what`` a resumed run changes, ``{key: (checkpoint value, new value)}``; raises
    unless ``mode`` lets the run go on with them.

    Args:
        what: whose settings (``"SpotDrafterCallback"``), the prefix of every key in the message.
        saved: the settings the checkpoint holds (nested mappings compared by dotted key); ``None``: a
            checkpoint from before they were saved, nothing to compare.
        current: the settings now.
        mode: one of :data:`RESUME_OVERRIDES`: ``"apply"`` goes on with the new values, the other two
            refuse (the checkpoint's values of these settings cannot be restored into objects built
            from the config).
        fixed: ``{key: why}`` for settings a resumed run can never change (even with ``"apply"``).

    Raises:
        ValueError: a changed setting that ``mode`` does not allow, listed as ``what.key: old -> new``.
    """
    check(mode in RESUME_OVERRIDES, "resume_overrides", mode, f"one of {RESUME_OVERRIDES}")
    if saved is None:
        return {}
    before, now = flat_settings(saved), flat_settings(current)
    changed = {k: (before[k], now[k]) for k in sorted(before.keys() & now.keys()) if before[k] != now[k]}
    fixed = {k: why for k, why in (fixed or {}).items() if k in changed}
    if fixed:
        listed = "\n".join(
            f"  {what}.{k}: {changed[k][0]!r} -> {changed[k][1]!r} ({why})" for k, why in fixed.items()
        )
        raise ValueError(
            f"resuming with {what} settings a resumed run cannot change (checkpoint -> now):\n{listed}\n"
            "Restore them to resume, or start a new run with them."
        )
    if changed and mode != "apply":
        listed = "\n".join(f"  {what}.{k}: {old!r} -> {new!r}" for k, (old, new) in changed.items())
        raise ValueError(
            f"resuming with {what} settings that differ from the checkpoint's (checkpoint -> now):\n"
            f"{listed}\n"
            "To continue the checkpointed run exactly, restore them; to apply them (the run then differs "
            "from an uninterrupted one), add --resume_overrides=apply (in Python: resume_overrides='apply')."
        )
    return changed
