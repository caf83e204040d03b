"""Export a drafter checkpoint in the EAGLE format vLLM (or SGLang) loads as it is, and load it back.

    python examples/export_drafter.py                  # the drafter shipped in examples/drafters/
    python examples/export_drafter.py --tiny           # a random drafter of a tiny random Llama (seconds)
    python examples/export_drafter.py runs/examples/spot/version_0/drafter/checkpoints/step-00000008
                                                       # one spot-trained by examples/spot_drafter_grpo.py

The same as ``tlt-lightning export-drafter CHECKPOINT OUT [--model M] [--engine vllm|sglang]``; a fit's
policy and its drafter together: ``tlt-lightning export-drafter --from-fit RUN_DIR OUT`` (docs/deployment.md).
A checkpoint is what ``save_drafter`` writes (``model.safetensors`` + ``config.json``): the
``SpotDrafterCallback``'s ``drafter/checkpoints/step-*``, ``tlt-lightning drafter warmup``'s output, or an
MLflow ``models:/`` URI through the command. The export is a directory (``config.json``,
``model.safetensors``, a model card) that vLLM loads as its speculator beside the target (printed at the end).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from tlt_lightning.drafter import Drafter, DrafterConfig, export_drafter, import_drafter, save_drafter
from tlt_lightning.models import HFTarget, load_model

SHIPPED = Path(__file__).resolve().parent / "drafters" / "smollm2-countdown"


def tiny_checkpoint(target: HFTarget, directory: Path) -> Path:
    """A random EAGLE-1 drafter for ``target``, saved as a checkpoint (what training would leave)."""
    torch.manual_seed(0)
    return save_drafter(Drafter(DrafterConfig.from_target(target, "eagle1"), target), directory)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", nargs="?", default=None, help="drafter checkpoint directory")
    parser.add_argument("--out", default="runs/examples/eagle", help="export directory")
    parser.add_argument("--model", default="smollm2-135m", help="the target: registry name or HF directory")
    parser.add_argument("--engine", default="vllm", choices=["vllm", "sglang"])
    parser.add_argument("--tiny", action="store_true", help="a random drafter of tiny-llama (seconds)")
    args = parser.parse_args(argv)

    model = "tiny-llama" if args.tiny else args.model
    target = HFTarget(load_model(model).model)  # the exact model the drafter will be served with
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = args.checkpoint or SHIPPED
        if args.tiny:
            checkpoint = tiny_checkpoint(target, Path(tmp) / "drafter")
        out = export_drafter(checkpoint, args.out, target, engine=args.engine)
    drafter = import_drafter(out, target)  # loads back with identical logits
    config = json.loads((out / "config.json").read_text())
    print(f"exported an {drafter.config.kind} drafter for {model} to {out}: {config['architectures']}")
    method = "eagle3" if drafter.config.kind == "eagle3" else "eagle"
    print(
        "serve it in vLLM beside the target (a transformers directory of the same model):\n"
        f"  LLM(model=TARGET_DIR, speculative_config={{'method': '{method}', 'model': '{out}', "
        "'num_speculative_tokens': 3})"
    )
    return out


if __name__ == "__main__":
    main()
