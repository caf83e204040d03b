"""GRPO + TLT as a torchtune recipe, with torchtune's own config overrides.

    python examples/torchtune_grpo.py                               # SmolLM2-135M, 4 RL steps
    python examples/torchtune_grpo.py module.optim.lr=3e-5 trainer.max_steps=16   # any key=value override
    python examples/torchtune_grpo.py --tiny                        # a tiny random Llama (seconds)

The same as ``tlt-lightning torchtune --config configs/grpo_torchtune_smollm2.yaml key=value ...`` and as
``tune run tlt_lightning.recipes.grpo_torchtune --config ...``: torchtune's ``model:`` builder makes the
policy (a ``TransformerDecoder``), its checkpointer loads the weights, and the rollouts, speculative
decoding and the drafter run on it. Overrides are torchtune's: ``a.b=value`` sets a field,
``node=dotted.path`` swaps a component, ``~a.b`` deletes a field, ``node=null`` disables an optional node.
Needs the ``torchtune`` extra (``pip install 'tlt-lightning[torchtune]'``); run from a checkout (it reads
``configs/``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tlt_lightning.cli import main as tlt_lightning

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="configs/grpo_torchtune.yaml: tiny random Llama")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="torchtune config overrides")
    args = parser.parse_args(argv)
    config = CONFIGS / ("grpo_torchtune.yaml" if args.tiny else "grpo_torchtune_smollm2.yaml")
    # Defaults of this example first: the user's overrides come later and win.
    defaults = ["threads=1", "trainer.max_steps=2" if args.tiny else "trainer.max_steps=4"]
    return tlt_lightning(["torchtune", "--config", str(config), *defaults, *args.overrides])


if __name__ == "__main__":
    raise SystemExit(main())
