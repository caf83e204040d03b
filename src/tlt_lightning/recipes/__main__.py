"""What ``tune run tlt_lightning.recipes.grpo_torchtune --config CFG`` runs (and
``python -m tlt_lightning.recipes``).

torchtune 0.6.1's ``tune run`` takes a recipe that is not one of its own for a file path: it drops the
last dotted part as if it were an extension (``os.path.splitext``) and runs the rest,
``tlt_lightning.recipes``, with ``runpy`` as ``__main__`` (with ``--nproc_per_node``: ``torchrun -m``).
This package has one torchtune recipe, :mod:`tlt_lightning.recipes.grpo_torchtune`; the command
line as typed (``sys.orig_argv``, which ``tune run`` leaves alone) says whether another was named.
"""

from __future__ import annotations

import sys

RECIPES = ("grpo_torchtune",)


def _named_recipe(argv: list[str]) -> str | None:
    """The recipe a ``tune run tlt_lightning.recipes.NAME`` command line names, else ``None``."""
    prefix = f"{__package__}."
    for arg in argv:
        if arg.startswith(prefix) and arg != f"{__package__}.__main__":
            return arg[len(prefix) :]
    return None


if __name__ == "__main__":
    name = _named_recipe(list(getattr(sys, "orig_argv", [])))
    if name not in (None, *RECIPES):
        raise SystemExit(
            f"{__package__}.{name} is not a torchtune recipe; the one here is "
            f"{__package__}.grpo_torchtune (the others run as `tlt-lightning` subcommands)"
        )
    from tlt_lightning.recipes.grpo_torchtune import recipe_main

    recipe_main()
