"""Peers of ``python -m benchmarks e2e --config FILE --peers vllm trl``: the same job on other engines.

- ``vllm``: the config with TLT removed (:func:`~benchmarks.e2e_config.without_tlt`) and its rollouts
  on vLLM (``model.rollout_backend: vllm``; settings from an overlay, by default
  ``benchmarks/vllm_cpu_peer.yaml``: compiled graphs, plain sampling), run by the Python of an
  environment that has vLLM (``--vllm-python``; on a CPU ``make setup-vllm`` builds ``.venv-vllm``).
  Recorded per rank and step like the other runs.
- ``trl``: TRL's ``GRPOTrainer`` on one worker with one worker's share of the config's step
  (:func:`~benchmarks.trl_peer.run_trl_grpo`: same model, task prompts, reward, group size, sampling,
  loss and optimizer). With ``devices: N > 1`` this is a lower bound of TRL's step on N workers, which
  also waits for its slowest worker and all-reduces the gradients.

A peer that cannot run here (vLLM or TRL not installed), or whose fit fails, is reported in
``peers_skipped`` with the reason, and the other runs go on.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import statistics
import sys
from pathlib import Path
from typing import Any

import yaml

from tlt_lightning.models.hardware import resolve_dtype, training_precision
from tlt_lightning.rl.module_settings import config_groups

__all__ = ["PeerUnavailable", "merge", "peer_ratios", "trl_peer", "vllm_python", "with_vllm"]


class PeerUnavailable(RuntimeError):
    """A peer's software is not installed here; the message says how to install it."""


def merge(base: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``overlay``'s keys, mappings merged recursively (as ``--config A --config B``)."""
    out = copy.deepcopy(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def with_vllm(config: dict[str, Any], overlay: str | Path, store: str | Path) -> dict[str, Any]:
    """``config`` (TLT already removed) with its rollouts on vLLM: the fit config ``overlay`` merged in,
    its MLflow logger writing to the sqlite file ``store``: vLLM's environment has an MLflow of its own,
    which would migrate a store shared with the other runs to a schema theirs cannot open."""
    settings = yaml.safe_load(Path(overlay).read_text()) or {}
    out = merge(config, settings)
    if out.get("model", {}).get("rollout_backend") != "vllm":
        raise ValueError(f"--vllm-config {overlay}: it must set model.rollout_backend: vllm")
    logger = (out.get("trainer") or {}).get("logger")
    if isinstance(logger, dict):
        logger.setdefault("init_args", {})["tracking_uri"] = f"sqlite:///{Path(store).resolve()}"
    return out


def vllm_python(requested: str | None) -> str:
    """The Python that runs the vLLM peer: ``requested``, else this one where vLLM imports, else the
    checkout's ``.venv-vllm``.

    Raises:
        PeerUnavailable: none of them exists.
    """
    if requested:
        if not Path(requested).is_file():
            raise PeerUnavailable(f"--vllm-python {requested}: no such file")
        return requested
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    venv = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
    if venv.is_file():
        return str(venv)
    raise PeerUnavailable("vLLM is not installed: `make setup-vllm` (CPU) or pass --vllm-python")


def trl_peer(config: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """TRL's ``GRPOTrainer`` on one worker's share of ``config``'s step, summarised like the other runs.

    Returns:
        ``{"workers": 1, "steps", "step_s", "step_cpu_s", "reward": [...], "length_mean", "trl_version",
        "config"}``: ``step_s`` is the median wall seconds of the steps after ``args.skip_steps``.

    Raises:
        PeerUnavailable: TRL is not installed (the ``peers`` extra).
    """
    try:
        from benchmarks.trl_peer import run_trl_grpo
    except ImportError as err:  # pragma: no cover - the module imports TRL lazily
        raise PeerUnavailable(str(err)) from err
    model = config.get("model") or {}
    groups = config_groups(model.get("task"), model.get("rollout"), model.get("optim"), None)
    task, rollout, optim = groups.task, groups.rollout, groups.optim
    precision = (config.get("trainer") or {}).get("precision") or training_precision("cpu")
    try:
        result = run_trl_grpo(
            model=model.get("model", "smollm2-135m"),
            task=task,
            steps=int(args.steps),
            prompts_per_step=optim.prompts_per_step,
            group_size=optim.group_size,
            max_new_tokens=rollout.max_new_tokens,
            lr=optim.lr,
            temperature=rollout.temperature,
            seed=int(model.get("seed", 0)),
            dtype=resolve_dtype(model.get("dtype", "float32")),
            output_dir=Path(args.out) / "trl",
            bf16_mixed=str(precision).startswith("bf16"),
            micro_batch_size=optim.micro_batch_size,
        )
    except ImportError as err:
        raise PeerUnavailable(str(err)) from err
    kept = result["steps"][args.skip_steps :] or result["steps"]
    lengths = [r["completion_length_mean"] for r in kept if r["completion_length_mean"] is not None]
    return {
        "workers": 1,
        "steps": len(kept),
        "step_s": statistics.median(r["wall_s"] for r in kept),
        "step_cpu_s": statistics.median(r["cpu_s"] for r in kept),
        "reward": [r["reward_mean"] for r in result["steps"]],
        "length_mean": statistics.fmean(lengths) if lengths else None,
        "trl_version": result["trl_version"],
        "config": result["config"],
    }


def peer_ratios(runs: dict[str, dict[str, Any]], peers: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """How much faster TLT and the baseline are than each peer: ``{peer: {run: {"step": ..., ...}}}``.

    ``step``: the peer's median step over the run's; ``rollout`` (vLLM only): the same of the rollout
    alone; ``rollout_tokens_per_s``: the run's rollout tokens per second over the peer's (the runs'
    responses differ once their policies part, so this is the fairer rollout comparison).
    """
    out: dict[str, Any] = {}
    for peer, summary in {**peers, **({"vllm": runs["vllm"]} if "vllm" in runs else {})}.items():
        out[peer] = {}
        for name in ("tlt", "baseline"):
            mine = runs[name]
            ratio = {"step": summary["step_s"] / mine["step_s"]}
            if "rollout_s" in summary:
                ratio["rollout"] = summary["rollout_s"] / mine["rollout_s"]
                ratio["rollout_tokens_per_s"] = mine["rollout_tokens_per_s"] / summary["rollout_tokens_per_s"]
            out[peer][name] = ratio
    return out
