"""Opt-in training-efficiency transforms, each a pure transform plus a thin Lightning callback.

* :mod:`.checkpoint`: budgeted activation checkpointing (profile, exact DP plan, apply);
* :mod:`.memory`: activation memory measured on any device (CPU included);
* :mod:`.precision`: embeddings and head in fp32, attention and MLP in bf16/fp16, per-group fp16
  loss scalers;
* :mod:`.dora`: DoRA adapters through peft for the policy and the drafter, merged on export
  (needs the ``efficiency`` extra);
* :mod:`.sampler`: importance sampling of batches (proxy loss or RHO-LOSS, softmax without
  replacement), a ``batch_sampler`` for any DataLoader;
* :mod:`.distill`: hierarchical distillation (mapped hidden states + ``T^2``-scaled KD on logits);
* :mod:`.qat`: INT4 quantization-aware training through torchao (needs ``torchao``);
* :mod:`.callbacks`: :class:`ActivationCheckpointingCallback`, :class:`LayerwisePrecisionCallback`;
* :mod:`.training`: :class:`ImportanceSamplingCallback`, :class:`DistillationModule`, :class:`QATCallback`;
* :mod:`.grpo`: the profiling batch and forward :class:`ActivationCheckpointingCallback` needs on a
  :class:`~tlt_lightning.rl.GRPOModule` (no ``forward``); the other helpers apply to its ``policy`` as is.
"""

from tlt_lightning.efficiency.activation_checkpointing import (
    ActivationCheckpointHandle,
    ActivationCheckpointPlan,
    ActivationCheckpointProfile,
    BlockCost,
    DynamicActivationCheckpointing,
    Gap,
    apply_activation_checkpointing,
    find_blocks,
    is_activation_checkpointed,
    plan_greedy,
    plan_optimal,
    plan_static,
    profile_blocks,
)
from tlt_lightning.efficiency.callbacks import ActivationCheckpointingCallback, LayerwisePrecisionCallback
from tlt_lightning.efficiency.distill import (
    DistillConfig,
    DistillLoss,
    HierarchicalDistillation,
    distill_step,
    hidden_state_loss,
    kd_kl_loss,
    proportional_layer_map,
)
from tlt_lightning.efficiency.dora import DoraConfig, apply_dora, merge_dora
from tlt_lightning.efficiency.grpo import grpo_policy_loss, grpo_profile_batch
from tlt_lightning.efficiency.memory import ActivationMemoryMeter, MemoryReport, measure_step
from tlt_lightning.efficiency.precision import (
    GroupLossScaler,
    LayerwisePrecision,
    PrecisionConfig,
    PrecisionHandle,
)
from tlt_lightning.efficiency.qat import (
    Int4QATConfig,
    convert_qat,
    fake_quantized_modules,
    prepare_qat,
    quantize_ptq,
    quantized_modules,
)
from tlt_lightning.efficiency.sampler import (
    ImportanceSampler,
    ImportanceSamplerConfig,
    LossScorer,
    RhoLossScorer,
    Scorer,
    SelectionStats,
    per_example_loss,
    sample_without_replacement,
    selection_probabilities,
)
from tlt_lightning.efficiency.training import DistillationModule, ImportanceSamplingCallback, QATCallback

__all__ = [
    "ActivationCheckpointHandle",
    "ActivationCheckpointPlan",
    "ActivationCheckpointProfile",
    "ActivationCheckpointingCallback",
    "ActivationMemoryMeter",
    "BlockCost",
    "DistillConfig",
    "DistillLoss",
    "DistillationModule",
    "DoraConfig",
    "DynamicActivationCheckpointing",
    "Gap",
    "GroupLossScaler",
    "HierarchicalDistillation",
    "ImportanceSampler",
    "ImportanceSamplerConfig",
    "ImportanceSamplingCallback",
    "Int4QATConfig",
    "LayerwisePrecision",
    "LayerwisePrecisionCallback",
    "LossScorer",
    "MemoryReport",
    "PrecisionConfig",
    "PrecisionHandle",
    "QATCallback",
    "RhoLossScorer",
    "Scorer",
    "SelectionStats",
    "apply_activation_checkpointing",
    "apply_dora",
    "convert_qat",
    "distill_step",
    "fake_quantized_modules",
    "find_blocks",
    "grpo_policy_loss",
    "grpo_profile_batch",
    "hidden_state_loss",
    "is_activation_checkpointed",
    "kd_kl_loss",
    "measure_step",
    "merge_dora",
    "per_example_loss",
    "plan_greedy",
    "plan_optimal",
    "plan_static",
    "prepare_qat",
    "profile_blocks",
    "proportional_layer_map",
    "quantize_ptq",
    "quantized_modules",
    "sample_without_replacement",
    "selection_probabilities",
]
