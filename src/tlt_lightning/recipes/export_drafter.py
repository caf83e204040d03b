"""``tlt-lightning export-drafter``: a drafter checkpoint as an EAGLE directory that vLLM or SGLang loads.

    tlt-lightning export-drafter CKPT OUT [--engine vllm|sglang] [--model NAME] [--kind eagle1|eagle3]
    tlt-lightning export-drafter models:/NAME/VERSION OUT     # a registered version (or runs:/RUN_ID/PATH)
    tlt-lightning export-drafter --from-fit RUN_DIR_OR_CKPT OUT  # a fit's policy and its drafter, for vLLM

A checkpoint directory (``drafter warmup``, :func:`~tlt_lightning.drafter.save_drafter`) is exported
for its target: ``--model``, else the model its ``warmup.json`` records, else the one registry model
of its target's shape. An MLflow URI is downloaded first, and its target defaults to the one its
``MLmodel`` records (:mod:`tlt_lightning.tracking.mlflow_pyfunc`). The export is loaded back before
the command reports it. ``--from-fit`` is :func:`~tlt_lightning.recipes.export_fit.export_fit`.
A wrong checkpoint, kind or target ends the command with one line naming it (``SystemExit``).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from tlt_lightning.drafter import DrafterConfig, export_drafter, import_drafter
from tlt_lightning.drafter.io import read_drafter_config
from tlt_lightning.drafter.mlflow_uri import download_drafter, is_mlflow_uri
from tlt_lightning.models import HFTarget, load_model, models_with_signature

__all__ = ["checkpoint_target", "run"]


def run(args: argparse.Namespace) -> None:
    """``tlt-lightning export-drafter`` with its parsed options (:mod:`tlt_lightning.cli_options`)."""
    if args.from_fit is not None:
        _export_fit(args)
        return
    if args.checkpoint is None or args.out is None:
        raise SystemExit("export-drafter: pass CHECKPOINT and OUT (or --from-fit RUN_DIR_OR_CKPT OUT)")
    if is_mlflow_uri(args.checkpoint):  # a registered version or a run's artifact: export its local copy
        with tempfile.TemporaryDirectory(prefix="tlt-export-") as tmp:
            run(_downloaded(args, tmp))
        return
    try:  # a wrong checkpoint, kind or target: one line, no traceback
        config = read_drafter_config(args.checkpoint)
        if args.kind is not None and args.kind != config.kind:
            raise ValueError(
                f"{args.checkpoint} is an {config.kind} drafter and --kind is {args.kind}: "
                f"a checkpoint is never converted; train an {args.kind} drafter "
                f"(`tlt-lightning drafter warmup --kind {args.kind}`)"
            )
        model = args.model or checkpoint_target(args.checkpoint, config)
        target = HFTarget(load_model(model, seed=args.seed).model)
        source = target.hf_config.name_or_path  # the directory transformers loaded (vLLM's verifier)
        verifier = str(Path(source).resolve()) if source and Path(source).is_dir() else source or None
        out = export_drafter(
            args.checkpoint, args.out, target, dtype=args.dtype, engine=args.engine, verifier=verifier
        )
    except (ValueError, OSError) as err:
        raise SystemExit(f"export-drafter: {err}") from err
    config = import_drafter(out, target).config  # proves the export loads back
    vocab = (
        f"{config.draft_vocab} of {config.vocab_size}" if config.reduced_vocab else f"all {config.vocab_size}"
    )
    print(
        f"[export-drafter] wrote a {config.kind} drafter ({vocab} tokens) for {model} to {out}, "
        f"for {args.engine}"
    )


def _export_fit(args: argparse.Namespace) -> None:
    """``export-drafter --from-fit``: the policy and its drafter, loaded back together to prove the pair."""
    from transformers import AutoModelForCausalLM

    from tlt_lightning.recipes.export_fit import export_fit

    if args.out is not None or args.checkpoint is None:
        raise SystemExit("export-drafter --from-fit RUN_DIR_OR_CKPT takes one positional argument, OUT")
    try:
        done = export_fit(
            args.from_fit,
            args.checkpoint,
            model=args.model,
            dtype=args.dtype,
            engine=args.engine,
            kind=args.kind,
        )
    except (ValueError, OSError) as err:
        raise SystemExit(f"export-drafter: {err}") from err
    policy = AutoModelForCausalLM.from_pretrained(done.policy_dir, local_files_only=True)
    import_drafter(
        done.drafter_dir, HFTarget(policy)
    )  # the pair loads back (EAGLE-3: its head is the policy's)
    print(
        f"[export-drafter] wrote the step-{done.step} policy of {done.checkpoint} to {done.policy_dir}"
        f"{' (with its tokenizer)' if done.tokenizer else ''} and its {done.kind} drafter "
        f"({done.drafter_source}) to {done.drafter_dir}, for {args.engine}; see {done.out / 'README.md'}"
    )


def _downloaded(args: argparse.Namespace, tmp: str) -> argparse.Namespace:
    """``args`` with its MLflow URI ``checkpoint`` downloaded into ``tmp``, and ``--model`` defaulting to the
    target recorded in the version's ``MLmodel`` (:mod:`tlt_lightning.tracking.mlflow_pyfunc`)."""
    try:
        local = download_drafter(args.checkpoint, tmp, tracking_uri=args.tracking_uri)
    except (ValueError, ModuleNotFoundError) as err:  # no mlflow, no such version / run: one line
        raise SystemExit(f"export-drafter: {err}") from err
    model = args.model
    if model is None and (local / "MLmodel").is_file():
        from mlflow.models import Model

        from tlt_lightning.tracking.mlflow_pyfunc import FLAVOR_NAME

        model = (Model.load(str(local / "MLmodel")).flavors.get(FLAVOR_NAME, {}).get("target") or {}).get(
            "model"
        )
    return argparse.Namespace(**{**vars(args), "checkpoint": str(local), "model": model})


def checkpoint_target(checkpoint: str | Path, config: DrafterConfig) -> str:
    """The target a drafter checkpoint was trained for: its ``warmup.json``'s model, else the one
    registry model of its target's shape.

    Args:
        checkpoint: the drafter checkpoint directory.
        config: its drafter config (:func:`~tlt_lightning.drafter.read_drafter_config`).

    Raises:
        ValueError: no recorded model and not exactly one registry model of that shape; the message
            asks for ``--model``.

    Example:
        >>> checkpoint_target("runs/drafter", read_drafter_config("runs/drafter"))  # doctest: +SKIP
        'smollm2-135m'
    """
    warmup = Path(checkpoint) / "warmup.json"
    if warmup.is_file():
        try:
            model = json.loads(warmup.read_text()).get("model")
        except json.JSONDecodeError:
            model = None
        if isinstance(model, str) and model:
            return model
    shape = (config.model_type, config.hidden_size, config.num_target_layers, config.vocab_size)
    names = models_with_signature(*shape)
    if len(names) != 1:
        found = f"registry models {names} match" if names else "no registry model matches"
        raise ValueError(
            f"cannot tell the target of {checkpoint}: its target is a {shape[0]} model with hidden size "
            f"{shape[1]}, {shape[2]} layers and {shape[3]} tokens, and {found}; pass --model NAME_OR_HF_DIR"
        )
    return names[0]
