"""DoRA adapters through peft, for the policy (an HF model) and for our drafter, merged on export.

DoRA (weight-decomposed low-rank adaptation) splits each adapted weight into a magnitude vector and
a direction, adapts the direction with a LoRA update and learns the magnitude on its own:
``W' = m * (W + s B A) / ||W + s B A||`` (row norms). peft implements it (``LoraConfig(use_dora=True)``);
this module only picks the target modules and wraps ``get_peft_model`` / ``merge_and_unload``.

The default targets are the decoder layer's linear modules by their Llama/Qwen2 names (``q_proj``,
``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``). The drafter's layer
uses the same names, so one config serves both; the drafter's ``fc`` stays frozen unless listed in
``trainable_modules``. peft is an optional dependency: ``pip install 'tlt-lightning[efficiency]'``.

Export: :func:`merge_dora` folds the adapters into plain weights (the original module class and
parameter names), so the merged policy or drafter is saved and served as if DoRA had never been
there (for the drafter: merge, then export it as usual).

On a :class:`~tlt_lightning.rl.GRPOModule`: build the policy, then wrap it before the fit
(``module.configure_model(); module.policy = apply_dora(module.policy)``). peft injects the adapters
into the policy's own modules, so the rollouts (whose adapter holds the same base model) sample from
the adapted policy; ``configure_optimizers`` hands the frozen base weights to AdamW too, which skips
them (they never get a gradient). Merge for export with ``module.policy = merge_dora(module.policy)``.
With a ``rollout_dtype`` mirror (a copy made in ``configure_model``, before the wrapping) wrap the
policy in an overridden :meth:`~tlt_lightning.rl.GRPOModule.configure_policy` instead, so the mirror
copies the wrapped model; that is also the way for ``GRPOModule.load_from_checkpoint``, which builds
the model from its arguments. On the drafter: ``apply_dora(drafter)`` trains with
:func:`~tlt_lightning.drafter.drafter_train_step` as the drafter itself does (peft forwards its
attributes), then ``merge_dora`` gives the :class:`~tlt_lightning.drafter.Drafter` back.

Example:
    >>> from tlt_lightning.models import load_model
    >>> model = apply_dora(load_model("tiny-llama").model, DoraConfig(rank=4))
    >>> merged = merge_dora(model)  # the LlamaForCausalLM again, adapters folded in
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from tlt_lightning.validation import MissingExtraError, check, is_int

__all__ = ["DEFAULT_TARGETS", "DoraConfig", "apply_dora", "merge_dora"]

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _peft() -> Any:
    try:
        import peft
    except ImportError as err:  # optional extra: say how to get it
        raise MissingExtraError(
            "DoRA needs peft: pip install 'tlt-lightning[efficiency]' (peft<=0.18.1, which torchtune's "
            "torchao pin allows)"
        ) from err
    return peft


@dataclass(frozen=True)
class DoraConfig:
    """DoRA adapter settings (peft ``LoraConfig`` with ``use_dora=True``).

    Args:
        rank: LoRA rank ``r`` (>= 1).
        alpha: LoRA scaling numerator (update scale ``alpha / rank``), > 0.
        dropout: dropout on the adapter input, in [0, 1).
        target_modules: module-name suffixes to adapt (peft matching: a name equal to or ending in
            ``.<suffix>``); must match at least one ``nn.Linear``.
        trainable_modules: modules trained in full next to the adapters (peft ``modules_to_save``),
            e.g. ``("fc",)`` for the drafter's fusion layer.

    Example:
        >>> DoraConfig(rank=8, alpha=16).target_modules[:2]
        ('q_proj', 'k_proj')
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    trainable_modules: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check(is_int(self.rank) and self.rank >= 1, "rank", self.rank, "an int >= 1")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or self.alpha <= 0:
            raise ValueError(f"alpha must be a positive number, got {self.alpha!r}")
        if (
            isinstance(self.dropout, bool)
            or not isinstance(self.dropout, (int, float))
            or not 0 <= self.dropout < 1
        ):
            raise ValueError(f"dropout must be a number in [0, 1), got {self.dropout!r}")
        for name in ("target_modules", "trainable_modules"):
            value = getattr(self, name)
            value = (value,) if isinstance(value, str) else tuple(value)
            if not all(isinstance(v, str) and v for v in value):
                raise ValueError(f"{name} must be non-empty module names, got {value!r}")
            object.__setattr__(self, name, value)
        if not self.target_modules:
            raise ValueError("target_modules must name at least one module, got ()")

    def to_peft(self) -> Any:
        """The equivalent ``peft.LoraConfig``."""
        return _peft().LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            use_dora=True,
            target_modules=list(self.target_modules),
            modules_to_save=list(self.trainable_modules) or None,
        )


def _matches(name: str, suffix: str) -> bool:
    return name == suffix or name.endswith("." + suffix)


def apply_dora(module: nn.Module, config: DoraConfig | None = None) -> nn.Module:
    """Wrap ``module`` in DoRA adapters (``peft.get_peft_model``): only adapters (and
    ``trainable_modules``) train, the base weights are frozen.

    Args:
        module: an HF model (the policy) or any ``nn.Module`` such as the drafter.
        config: adapter settings (default :class:`DoraConfig`).

    Returns:
        The ``peft.PeftModel``; it forwards calls and attribute reads to ``module``.

    Raises:
        ValueError: a target suffix matches no ``nn.Linear`` of ``module``.

    Example:
        >>> from tlt_lightning.models import HFTarget, load_model
        >>> from tlt_lightning.drafter import Drafter, DrafterConfig
        >>> target = HFTarget(load_model("tiny-llama").model)
        >>> drafter = apply_dora(Drafter(DrafterConfig.from_target(target), target))
        >>> merged = merge_dora(drafter)  # a Drafter again, ready to export
    """
    config = config or DoraConfig()
    if not isinstance(config, DoraConfig):
        raise TypeError(f"config must be a DoraConfig, got {type(config).__name__}")
    linears = [name for name, m in module.named_modules() if isinstance(m, nn.Linear)]
    missing = [t for t in config.target_modules if not any(_matches(n, t) for n in linears)]
    if missing:
        raise ValueError(
            f"target_modules {missing} match no nn.Linear of {type(module).__name__} "
            f"(its linear modules end in {sorted({n.rsplit('.', 1)[-1] for n in linears})})"
        )
    return _peft().get_peft_model(module, config.to_peft())


def merge_dora(model: nn.Module) -> nn.Module:
    """Fold the DoRA adapters into the base weights and return the plain base module (for export).

    Raises:
        TypeError: ``model`` is not a ``peft.PeftModel``.
    """
    peft = _peft()
    if not isinstance(model, peft.PeftModel):
        raise TypeError(f"model must be a peft.PeftModel (from apply_dora), got {type(model).__name__}")
    return model.merge_and_unload()
