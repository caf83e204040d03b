"""Opt-in training-efficiency transforms, each a pure transform plus a thin Lightning callback.

* :mod:`.checkpoint`: budgeted activation checkpointing (profile, exact DP plan, apply);
* :mod:`.memory`: activation memory measured on any device (CPU included);
* :mod:`.precision`: embeddings and head in fp32, attention and MLP in bf16/fp16, per-group fp16
  loss scalers;
* :mod:`.dora`: DoRA adapters through peft for the policy and the drafter, merged on export
  (needs the ``efficiency`` extra);
* :mod:`.callbacks`: :class:`DynamicCheckpointingCallback`, :class:`LayerwisePrecisionCallback`.
"""

from tlt_lightning.efficiency.callbacks import DynamicCheckpointingCallback, LayerwisePrecisionCallback
from tlt_lightning.efficiency.checkpoint import (
    BlockCost,
    CheckpointHandle,
    CheckpointPlan,
    CheckpointProfile,
    DynamicCheckpointing,
    Gap,
    apply_checkpointing,
    find_blocks,
    is_checkpointed,
    plan_greedy,
    plan_optimal,
    plan_static,
    profile_blocks,
)
from tlt_lightning.efficiency.dora import DoraConfig, apply_dora, merge_dora
from tlt_lightning.efficiency.memory import ActivationMemoryMeter, MemoryReport, measure_step
from tlt_lightning.efficiency.precision import (
    GroupLossScaler,
    LayerwisePrecision,
    PrecisionConfig,
    PrecisionHandle,
)

__all__ = [
    "ActivationMemoryMeter",
    "BlockCost",
    "CheckpointHandle",
    "CheckpointPlan",
    "CheckpointProfile",
    "DoraConfig",
    "DynamicCheckpointing",
    "DynamicCheckpointingCallback",
    "Gap",
    "GroupLossScaler",
    "LayerwisePrecision",
    "LayerwisePrecisionCallback",
    "MemoryReport",
    "PrecisionConfig",
    "PrecisionHandle",
    "apply_checkpointing",
    "apply_dora",
    "find_blocks",
    "is_checkpointed",
    "measure_step",
    "merge_dora",
    "plan_greedy",
    "plan_optimal",
    "plan_static",
    "profile_blocks",
]
