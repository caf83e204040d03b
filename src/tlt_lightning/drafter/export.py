"""Deployable drafters: export to the EAGLE / EAGLE-3 format of vLLM and SGLang, and import back.

    export_drafter("runs/drafter/warmup", "runs/drafter/eagle", target)   # a save_drafter checkpoint
    # vLLM: LLM(model=TARGET, speculative_config={"method": "eagle3", "model": "runs/drafter/eagle",
    #                                              "num_speculative_tokens": 4})
    drafter = import_drafter("runs/drafter/eagle", target)                # identical logits

An export directory holds ``config.json`` and ``model.safetensors`` in the format of one engine
(``engine="vllm"`` or ``"sglang"``, see :mod:`tlt_lightning.drafter.eagle_format`) and a model card
``README.md``, nothing else at its top level: both engines load every ``*.safetensors`` file there,
and an unknown tensor stops them. An EAGLE-1 drafter with a reduced draft vocabulary keeps it in the
subfolder ``draft_vocab/`` (``draft_vocab.safetensors``: ``d2t``, ``t2d``; the engines' EAGLE-1
drafts over the full vocabulary and ignores it; ``hot_token_ids.pt``: SGLang's
``--speculative-token-map``). The target's embedding is shared, never written; EAGLE-3 needs its
LM head rows as ``lm_head.weight``, which is why exporting takes the target.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from tlt_lightning.drafter.config import DrafterConfig
from tlt_lightning.drafter.eagle_format import (
    DTYPE_NAMES,
    ENGINES,
    TLT_KEY,
    check_exportable,
    check_model_type,
    config_from_eagle,
    eagle_config,
)
from tlt_lightning.drafter.hub import config_path
from tlt_lightning.drafter.io import check_draft_vocab, load_drafter, replace_directory
from tlt_lightning.drafter.model import Drafter
from tlt_lightning.drafter.model_card import ModelCardInfo, model_card
from tlt_lightning.models.target import TargetModel
from tlt_lightning.validation import check, read_json_object

__all__ = [
    "ENGINES",
    "EXPORT_CONFIG",
    "EXPORT_SIDE_DIR",
    "EXPORT_VOCAB",
    "EXPORT_WEIGHTS",
    "HOT_TOKENS",
    "VLLM_CPU_HEAD_SIZES",
    "eagle_state_dict",
    "export_drafter",
    "export_drafter_model",
    "import_drafter",
]

# Head sizes vLLM-CPU's attention runs (vllm/v1/attention/backends/cpu_attn.py,
# CPUAttentionBackend.get_supported_head_sizes). GPU vLLM's backends take more (FlashAttention: multiples
# of 8 up to 256), so an export with another head size is still written, with a warning.
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)

EXPORT_CONFIG = "config.json"
EXPORT_WEIGHTS = "model.safetensors"
EXPORT_SIDE_DIR = "draft_vocab"  # EAGLE-1 with a reduced vocabulary only; engines do not look in subfolders
EXPORT_VOCAB = "draft_vocab.safetensors"
HOT_TOKENS = "hot_token_ids.pt"
# Everything an export writes (and the side files' top-level places of exports before ``draft_vocab/``):
# re-exporting replaces these and refuses a directory holding anything else.
_EXPORT_FILES = frozenset(
    {EXPORT_CONFIG, EXPORT_WEIGHTS, "README.md", EXPORT_SIDE_DIR, EXPORT_VOCAB, HOT_TOKENS}
)
_ZERO_IF_ABSENT = ("q_proj", "k_proj", "v_proj", "o_proj")


def _dtype(dtype: torch.dtype | str | None, default: torch.dtype) -> torch.dtype:
    if dtype is None:
        return default
    if isinstance(dtype, str):
        names = {v: k for k, v in DTYPE_NAMES.items()}
        check(dtype in names, "dtype", dtype, f"one of {sorted(names)}")
        return names[dtype]
    return dtype


def eagle_state_dict(
    drafter: Drafter, dtype: torch.dtype | None = None, engine: str = "vllm"
) -> dict[str, torch.Tensor]:
    """The drafter's tensors under the EAGLE names, as ``engine`` loads them (CPU, contiguous).

    Args:
        drafter: the drafter (its target supplies the EAGLE-3 ``lm_head`` rows).
        dtype: floating-point dtype of the weights (default: the drafter's); ``d2t`` stays int64,
            ``t2d`` bool.
        engine: ``"vllm"`` or ``"sglang"`` (whose EAGLE-1 ``fc`` has a bias: written as zeros).

    Returns:
        Name -> tensor, ``d2t``/``t2d`` included when the draft vocabulary is reduced (EAGLE-1
        callers move them to the side file).
    """
    c = drafter.config
    check_exportable(c, engine)
    dtype = _dtype(dtype, drafter.dtype)
    out = {k: v.detach() for k, v in drafter.state_dict().items()}
    layer = "layers.0" if c.kind == "eagle1" else "midlayer"
    if c.attention_bias or c.o_proj_bias:  # Llama's single switch biases all four projections
        for proj in _ZERO_IF_ABSENT:
            weight = out[f"{layer}.self_attn.{proj}.weight"]
            out.setdefault(f"{layer}.self_attn.{proj}.bias", weight.new_zeros(weight.shape[0]))
    if c.kind == "eagle3":
        weight, bias = drafter._head()
        if bias is not None:
            raise ValueError("cannot export: the target's LM head has a bias, which EAGLE-3 lm_head has not")
        out["lm_head.weight"] = weight
    if engine == "sglang" and c.kind == "eagle1":
        out["fc.bias"] = out["fc.weight"].new_zeros(out["fc.weight"].shape[0])
    return {
        k: (v.to(dtype) if v.is_floating_point() else v).to("cpu").contiguous()
        for k, v in sorted(out.items())
    }


def _write_atomic(directory: Path, write: Callable[[Path], None]) -> Path:
    """Refuse to replace anything but an export of ours, then write it atomically (see
    :func:`replace_directory`). An export holding files it did not write is refused too: replacing
    the directory would delete them."""
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        if not directory.is_dir() or TLT_KEY not in _read_json(directory / EXPORT_CONFIG, missing={}):
            raise ValueError(f"{directory} exists and is not a drafter export; refusing to overwrite it")
        foreign = sorted(p.name for p in directory.iterdir() if p.name not in _EXPORT_FILES)
        if foreign:
            raise ValueError(
                f"{directory} is an earlier export but also holds files an export does not write: {foreign}; "
                "re-exporting replaces the whole directory, so move them away or export to another directory"
            )
    return replace_directory(directory, write)


def _read_json(path: Path, missing: dict | None = None) -> dict:
    if not path.is_file():
        if missing is not None:
            return missing
        raise ValueError(f"{path} not found: {path.parent} is not a drafter export")
    return read_json_object(path)


def export_drafter_model(
    drafter: Drafter,
    out_dir: str | os.PathLike,
    dtype: torch.dtype | str | None = None,
    engine: str = "vllm",
    verifier: str | None = None,
    card: ModelCardInfo | None = None,
) -> Path:
    """Write ``drafter`` as a deployable EAGLE / EAGLE-3 directory for ``engine`` (atomically).

    Args:
        drafter: the drafter; its target must be the exact model it will be deployed with.
        out_dir: the output directory; an earlier export there is replaced (unless it also holds
            files an export does not write), any other non-empty directory is refused.
        dtype: weight dtype, ``torch.dtype`` or ``"float32"``/``"bfloat16"``/``"float16"``
            (default: the drafter's).
        engine: ``"vllm"`` (default) or ``"sglang"``: the engine that loads the directory as it is.
        verifier: the target's Hub id or directory: an EAGLE-3 vLLM export records it in its
            ``speculators_config``, so ``vllm serve OUT_DIR`` starts it; the model card's ``base_model``.
        card: what the model card says beyond the weights (license, tasks, measured acceptance).

    Returns:
        ``out_dir``.

    Raises:
        ValueError: the target architecture has no EAGLE drafter in vLLM / SGLang, or another
            reason of :func:`~tlt_lightning.drafter.eagle_format.check_exportable`.

    Warns:
        UserWarning: ``engine="vllm"`` and a ``head_dim`` vLLM-CPU cannot run
            (:data:`VLLM_CPU_HEAD_SIZES`; tiny test models have 16): the export serves on GPU vLLM.

    Example:
        >>> export_drafter_model(drafter, "runs/eagle", dtype="bfloat16")  # doctest: +SKIP
    """
    c = drafter.config
    dtype = _dtype(dtype, drafter.dtype)
    card = card or ModelCardInfo()
    config = eagle_config(c, dtype, engine, verifier=verifier)
    tensors = eagle_state_dict(drafter, dtype, engine)
    if engine == "vllm" and c.head_dim not in VLLM_CPU_HEAD_SIZES:
        warnings.warn(
            f"head_dim {c.head_dim} (the target's) is not among vLLM-CPU's head sizes {VLLM_CPU_HEAD_SIZES}: "
            "vLLM on a CPU cannot serve this target and drafter; GPU vLLM can",
            UserWarning,
            stacklevel=2,
        )
    side: dict[str, torch.Tensor] = {}
    if c.kind == "eagle1" and c.reduced_vocab:
        side = {k: tensors.pop(k) for k in ("d2t", "t2d")}

    def write(tmp: Path) -> None:
        meta = {"format": "pt"}
        save_file(tensors, tmp / EXPORT_WEIGHTS, metadata=meta)
        if side:
            (tmp / EXPORT_SIDE_DIR).mkdir()
            save_file(side, tmp / EXPORT_SIDE_DIR / EXPORT_VOCAB, metadata=meta)
            torch.save(drafter.draft_ids.cpu().clone(), tmp / EXPORT_SIDE_DIR / HOT_TOKENS)
        (tmp / EXPORT_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "README.md").write_text(model_card(config, tensors, side, card, verifier))
        for path in tmp.rglob("*"):  # safetensors writes 0600; a server may run as another user
            path.chmod(0o755 if path.is_dir() else 0o644)

    return _write_atomic(Path(out_dir), write)


def export_drafter(
    drafter_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    target: TargetModel,
    dtype: torch.dtype | str | None = None,
    engine: str = "vllm",
    verifier: str | None = None,
) -> Path:
    """Export a :func:`~tlt_lightning.drafter.save_drafter` checkpoint for vLLM / SGLang.

    Args:
        drafter_dir: the drafter checkpoint (``model.safetensors`` + ``config.json``).
        out_dir: the export directory (see :func:`export_drafter_model`).
        target: the target the drafter drafts for (its architecture is checked, its LM head rows
            become the EAGLE-3 ``lm_head``).
        dtype: weight dtype (default: the target's).
        engine: ``"vllm"`` or ``"sglang"`` (see :func:`export_drafter_model`).
        verifier: the target's Hub id or directory (see :func:`export_drafter_model`).

    The model card takes the task and held-out acceptance from the checkpoint's ``warmup.json``
    (``drafter warmup``), when it has one.

    Raises:
        ValueError: the checkpoint's target architecture has no EAGLE drafter in vLLM / SGLang
            (checked before anything loads), or the checkpoint is missing, corrupt or does not fit
            ``target``.

    Example:
        >>> from tlt_lightning.models import HFTarget, load_model
        >>> target = HFTarget(load_model("smollm2-135m").model)  # doctest: +SKIP
        >>> export_drafter("runs/drafter/warmup", "runs/drafter/eagle", target)  # doctest: +SKIP
    """
    path = config_path(Path(drafter_dir))
    raw = _read_json(path).get("config") if path is not None else None
    if isinstance(raw, dict) and "model_type" in raw:
        check_model_type(raw["model_type"])  # before DrafterConfig, whose own message is less specific
    card = ModelCardInfo.from_warmup(Path(drafter_dir) / "warmup.json")
    drafter = load_drafter(drafter_dir, target)
    return export_drafter_model(drafter, out_dir, dtype=dtype, engine=engine, verifier=verifier, card=card)


def _load(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise ValueError(f"{path} not found")
    try:
        return load_file(path)
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{path} is corrupt or not a safetensors file: {err}") from err


def import_drafter(
    export_dir: str | os.PathLike,
    target: TargetModel,
    dtype: torch.dtype | None = None,
    check_head: bool = True,
) -> Drafter:
    """Load an EAGLE / EAGLE-3 export (ours, or one of the same layout) back into a :class:`Drafter`.

    Args:
        export_dir: the export directory.
        target: the target to draft for (embedding and LM head are its own, by reference).
        dtype: parameter dtype (default: the target's).
        check_head: require an exported ``lm_head.weight`` (EAGLE-3) to equal the target's LM-head
            rows of the draft vocabulary, and an ``embed_tokens.weight``, if any, the target's
            embedding: neither is loaded, the drafter reads the target's. ``False`` loads a drafter
            exported for an earlier version of the target (e.g. before more RL steps).

    Raises:
        ValueError: missing or corrupt files; a config that is not an EAGLE drafter or disagrees
            with the export's own record or with ``target``; missing, unexpected or misshapen
            tensors; a non-zero bias our layout has no place for; a different LM head.
    """
    export_dir = Path(export_dir)
    data = _read_json(export_dir / EXPORT_CONFIG)
    tensors = _read_tensors(export_dir)
    d2t = tensors.get("d2t")
    draft_vocab = int(d2t.numel()) if d2t is not None else None
    config = config_from_eagle(data, target, draft_vocab_size=draft_vocab)
    _check_record(data, config, export_dir)
    drafter = Drafter(config, target, dtype=dtype)
    _complete_draft_vocab(tensors, config, export_dir)
    head = tensors.pop("lm_head.weight", None)
    embed = tensors.pop("embed_tokens.weight", None)  # not loaded either: the target's embedding is used
    _check_fits(tensors, drafter.state_dict(), config, export_dir)
    drafter.load_state_dict(tensors, strict=True)
    if check_head:
        _check_shared(drafter, embed, head, export_dir)
    return drafter


def _read_tensors(export_dir: Path) -> dict[str, torch.Tensor]:
    """The export's weights, with its reduced draft vocabulary (``d2t``, ``t2d``) if it has one."""
    tensors = _load(export_dir / EXPORT_WEIGHTS)
    for vocab_file in (
        export_dir / EXPORT_SIDE_DIR / EXPORT_VOCAB,
        export_dir / EXPORT_VOCAB,
    ):  # new, old place
        if vocab_file.is_file():
            tensors.update(_load(vocab_file))
            break
    return tensors


def _check_record(data: dict, config: DrafterConfig, export_dir: Path) -> None:
    """Require the EAGLE keys of an export of ours to agree with the drafter config it recorded."""
    record = data.get(TLT_KEY, {}).get("drafter_config")
    if record is not None:
        recorded = DrafterConfig.from_dict(record)
        diff = [f for f, v in config.to_dict().items() if recorded.to_dict()[f] != v]
        if diff:
            raise ValueError(
                f"{export_dir / EXPORT_CONFIG}: the EAGLE keys disagree with its record on {diff}"
            )


def _complete_draft_vocab(tensors: dict[str, torch.Tensor], config: DrafterConfig, export_dir: Path) -> None:
    """Bring the draft-vocabulary tensors to our layout: ``t2d`` rebuilt from ``d2t`` where an export
    omits it, and identity offsets of a full vocabulary dropped."""
    if config.reduced_vocab and "t2d" not in tensors and "d2t" in tensors:  # vLLM needs no t2d: some omit it
        ids = torch.arange(tensors["d2t"].numel()) + tensors["d2t"]
        tensors["t2d"] = torch.zeros(config.vocab_size, dtype=torch.bool)
        if bool(((ids >= 0) & (ids < config.vocab_size)).all()):  # else check_draft_vocab names the problem
            tensors["t2d"][ids] = True
    if not config.reduced_vocab and "d2t" in tensors:  # a full vocabulary written with identity offsets
        if bool(tensors["d2t"].any()):
            raise ValueError(f"{export_dir}: d2t is not all zero, but the draft vocabulary is the full one")
        tensors.pop("d2t"), tensors.pop("t2d", None)


def _check_fits(
    tensors: dict[str, torch.Tensor],
    expected: dict[str, torch.Tensor],
    config: DrafterConfig,
    export_dir: Path,
) -> None:
    """Require ``tensors`` to be the drafter's state dict: names and shapes; zero biases are dropped."""
    for name in sorted(set(tensors) - set(expected)):
        if name.endswith(".bias") and not bool((tensors[name] == 0).all()):
            raise ValueError(
                f"{export_dir}: {name} is non-zero, but a {config.model_type} drafter has no such bias"
            )
        if name.endswith(".bias"):
            tensors.pop(name)
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{export_dir} does not fit the drafter: missing {missing}, unexpected {unexpected}")
    for key, value in expected.items():
        if tensors[key].shape != value.shape:
            raise ValueError(
                f"{export_dir}: {key} has shape {list(tensors[key].shape)}, expected {list(value.shape)}"
            )
    if config.reduced_vocab:
        check_draft_vocab(tensors["d2t"], tensors["t2d"], config, export_dir)


def _check_shared(
    drafter: Drafter, embed: torch.Tensor | None, head: torch.Tensor | None, export_dir: Path
) -> None:
    """Require an exported embedding (if any) and EAGLE-3 LM head to be the target's own."""
    shared = []
    if embed is not None:
        shared.append(("embed_tokens.weight", "embedding", embed, drafter._refs.embedding.weight.detach()))
    if drafter.config.kind == "eagle3":
        shared.append(("lm_head.weight", "LM head on the draft vocabulary", head, drafter._head()[0]))
    for name, what, stored, ours in shared:
        if not _same(stored, ours):
            raise ValueError(
                f"{export_dir}: {name} is not the target's {what} (the export was made for other target "
                "weights); pass check_head=False to load it anyway"
            )


def _same(stored: torch.Tensor | None, ours: torch.Tensor) -> bool:
    """Whether ``stored`` is ``ours`` as written in ``stored``'s dtype."""
    return stored is not None and stored.shape == ours.shape and torch.equal(stored, ours.to(stored))
