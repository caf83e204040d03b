"""Hierarchical knowledge distillation: match intermediate hidden states, then the soft labels.

Logits-only KD trains the student on the teacher's temperature-softened output distribution,
``T^2 KL(softmax(z_t / T) || softmax(z_s / T))`` (the ``T^2`` keeps gradient sizes independent of
``T``). Hierarchical distillation adds a loss between hidden states at mapped depths (by default
the student's layers ``N/4, N/2, N`` against the teacher's ``M/4, M/2, M``), through a learned
linear projection wherever the widths differ.

Layer numbers index HF ``output_hidden_states``: ``0`` is the embedding output, ``i`` the output of
decoder layer ``i`` (for HF Llama/Qwen2 the last one is after the final norm). The projections are
parameters of :class:`HierarchicalDistillation`: give them to the optimizer with the student's.

Example:
    >>> distill = HierarchicalDistillation.from_models(student, teacher, DistillConfig())  # doctest: +SKIP
    >>> out = distill_step(student, teacher, distill, batch)  # doctest: +SKIP
    >>> out.total.backward()  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from tlt_lightning.validation import check, is_int, is_number

__all__ = [
    "DistillConfig",
    "DistillLoss",
    "HierarchicalDistillation",
    "distill_step",
    "hidden_state_loss",
    "kd_kl_loss",
    "proportional_layer_map",
]

HiddenLoss = Literal["mse", "cosine"]


def _masked_mean(values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean of ``[B, T]`` values over positions where ``mask`` is true (all when ``None``)."""
    if mask is None:
        return values.mean()
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1)


def kd_kl_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Temperature-scaled KD loss ``T^2 KL(p_teacher || p_student)``, averaged over positions.

    Args:
        student_logits: ``[B, T, V]``.
        teacher_logits: ``[B, T, V]`` (no gradient flows into it).
        temperature: softmax temperature ``T`` > 0 of both distributions.
        mask: ``[B, T]`` positions to average over (e.g. the attention mask); ``None``: all.

    Returns:
        Scalar float32 loss.

    Example:
        >>> z = torch.tensor([[[1.0, 2.0, 3.0]]])
        >>> float(kd_kl_loss(z, z, temperature=2.0))
        0.0
    """
    if not is_number(temperature) or temperature <= 0:
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student and teacher logits must have the same shape [B, T, V] (same vocabulary), got "
            f"{tuple(student_logits.shape)} and {tuple(teacher_logits.shape)}"
        )
    log_q = torch.log_softmax(student_logits.float() / temperature, dim=-1)
    log_p = torch.log_softmax(teacher_logits.detach().float() / temperature, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # [B, T]
    return temperature**2 * _masked_mean(kl, mask)


def hidden_state_loss(
    student: torch.Tensor,
    teacher: torch.Tensor,
    kind: HiddenLoss = "mse",
    mask: torch.Tensor | None = None,
    normalize: bool = False,
) -> torch.Tensor:
    """Distance between (projected) student and teacher hidden states, averaged over positions.

    Args:
        student: ``[B, T, H]`` student hidden states, already projected to the teacher's width.
        teacher: ``[B, T, H]`` (no gradient flows into it).
        kind: ``"mse"`` (mean over features of the squared difference) or ``"cosine"``
            (``1 - cos(student, teacher)`` per position).
        mask: ``[B, T]`` positions to average over; ``None``: all.
        normalize: standardize both vectors over features first (``layer_norm`` without weights),
            so the loss does not scale with the residual stream (whose RMS grows with depth).

    Returns:
        Scalar float32 loss.

    Example:
        >>> s, t = torch.tensor([[[1.0, 3.0]]]), torch.tensor([[[0.0, 8.0]]])
        >>> round(float(hidden_state_loss(s, t)), 4), round(float(hidden_state_loss(s, t, normalize=True)), 4)
        (13.0, 0.0)
    """
    if student.shape != teacher.shape:
        raise ValueError(
            "student and teacher hidden states must match, got "
            f"{tuple(student.shape)} and {tuple(teacher.shape)}"
        )
    s, t = student.float(), teacher.detach().float()
    if normalize:
        s, t = F.layer_norm(s, s.shape[-1:]), F.layer_norm(t, t.shape[-1:])
    if kind == "mse":
        per_position = (s - t).pow(2).mean(-1)
    elif kind == "cosine":
        per_position = 1 - F.cosine_similarity(s, t, dim=-1, eps=1e-8)
    else:
        raise ValueError(f"kind must be 'mse' or 'cosine', got {kind!r}")
    return _masked_mean(per_position, mask)


def proportional_layer_map(
    student_layers: int, teacher_layers: int, fractions: Sequence[float] = (0.25, 0.5, 1.0)
) -> dict[int, int]:
    """Student layer ``round(f N)`` -> teacher layer ``round(f M)`` for each fraction ``f`` (at least 1).

    When two fractions round to the same student layer (shallow students), the later (deeper) pair wins.

    Example:
        >>> proportional_layer_map(4, 8)
        {1: 2, 2: 4, 4: 8}
    """
    out: dict[int, int] = {}
    for f in fractions:
        if not is_number(f) or not 0 < f <= 1:
            raise ValueError(f"fractions must be numbers in (0, 1], got {f!r}")
        out[max(1, round(f * student_layers))] = max(1, round(f * teacher_layers))
    return out


@dataclass(frozen=True)
class DistillConfig:
    """Which layers to match, with what loss, and the KD temperature and weights.

    Args:
        layer_map: student layer -> teacher layer (hidden-state indices: 0 embeddings, ``i`` the
            output of layer ``i``); ``None``: :func:`proportional_layer_map` with ``fractions``;
            ``{}``: no hidden-state loss (logits-only KD).
        fractions: depths of the default map (``N/4, N/2, N``).
        hidden_loss: ``"mse"`` or ``"cosine"``.
        normalize_hidden: standardize hidden states over features before the loss (see
            :func:`hidden_state_loss`). On by default: a trained model's intermediate residual
            stream has an RMS of 5-7 where its logits' KL is ~0.1-1, so a raw MSE swamps the KD term.
        hidden_weight: weight of the mean hidden-state loss over mapped layers (>= 0).
        kl_weight: weight of the KD loss on logits (>= 0).
        temperature: KD temperature ``T`` > 0 (the loss is scaled by ``T^2``).

    Example:
        >>> DistillConfig.logits_only(temperature=2.0).layer_map
        {}
    """

    layer_map: Mapping[int, int] | None = None
    fractions: tuple[float, ...] = (0.25, 0.5, 1.0)
    hidden_loss: HiddenLoss = "mse"
    normalize_hidden: bool = True
    hidden_weight: float = 1.0
    kl_weight: float = 1.0
    temperature: float = 2.0

    def __post_init__(self) -> None:
        if self.layer_map is not None:
            if not isinstance(self.layer_map, Mapping):
                raise ValueError(
                    "layer_map must be a mapping student layer -> teacher layer or None, "
                    f"got {self.layer_map!r}"
                )
            for s, t in self.layer_map.items():
                if any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in (s, t)):
                    raise ValueError(f"layer_map entries must be ints >= 0, got {s!r}: {t!r}")
            object.__setattr__(self, "layer_map", dict(self.layer_map))
        object.__setattr__(self, "fractions", tuple(self.fractions))
        proportional_layer_map(1, 1, self.fractions)  # validates the fractions
        check(self.hidden_loss in ("mse", "cosine"), "hidden_loss", self.hidden_loss, "'mse' or 'cosine'")
        if not isinstance(self.normalize_hidden, bool):
            raise TypeError(f"normalize_hidden must be a bool, got {self.normalize_hidden!r}")
        for name in ("hidden_weight", "kl_weight"):
            value = getattr(self, name)
            if not is_number(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if not is_number(self.temperature) or self.temperature <= 0:
            raise ValueError(f"temperature must be a finite number > 0, got {self.temperature!r}")

    @classmethod
    def logits_only(cls, temperature: float = 2.0, kl_weight: float = 1.0) -> DistillConfig:
        """Plain KD on the output distribution: the baseline of hierarchical distillation."""
        return cls(layer_map={}, temperature=temperature, kl_weight=kl_weight)


class DistillLoss(NamedTuple):
    """One distillation loss and its parts (scalars; ``per_layer`` is ``[M]``, one per mapped pair).

    Attributes:
        total: ``kl_weight * kl + hidden_weight * hidden (+ ce_weight * ce in distill_step)``.
        kl: the ``T^2``-scaled KD loss on logits.
        hidden: mean of ``per_layer`` (0 without mapped layers).
        per_layer: hidden-state loss of each mapped pair, in ``layer_map`` order.
        ce: cross-entropy on labels (only from :func:`distill_step`; else 0).
    """

    total: torch.Tensor
    kl: torch.Tensor
    hidden: torch.Tensor
    per_layer: torch.Tensor
    ce: torch.Tensor


class HierarchicalDistillation(nn.Module):
    """The distillation loss with its learned projections (student width -> teacher width).

    Args:
        config: layer map, losses, temperature, weights.
        student_layers: decoder layers of the student (hidden states ``0 .. student_layers``).
        teacher_layers: decoder layers of the teacher.
        student_width: student hidden size.
        teacher_width: teacher hidden size; a mapped pair gets ``nn.Linear(student_width,
            teacher_width, bias=False)`` when they differ, ``nn.Identity`` otherwise.

    Raises:
        ValueError: a ``layer_map`` entry points to a layer the student or teacher does not have.

    Example:
        >>> d = HierarchicalDistillation(DistillConfig(), student_layers=4, teacher_layers=8,
        ...                              student_width=64, teacher_width=128)
        >>> d.layer_map, type(d.projections[0]).__name__
        (((1, 2), (2, 4), (4, 8)), 'Linear')
    """

    def __init__(
        self,
        config: DistillConfig,
        student_layers: int,
        teacher_layers: int,
        student_width: int,
        teacher_width: int,
    ) -> None:
        super().__init__()
        if not isinstance(config, DistillConfig):
            raise TypeError(f"config must be a DistillConfig, got {type(config).__name__}")
        for name, value in (
            ("student_layers", student_layers),
            ("teacher_layers", teacher_layers),
            ("student_width", student_width),
            ("teacher_width", teacher_width),
        ):
            check(is_int(value) and value >= 1, name, value, "an int >= 1")
        self.config = config
        self.student_layers, self.teacher_layers = student_layers, teacher_layers
        mapping = config.layer_map
        if mapping is None:
            mapping = proportional_layer_map(student_layers, teacher_layers, config.fractions)
        for s, t in mapping.items():
            if s > student_layers:
                raise ValueError(
                    f"layer_map entry {s}: {t} points to student layer {s}, which does not exist "
                    f"(the student has hidden states 0..{student_layers}: 0 embeddings, "
                    "i the output of layer i)"
                )
            if t > teacher_layers:
                raise ValueError(
                    f"layer_map entry {s}: {t} points to teacher layer {t}, which does not exist "
                    f"(the teacher has hidden states 0..{teacher_layers}: 0 embeddings, "
                    "i the output of layer i)"
                )
        self.layer_map: tuple[tuple[int, int], ...] = tuple(mapping.items())
        self.projections = nn.ModuleList(
            nn.Identity()
            if student_width == teacher_width
            else nn.Linear(student_width, teacher_width, bias=False)
            for _ in self.layer_map
        )

    @classmethod
    def from_models(
        cls, student: nn.Module, teacher: nn.Module, config: DistillConfig | None = None
    ) -> HierarchicalDistillation:
        """Read layers and widths from two HF models' ``config`` (``num_hidden_layers``, ``hidden_size``)."""
        s, t = student.config, teacher.config
        return cls(
            config or DistillConfig(), s.num_hidden_layers, t.num_hidden_layers, s.hidden_size, t.hidden_size
        )

    @property
    def needs_hidden_states(self) -> bool:
        """Whether :meth:`forward` reads hidden states (call the models with ``output_hidden_states``)."""
        return bool(self.layer_map) and self.config.hidden_weight > 0

    def forward(
        self,
        student_logits: torch.Tensor,
        teacher_logits: torch.Tensor,
        student_hidden: Sequence[torch.Tensor] = (),
        teacher_hidden: Sequence[torch.Tensor] = (),
        mask: torch.Tensor | None = None,
    ) -> DistillLoss:
        """The loss of one batch.

        Args:
            student_logits, teacher_logits: ``[B, T, V]``.
            student_hidden: ``student_layers + 1`` tensors ``[B, T, Hs]`` (HF ``hidden_states``);
                may be empty when :attr:`needs_hidden_states` is false.
            teacher_hidden: ``teacher_layers + 1`` tensors ``[B, T, Ht]``.
            mask: ``[B, T]`` positions to distill (e.g. the attention mask); ``None``: all.

        Returns:
            :class:`DistillLoss` (``ce`` is 0 here).
        """
        c = self.config
        kl = kd_kl_loss(student_logits, teacher_logits, c.temperature, mask)
        zero = kl.new_zeros(())
        per_layer = kl.new_zeros(len(self.layer_map))
        if self.needs_hidden_states:
            for name, states, layers in (
                ("student_hidden", student_hidden, self.student_layers),
                ("teacher_hidden", teacher_hidden, self.teacher_layers),
            ):
                if len(states) != layers + 1:
                    raise ValueError(
                        f"{name} must hold {layers + 1} hidden states (embeddings + {layers} layers), "
                        f"got {len(states)}"
                    )
            per_layer = torch.stack(
                [
                    hidden_state_loss(
                        proj(student_hidden[s]), teacher_hidden[t], c.hidden_loss, mask, c.normalize_hidden
                    )
                    for (s, t), proj in zip(self.layer_map, self.projections)
                ]
            )
        hidden = per_layer.mean() if len(self.layer_map) else zero
        total = c.kl_weight * kl + c.hidden_weight * hidden
        return DistillLoss(total, kl, hidden, per_layer, zero)


def _forward(model: nn.Module, batch: Mapping[str, torch.Tensor], hidden: bool) -> Any:
    return model(
        input_ids=batch["input_ids"],
        attention_mask=batch.get("attention_mask"),
        output_hidden_states=hidden,
        use_cache=False,
    )


def distill_step(
    student: nn.Module,
    teacher: nn.Module,
    distill: HierarchicalDistillation,
    batch: Mapping[str, torch.Tensor],
    ce_weight: float = 0.0,
) -> DistillLoss:
    """Teacher forward (no gradient), student forward, distillation loss (+ ``ce_weight`` x label CE).

    Args:
        student, teacher: HF causal LMs with the same vocabulary.
        distill: the loss and its projections.
        batch: ``input_ids`` ``[B, T]``, optional ``attention_mask`` ``[B, T]`` (also the
            distillation mask), and ``labels`` ``[B, T]`` (``-100`` ignored) when ``ce_weight > 0``.
        ce_weight: weight of the hard-label cross-entropy (>= 0).

    Returns:
        :class:`DistillLoss`; ``total`` includes the weighted CE.
    """
    if not is_number(ce_weight) or ce_weight < 0:
        raise ValueError(f"ce_weight must be a finite number >= 0, got {ce_weight!r}")
    hidden = distill.needs_hidden_states
    with torch.no_grad():
        t = _forward(teacher, batch, hidden)
    s = _forward(student, batch, hidden)
    mask = batch.get("attention_mask")
    loss = distill(s.logits, t.logits, s.hidden_states or (), t.hidden_states or (), mask)
    if ce_weight == 0:
        return loss
    from tlt_lightning.efficiency.sampler import per_example_loss

    labels = batch["labels"]
    counts = (labels[:, 1:] != -100).sum(-1)
    ce = (per_example_loss(s.logits, labels) * counts).sum() / counts.sum().clamp(min=1)  # token mean
    return loss._replace(total=loss.total + ce_weight * ce, ce=ce)
