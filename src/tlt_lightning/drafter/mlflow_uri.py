"""Drafter checkpoints named by MLflow URIs: ``models:/<name>/<version>``, ``models:/<name>@<alias>``,
``runs:/<run id>/<path>``, resolved to a local directory with MLflow's own artifact utilities.

Every registered drafter version is an MLflow model whose directory *is* a drafter checkpoint
(``model.safetensors`` + ``config.json``, beside its ``MLmodel``), so a downloaded URI loads
with :func:`~tlt_lightning.drafter.load_drafter` and exports with
:func:`~tlt_lightning.drafter.export_drafter` like any checkpoint directory.

The store is ``tracking_uri`` if given, else ``$MLFLOW_TRACKING_URI``, else the store of
``tlt-lightning fit`` (:data:`DEFAULT_TRACKING_URI`). MLflow is imported only when a URI is resolved.

Example:
    >>> is_mlflow_uri("models:/tlt-drafter-smollm2-135m/3"), is_mlflow_uri("runs/drafter")
    (True, False)
    >>> # with tempfile.TemporaryDirectory() as tmp:
    >>> #     load_drafter(download_drafter("models:/tlt-drafter-smollm2-135m@best", tmp), target)
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Any

from tlt_lightning.validation import MissingExtraError

__all__ = [
    "DEFAULT_TRACKING_URI",
    "URI_SCHEMES",
    "download_drafter",
    "file_sha256",
    "import_mlflow",
    "is_mlflow_uri",
    "quote_filter_value",
    "tracking_uri_or_default",
]

# The tracking store of `tlt-lightning fit` (and of `tracking_logger()` with no arguments).
DEFAULT_TRACKING_URI = "sqlite:///runs/mlflow.db"
URI_SCHEMES = ("models:/", "runs:/")
_INSTALL = "pip install 'tlt-lightning[mlflow]'"
_FORMS = (
    "'models:/<name>/<version>', 'models:/<name>@<alias>', 'runs:/<run id>/<path>' or a registered-model name"
)


def import_mlflow() -> Any:
    """``mlflow``, or ``ModuleNotFoundError`` naming the extra that installs it."""
    try:
        import mlflow
    except ImportError as err:
        raise MissingExtraError(
            f"MLflow is not installed: the drafter registry needs the mlflow extra ({_INSTALL})"
        ) from err
    return mlflow


def is_mlflow_uri(location: object) -> bool:
    """Whether ``location`` is a ``models:/`` or ``runs:/`` URI (not a local path)."""
    return isinstance(location, str) and location.strip().startswith(URI_SCHEMES)


def tracking_uri_or_default(tracking_uri: str | None = None) -> str:
    """``tracking_uri``, else ``$MLFLOW_TRACKING_URI``, else :data:`DEFAULT_TRACKING_URI`."""
    return tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


def _sqlite_missing(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI when it does not exist (MLflow would create it empty)."""
    prefix = "sqlite:///"
    if not uri.startswith(prefix) or uri[len(prefix) :] in ("", ":memory:"):
        return None
    path = Path(uri[len(prefix) :])
    return None if path.is_file() else path


def quote_filter_value(value: str) -> str:
    """``value`` quoted for an MLflow search filter (``name='...'``), in double quotes if it holds a ``'``."""
    return f'"{value}"' if "'" in value else f"'{value}'"


def _parse(location: str, version: int | str | None) -> tuple[str, str | None, str | None]:
    """``(name, version, alias)`` of a ``models:/`` URI or a bare name (+ ``version``)."""
    if version is not None and (
        isinstance(version, bool)
        or not isinstance(version, (int, str))
        or (isinstance(version, int) and version < 1)
        or (isinstance(version, str) and not version.strip())
    ):
        raise ValueError(
            f"version must be an int >= 1, a version string, 'latest', an alias or None, got {version!r}"
        )
    text = location.strip()
    if text.startswith("models:/"):
        body = text[len("models:/") :]
        if "@" in body:
            name, alias = body.split("@", 1)
            parsed: tuple[str, str | None, str | None] = (name, None, alias)
        elif body.count("/") == 1:
            name, ver = body.split("/")
            parsed = (name, ver, None)
        else:
            raise ValueError(f"location must be {_FORMS}, got {location!r}")
        if not parsed[0] or "" in parsed[1:] or "/" in (parsed[2] or ""):
            raise ValueError(f"location must be {_FORMS}, got {location!r}")
        if version is not None:
            raise ValueError(
                f"version={version!r} given with a models:/ URI that names one already ({text!r})"
            )
        return parsed
    if ":/" in text:
        raise ValueError(f"location must be {_FORMS}, got {location!r}")
    if version is None:
        return text, None, None
    ver = str(version).strip()
    if ver.isdigit() or ver.lower() == "latest":
        return text, ver, None
    return text, None, ver.lstrip("@")


def _version_number(client: Any, name: str, ver: str | None, alias: str | None, uri: str) -> int:
    """The version number a name + version / alias names (``ValueError`` naming what exists)."""
    mlflow = import_mlflow()
    try:
        registered = client.get_registered_model(name)
    except mlflow.exceptions.MlflowException as err:
        if err.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        names = sorted(m.name for m in client.search_registered_models())
        raise ValueError(
            f"no registered model {name!r} in {uri}; registered models: {names or 'none'}"
        ) from err
    found = client.search_model_versions(f"name={quote_filter_value(name)}")
    versions = sorted(int(v.version) for v in found)
    if alias is not None:
        if alias not in registered.aliases:
            raise ValueError(
                f"registered model {name!r} has no alias {alias!r}; "
                f"aliases: {sorted(registered.aliases) or 'none'}"
                f", versions: {versions}"
            )
        return int(registered.aliases[alias])
    if ver is None or ver.lower() == "latest":
        if not versions:
            raise ValueError(f"registered model {name!r} in {uri} has no versions yet")
        return versions[-1]
    if int(ver) not in versions:
        raise ValueError(f"registered model {name!r} has no version {ver}; versions: {versions or 'none'}")
    return int(ver)


def file_sha256(path: str | os.PathLike) -> str:
    """The SHA-256 of a file's bytes, hex (what a registered drafter version's ``sha256`` tag holds)."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _check_sha256(client: Any, name: str, number: int, local: Path) -> None:
    """Refuse a downloaded version whose weights are not the ones registered (tag ``sha256``)."""
    from tlt_lightning.drafter.io import WEIGHTS_NAME  # io imports this module

    recorded = client.get_model_version(name, str(number)).tags.get("sha256")
    weights = local / WEIGHTS_NAME
    if recorded is None or not weights.is_file():  # registered elsewhere, or not a drafter: load_drafter says
        return
    found = file_sha256(weights)
    if found != recorded:
        raise ValueError(
            f"registered drafter {name!r} version {number}: {WEIGHTS_NAME} has sha256 {found}, but the "
            f"version was registered with sha256 {recorded}: the stored file was changed after "
            "registration; refusing to load it (register the drafter again from a trusted checkpoint)"
        )


def _run_artifact(client: Any, location: str, uri: str) -> None:
    """Check that a ``runs:/<run id>/<path>`` URI names an existing run and artifact directory."""
    mlflow = import_mlflow()
    body = location.strip()[len("runs:/") :]
    run_id, _, path = body.partition("/")
    if not run_id or not path.strip("/"):
        raise ValueError(f"location must be {_FORMS} (a runs:/ URI names a run and a path), got {location!r}")
    try:
        client.get_run(run_id)
    except mlflow.exceptions.MlflowException as err:
        if err.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        raise ValueError(f"no run {run_id!r} in {uri} (from {location!r})") from err
    path = path.strip("/")
    parent = str(Path(path).parent) if "/" in path else None
    found = {a.path for a in client.list_artifacts(run_id, parent)}
    if path not in found:
        shown = sorted(found) or "none"
        raise ValueError(
            f"run {run_id} has no artifact {path!r}; artifacts under {parent or 'its root'!r}: {shown}"
        )


def download_drafter(
    location: str,
    dst: str | os.PathLike,
    version: int | str | None = None,
    tracking_uri: str | None = None,
) -> Path:
    """Download the drafter checkpoint an MLflow URI (or a registered-model name) names into ``dst``.

    Args:
        location: ``"models:/<name>/<version>"`` (``latest`` for the newest), ``"models:/<name>@<alias>"``,
            ``"runs:/<run id>/<artifact path>"`` or a bare registered-model name.
        dst: an existing local directory to download into.
        version: with a bare name: a version number, ``"latest"`` or an alias; ``None``: the newest.
        tracking_uri: the MLflow store; ``None``: ``$MLFLOW_TRACKING_URI``, else
            :data:`DEFAULT_TRACKING_URI` (the store of ``tlt-lightning fit``).

    Returns:
        The local directory holding the checkpoint (and the version's ``MLmodel``).

    Raises:
        ModuleNotFoundError: MLflow is not installed (the ``mlflow`` extra).
        ValueError: a malformed URI (one with a ``..`` segment); no such store, registered model,
            version, alias, run or artifact (the message names those that exist); a registered version
            whose weights file does not match the ``sha256`` tag it was registered with.
    """
    if not isinstance(location, str) or not location.strip():
        raise ValueError(f"location must be {_FORMS}, got {location!r}")
    is_run = location.strip().startswith("runs:/")
    if ".." in re.split(r"[/\\]", location.strip().partition(":/")[2]):  # inside the store, never above
        raise ValueError(f"location {location!r} goes up a folder ('..'): a URI names a drafter in its store")
    if is_run and version is not None:
        raise ValueError(
            f"version={version!r} given with a runs:/ URI ({location!r}): versions name registered models"
        )
    name, ver, alias = (None, None, None) if is_run else _parse(location, version)
    mlflow = import_mlflow()
    uri = tracking_uri_or_default(tracking_uri)
    missing_db = _sqlite_missing(uri)
    if missing_db is not None:
        raise ValueError(f"no MLflow store at {uri!r} ({missing_db} does not exist): pass tracking_uri=")
    client = mlflow.MlflowClient(tracking_uri=uri)
    if is_run:
        _run_artifact(client, location, uri)
        source = location.strip()
    else:
        number = _version_number(client, name, ver, alias, uri)
        source = client.get_model_version_download_uri(name, str(number))
    local = Path(
        mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=str(dst), tracking_uri=uri)
    )
    if not is_run:
        _check_sha256(client, name, number, local)
    return local
