"""The drafter's configuration: one frozen, validated dataclass, built from a target or from JSON."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from tlt_lightning.models.target import TargetModel, default_feature_layers
from tlt_lightning.validation import check, positive_int

__all__ = ["DRAFTER_KINDS", "SUPPORTED_MODEL_TYPES", "DrafterConfig"]

DRAFTER_KINDS = ("eagle1", "eagle3")
"""The designs :attr:`DrafterConfig.kind` accepts: EAGLE-1 (the target's final state) or EAGLE-3."""
# Target architectures whose decoder layer (and rotary embedding) the drafter reproduces.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
_HIDDEN_ACTS = ("silu", "gelu", "gelu_pytorch_tanh", "relu")


@dataclass(frozen=True)
class DrafterConfig:
    """Shape and wiring of an EAGLE-style drafter (one Llama-architecture decoder layer).

    Args:
        kind: ``"eagle1"`` (input: the target's final state, predicts the next one) or ``"eagle3"``
            (input: a low, a middle and a high layer of the target, fused by ``fc``).
        model_type: the target's transformers ``model_type`` (``"llama"`` or ``"qwen2"``); chooses
            the rotary embedding class.
        hidden_size: ``H``, the target's hidden size (features and embeddings are ``H`` wide).
        num_attention_heads: query heads of the drafter layer.
        num_key_value_heads: key/value heads (divides ``num_attention_heads``).
        head_dim: size of one head.
        intermediate_size: MLP width.
        rms_norm_eps: RMSNorm epsilon.
        rope_parameters: transformers ``rope_parameters`` (``rope_type``, ``rope_theta``, ...).
        max_position_embeddings: the target's context length (some rope types need it).
        attention_bias: whether q/k/v projections have a bias (Qwen2: yes).
        o_proj_bias: whether the output projection has a bias (Llama with ``attention_bias``).
        hidden_act: MLP activation.
        vocab_size: ``V``, the target's vocabulary.
        draft_vocab_size: ``V_draft`` tokens the drafter proposes, ``None`` = the full vocabulary.
        num_target_layers: ``L``, decoder layers of the target.
        feature_layers: target hidden-state indices the drafter reads (``0`` = embeddings, ``L`` =
            final normalised state); ``None`` = :func:`~tlt_lightning.models.default_feature_layers`.

    Example:
        >>> from tlt_lightning.models import HFTarget, load_model
        >>> target = HFTarget(load_model("tiny-llama").model)
        >>> DrafterConfig.from_target(target, kind="eagle3").feature_layers
        (1, 2, 3)
    """

    kind: str
    model_type: str
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_target_layers: int
    rms_norm_eps: float = 1e-6
    rope_parameters: dict[str, Any] = field(
        default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0}, hash=False
    )
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    o_proj_bias: bool = False
    hidden_act: str = "silu"
    draft_vocab_size: int | None = None
    feature_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        check(self.kind in DRAFTER_KINDS, "kind", self.kind, f"one of {DRAFTER_KINDS}")
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {self.model_type!r} is not supported by the drafter; "
                f"supported: {SUPPORTED_MODEL_TYPES}"
            )
        for name in (
            "hidden_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "num_target_layers",
            "max_position_embeddings",
        ):
            positive_int(name, getattr(self, name))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads must divide num_attention_heads ({self.num_attention_heads}), "
                f"got {self.num_key_value_heads}"
            )
        if not (isinstance(self.rms_norm_eps, (int, float)) and 0 < self.rms_norm_eps < 1):
            raise ValueError(f"rms_norm_eps must be a float in (0, 1), got {self.rms_norm_eps!r}")
        check(self.hidden_act in _HIDDEN_ACTS, "hidden_act", self.hidden_act, f"one of {_HIDDEN_ACTS}")
        rope = dict(self.rope_parameters or {})
        theta = rope.get("rope_theta")
        if not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 0:
            raise ValueError(f"rope_parameters['rope_theta'] must be a positive number, got {theta!r}")
        rope.setdefault("rope_type", "default")
        object.__setattr__(self, "rope_parameters", rope)
        object.__setattr__(self, "attention_bias", bool(self.attention_bias))
        object.__setattr__(self, "o_proj_bias", bool(self.o_proj_bias))
        if self.draft_vocab_size is not None:
            positive_int("draft_vocab_size", self.draft_vocab_size)
            if self.draft_vocab_size > self.vocab_size:
                raise ValueError(
                    f"draft_vocab_size must be <= vocab_size ({self.vocab_size}) or None, "
                    f"got {self.draft_vocab_size}"
                )
            if self.draft_vocab_size == self.vocab_size:  # one canonical form for "full vocabulary"
                object.__setattr__(self, "draft_vocab_size", None)
        L = self.num_target_layers
        layers = self.feature_layers
        layers = default_feature_layers(L, self.kind) if layers is None else tuple(int(i) for i in layers)
        object.__setattr__(self, "feature_layers", layers)
        expected = 1 if self.kind == "eagle1" else 3
        if len(layers) != expected:
            raise ValueError(
                f"feature_layers must have {expected} entries for kind {self.kind!r}, got {layers}"
            )
        if any(not 0 <= i <= L for i in layers):
            raise ValueError(f"feature_layers must lie in [0, num_target_layers={L}], got {layers}")
        if self.kind == "eagle1" and layers != (L,):
            # EAGLE-1 predicts the next final state and reads it out through the LM head unnormalised.
            raise ValueError(
                f"feature_layers must be ({L},) (the final state) for kind 'eagle1', got {layers}"
            )

    # ----------------------------------------------------------------------------------- derived
    @property
    def num_features(self) -> int:
        """``C``: target features the drafter reads per position."""
        return len(self.feature_layers)

    @property
    def draft_vocab(self) -> int:
        """``V_draft``: size of the drafter's output vocabulary."""
        return self.vocab_size if self.draft_vocab_size is None else self.draft_vocab_size

    @property
    def reduced_vocab(self) -> bool:
        return self.draft_vocab_size is not None

    @property
    def rollout_feature_layers(self) -> tuple[int, ...]:
        """What ``RolloutConfig.feature_layers`` must request for training data.

        The drafter's inputs followed by the final state ``L`` (the target's next-token
        distribution is ``lm_head(final)``); for eagle1 the input already is the final state.
        """
        if self.kind == "eagle1":
            return self.feature_layers
        return (*self.feature_layers, self.num_target_layers)

    # ------------------------------------------------------------------------------ construction
    @classmethod
    def from_target(
        cls, target: TargetModel, kind: str = "eagle1", draft_vocab_size: int | None = None
    ) -> DrafterConfig:
        """Size a drafter like ``target`` (its hidden size, heads, MLP, rope and vocabulary).

        Raises:
            ValueError: the target's ``model_type`` is not one of :data:`SUPPORTED_MODEL_TYPES`.
        """
        info, hf = target.info, target.hf_config
        if info.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"target model_type {info.model_type!r} is not supported by the drafter; "
                f"supported: {SUPPORTED_MODEL_TYPES}"
            )
        rope = getattr(hf, "rope_parameters", None) or {
            "rope_type": "default",
            "rope_theta": getattr(hf, "rope_theta", 10000.0),
        }
        if info.model_type == "qwen2":  # Qwen2: q/k/v biased, o_proj not
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = bool(getattr(hf, "attention_bias", False))
        return cls(
            kind=kind,
            model_type=info.model_type,
            hidden_size=info.hidden_size,
            num_attention_heads=hf.num_attention_heads,
            num_key_value_heads=info.num_kv_heads,
            head_dim=info.head_dim,
            intermediate_size=hf.intermediate_size,
            vocab_size=info.vocab_size,
            num_target_layers=info.num_layers,
            rms_norm_eps=float(hf.rms_norm_eps),
            rope_parameters=dict(rope),
            max_position_embeddings=info.max_positions,
            attention_bias=qkv_bias,
            o_proj_bias=o_bias,
            hidden_act=getattr(hf, "hidden_act", "silu"),
            draft_vocab_size=draft_vocab_size,
        )

    def check_target(self, target: TargetModel) -> None:
        """Raise ``ValueError`` naming the first field where this config and ``target`` disagree."""
        info = target.info
        for name, mine, theirs in (
            ("model_type", self.model_type, info.model_type),
            ("hidden_size", self.hidden_size, info.hidden_size),
            ("vocab_size", self.vocab_size, info.vocab_size),
            ("num_target_layers", self.num_target_layers, info.num_layers),
        ):
            if mine != theirs:
                raise ValueError(
                    f"drafter config does not match the target: {name} is {mine!r}, target has {theirs!r}"
                )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (tuples become lists)."""
        out = dataclasses.asdict(self)
        out["feature_layers"] = list(self.feature_layers)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DrafterConfig:
        """Inverse of :meth:`to_dict`; unknown or missing fields raise ``ValueError``."""
        if not isinstance(data, dict):
            # A malformed checkpoint file, not a programming error: loaders promise ValueError.
            raise ValueError(f"drafter config must be a JSON object, got {type(data).__name__}")  # noqa: TRY004
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown drafter config fields {unknown}; allowed: {sorted(names)}")
        try:
            return cls(**data)
        except TypeError as err:  # a required field is missing
            raise ValueError(f"invalid drafter config: {err}") from err
