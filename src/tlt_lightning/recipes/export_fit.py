"""``tlt-lightning export-drafter --from-fit``: the RL policy and its drafter, ready for vLLM, from a fit.

    tlt-lightning export-drafter --from-fit runs/fit/EXP/RUN runs/export/policy      # a run's directory
    tlt-lightning export-drafter --from-fit runs/fit/EXP/RUN/checkpoints/last.ckpt OUT

A fit checkpoint holds the trained policy (the module's ``policy.*`` weights) and, with
:class:`~tlt_lightning.callbacks.SpotDrafterCallback`, the drafter trained beside it at that very
step (the callback's state). :func:`export_fit` writes both into one directory::

    OUT/
        target/       the policy: transformers ``save_pretrained`` (+ its tokenizer, when the model has one)
        drafter/      the drafter in the EAGLE / EAGLE-3 format of vLLM (or SGLang), see
                      :func:`~tlt_lightning.drafter.export_drafter_model`
        README.md     how to serve the pair
        export.json   what was exported: the checkpoint, its step, the model, the drafter kind

which vLLM loads as it is: ``LLM(model="OUT/target", speculative_config={"method": "eagle" |
"eagle3", "model": "OUT/drafter", "num_speculative_tokens": K})``, the layout
:meth:`~tlt_lightning.vllm.VLLMRolloutBackend.from_policy` serves too. Nothing is rebuilt but the
policy's architecture (``load_model`` of the run's ``model``): no prompt source, task or trainer.
A run without a ``SpotDrafterCallback`` exports the drafter it loaded (``drafter_path``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tlt_lightning.drafter import Drafter, DrafterConfig, export_drafter_model, load_drafter
from tlt_lightning.drafter.io import replace_directory
from tlt_lightning.models import HFTarget, load_model, resolve_dtype
from tlt_lightning.resume import read_checkpoint
from tlt_lightning.vllm.backend import METHODS

__all__ = ["EXPORT_RECORD", "FitExport", "export_fit", "find_fit_checkpoint", "policy_state_dict"]

EXPORT_RECORD = "export.json"
POLICY_DIR, DRAFTER_DIR = "target", "drafter"
POLICY_PREFIX = "policy."


@dataclass(frozen=True)
class FitExport:
    """What :func:`export_fit` wrote.

    Attributes:
        out: the export directory; ``policy_dir`` / ``drafter_dir`` inside it.
        checkpoint: the Lightning checkpoint read.
        step: its ``global_step`` (the RL step of both policy and drafter).
        model: the run's ``model`` (registry name or HF directory) the architecture came from.
        kind: ``"eagle1"`` or ``"eagle3"``.
        drafter_source: ``"checkpoint"`` (trained by the run's ``SpotDrafterCallback``) or the
            run's ``drafter_path``.
        tokenizer: whether ``policy_dir`` has the tokenizer.
    """

    out: Path
    checkpoint: Path
    step: int
    model: str
    kind: str
    drafter_source: str
    tokenizer: bool

    @property
    def policy_dir(self) -> Path:
        return self.out / POLICY_DIR

    @property
    def drafter_dir(self) -> Path:
        return self.out / DRAFTER_DIR


def find_fit_checkpoint(source: str | os.PathLike) -> Path:
    """The Lightning checkpoint to export from ``source``: a ``.ckpt`` file, or a run directory.

    In a directory: ``last.ckpt`` under it (a run's ``checkpoints/``), else its newest ``*.ckpt``
    by training step. A directory holding several runs is refused, naming them.

    Raises:
        ValueError: nothing found, or several runs; the message says what to pass.
    """
    path = Path(source)
    if path.is_file():
        return path
    if not path.is_dir():
        raise ValueError(f"{str(path)!r} is neither a checkpoint file nor a fit run directory")
    found = sorted(path.rglob("*.ckpt"))
    runs = sorted({p.parent for p in found})
    if not found:
        raise ValueError(
            f"no Lightning checkpoint (*.ckpt) under {path}: pass a fit run's directory "
            "(<default_root_dir>/<experiment id>/<run id>) or its checkpoints/last.ckpt"
        )
    if len(runs) > 1:
        listed = ", ".join(str(r) for r in runs[:5]) + (" ..." if len(runs) > 5 else "")
        raise ValueError(
            f"{path} holds the checkpoints of {len(runs)} runs ({listed}): pass one run's directory"
        )
    last = runs[0] / "last.ckpt"
    if last.is_file():
        return last
    return max(found, key=lambda p: (int(read_checkpoint(p).get("global_step", -1)), p.stat().st_mtime))


def policy_state_dict(checkpoint: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The policy's weights in a :class:`~tlt_lightning.rl.GRPOModule` checkpoint, without the prefix."""
    state = checkpoint["state_dict"]
    policy = {k[len(POLICY_PREFIX) :]: v for k, v in state.items() if k.startswith(POLICY_PREFIX)}
    if not policy:
        raise ValueError("the checkpoint has no policy.* weights: it is not a GRPOModule checkpoint")
    return policy


def _load_policy(model: nn.Module, weights: dict[str, torch.Tensor], where: Path) -> None:
    """Load ``weights`` into ``model``; only weights tied to loaded ones may be absent."""
    missing, unexpected = model.load_state_dict(weights, strict=False)
    params = model.state_dict(keep_vars=True)
    loaded = {params[k].data_ptr() for k in weights if k in params}
    untied = [k for k in missing if params[k].data_ptr() not in loaded]
    if untied or unexpected:
        raise ValueError(
            f"the policy in {where} does not fit a transformers {type(model).__name__}: "
            f"missing {untied[:5]}, unexpected {unexpected[:5]} (a TorchtuneGRPOModule checkpoint holds "
            "a torchtune model, which has no save_pretrained; "
            "or pass --model with the architecture the run trained)"
        )


def _drafter_state(
    checkpoint: Mapping[str, Any], where: Path
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """``(drafter config dict, weights)`` of the run's SpotDrafterCallback, if it had one."""
    found = [
        s
        for s in checkpoint.get("callbacks", {}).values()
        if isinstance(s, Mapping) and "drafter_config" in s and "drafter" in s
    ]
    if len(found) > 1:
        raise ValueError(
            f"{where} holds {len(found)} trained drafters (several SpotDrafterCallbacks): cannot tell which"
        )
    return (found[0]["drafter_config"], found[0]["drafter"]) if found else None


def _fit_drafter(
    checkpoint: Mapping[str, Any], ckpt_path: Path, target: HFTarget, kind: str | None
) -> tuple[Drafter, str]:
    """``(drafter, where it came from)``: the one trained in the fit, else the one the run loaded."""
    hp = checkpoint.get("hyper_parameters") or {}
    state = _drafter_state(checkpoint, ckpt_path)
    if state is not None:
        config, weights = state
        drafter = Drafter(DrafterConfig.from_dict(dict(config)), target)
        drafter.load_state_dict(weights, strict=True)
        drafter_source = "checkpoint"
    elif drafter_path := (hp.get("speculative") or {}).get("drafter_path"):
        drafter, drafter_source = load_drafter(drafter_path, target), str(drafter_path)
    else:
        raise ValueError(
            f"{ckpt_path} holds no trained drafter (the run had no SpotDrafterCallback) and the run loaded "
            "none (drafter_path is null): there is no drafter to export with this policy"
        )
    if kind is not None and kind != drafter.config.kind:
        raise ValueError(
            f"the run's drafter is an {drafter.config.kind} drafter and --kind is {kind}: "
            "a drafter is never converted"
        )
    return drafter, drafter_source


def _readme(record: dict[str, Any]) -> str:
    method = METHODS[record["kind"]]
    return "\n".join(
        [
            f"# RL policy and its {record['kind']} drafter (tlt-lightning, step {record['step']})",
            "",
            f"Exported by `tlt-lightning export-drafter --from-fit` from `{record['checkpoint']}`: "
            "the policy as",
            "trained at that step (`target/`, transformers) and the drafter trained beside it "
            "(`drafter/`, EAGLE",
            f"format for {record['engine']}). "
            "Serve them together; speculative decoding never changes the output.",
            "",
            "```bash",
            f"vllm serve {POLICY_DIR} --speculative-config "
            f'\'{{"method": "{method}", "model": "{DRAFTER_DIR}", "num_speculative_tokens": 4}}\'',
            "```",
            "",
            "```python",
            "from vllm import LLM",
            f'llm = LLM(model="{POLICY_DIR}", '
            f'speculative_config={{"method": "{method}", "model": "{DRAFTER_DIR}",',
            '                                               "num_speculative_tokens": 4})',
            "```",
            "",
            "(paths relative to this directory). With tlt-lightning's vLLM rollout backend:",
            f'`VLLMRolloutBackend(VLLMBackendConfig(model="{POLICY_DIR}", drafter="{DRAFTER_DIR}"), '
            "rollout_config)`.",
            ""
            if record["tokenizer"]
            else "\nThe policy has no tokenizer (a tiny random model): send token-id prompts.",
            "",
        ]
    )


def _files(directory: Path) -> list[str]:
    """Every file under ``directory``, as ``/``-separated paths relative to it."""
    return [p.relative_to(directory).as_posix() for p in directory.rglob("*") if not p.is_dir()]


def check_replaceable(out: Path) -> None:
    """Refuse an ``out`` that :func:`export_fit` may not replace: anything but an empty directory or an
    earlier export whose every file is one it wrote (listed in its ``export.json``).

    Raises:
        ValueError: naming the files an export did not write (replacing the directory would delete them).
    """
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return
    record_path = out / EXPORT_RECORD
    if not out.is_dir() or not record_path.is_file():
        raise ValueError(f"{out} exists and is not a policy+drafter export; refusing to overwrite it")
    try:
        written = json.loads(record_path.read_text()).get("files")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as err:
        raise ValueError(
            f"{record_path} is not an export record ({err}); refusing to overwrite {out}"
        ) from err
    if not isinstance(written, list):
        raise ValueError(
            f"{out} is an export without a file list ({EXPORT_RECORD} of an older version): replacing it "
            "could delete files it did not write; delete it yourself or export to another directory"
        )
    foreign = sorted(set(_files(out)) - set(written))
    if foreign:
        raise ValueError(
            f"{out} is an earlier export but also holds files an export did not write: {foreign}; "
            "re-exporting replaces the whole directory, so move them away or export to another directory"
        )


def export_fit(
    source: str | os.PathLike,
    out_dir: str | os.PathLike,
    model: str | None = None,
    dtype: str | None = None,
    engine: str = "vllm",
    kind: str | None = None,
) -> FitExport:
    """Export a fit's policy and drafter together (see the module docstring for the layout).

    Args:
        source: a fit run's directory or one of its ``.ckpt`` files (:func:`find_fit_checkpoint`).
        out_dir: the export directory; an earlier export there is replaced (only when it holds
            nothing but the files it wrote: :func:`check_replaceable`), any other non-empty directory
            is refused.
        model: the policy's architecture and tokenizer (registry name or HF directory); default the
            run's ``model`` setting.
        dtype: ``"float32"`` / ``"bfloat16"`` / ``"float16"`` for both; default the run's ``dtype``.
        engine: ``"vllm"`` or ``"sglang"``: the drafter format (:func:`export_drafter_model`).
        kind: require this drafter kind (``"eagle1"`` / ``"eagle3"``); a drafter is never converted.

    Returns:
        A :class:`FitExport`.

    Raises:
        ValueError: no checkpoint, a checkpoint that is not a transformers GRPOModule's, no drafter
            in it (and no ``drafter_path``), a kind mismatch, or an out directory that is not ours.

    Example:
        >>> done = export_fit("runs/fit/1/RUN_ID", "runs/export/policy")  # doctest: +SKIP
        >>> done.policy_dir, done.drafter_dir  # doctest: +SKIP
    """
    ckpt_path = find_fit_checkpoint(source)
    checkpoint = read_checkpoint(ckpt_path)
    hp = dict(checkpoint.get("hyper_parameters") or {})
    model = model or hp.get("model")
    if not isinstance(model, str):
        raise ValueError(
            f"{ckpt_path} records no model (hyper_parameters['model']): pass --model NAME_OR_HF_DIR"
        )
    trained = resolve_dtype(hp.get("dtype", "float32"))  # "auto": what it means here; the values load exactly
    dtype = dtype or trained
    out = Path(out_dir)
    check_replaceable(out)

    loaded = load_model(model, dtype=trained, seed=int(hp.get("seed", 0)))
    policy = loaded.model
    _load_policy(policy, policy_state_dict(checkpoint), ckpt_path)
    policy = policy.to(getattr(torch, dtype)).eval()
    drafter, drafter_source = _fit_drafter(checkpoint, ckpt_path, HFTarget(policy), kind)
    record = {
        "checkpoint": str(ckpt_path),
        "step": int(checkpoint.get("global_step", 0)),
        "model": model,
        "dtype": dtype,
        "engine": engine,
        "kind": drafter.config.kind,
        "drafter_source": drafter_source,
        "tokenizer": loaded.tokenizer is not None,
        "policy": POLICY_DIR,
        "drafter": DRAFTER_DIR,
    }

    def write(tmp: Path) -> None:
        policy.save_pretrained(tmp / POLICY_DIR)
        if loaded.tokenizer is not None:
            loaded.tokenizer.save_pretrained(tmp / POLICY_DIR)
        verifier = str((out / POLICY_DIR).resolve())  # where the policy is once tmp is renamed into place
        export_drafter_model(drafter, tmp / DRAFTER_DIR, dtype=dtype, engine=engine, verifier=verifier)
        (tmp / "README.md").write_text(_readme(record))
        # The manifest: what a later export may replace (and nothing else).
        record["files"] = sorted([*_files(tmp), EXPORT_RECORD])
        (tmp / EXPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n")

    replace_directory(out, write)
    return FitExport(
        out, ckpt_path, record["step"], model, drafter.config.kind, drafter_source, record["tokenizer"]
    )
