"""Opt-in training-efficiency transforms, each a pure transform plus a thin Lightning callback.

* :mod:`.checkpoint`: budgeted activation checkpointing (profile, exact DP plan, apply);
* :mod:`.memory`: activation memory measured on any device (CPU included);
* :mod:`.host_memory`: glibc's mmap threshold and ``malloc_trim``: a CPU fit's resident memory near
  what its tensors need;
* :mod:`.checkpoint_io`: :class:`StreamingCheckpointIO`, checkpoints written without a copy in memory;
* :mod:`.precision`: embeddings and head in fp32, attention and MLP in bf16/fp16, per-group fp16
  loss scalers;
* :mod:`.dora`: DoRA adapters through peft for the policy and the drafter, merged on export
  (needs the ``efficiency`` extra);
* :mod:`.sampler`: importance sampling of batches (proxy loss or RHO-LOSS, softmax without
  replacement), a ``batch_sampler`` for any DataLoader;
* :mod:`.distill`: hierarchical distillation (mapped hidden states + ``T^2``-scaled KD on logits);
* :mod:`.qat`: INT4 quantization-aware training through torchao (needs ``torchao``);
* :mod:`.callbacks`: :class:`ActivationCheckpointingCallback`, :class:`LayerwisePrecisionCallback`,
  :class:`HostMemoryCallback`;
* :mod:`.training`: :class:`ImportanceSamplingCallback`, :class:`DistillationModule`, :class:`QATCallback`;
* :mod:`.grpo`: the profiling batch and forward :class:`ActivationCheckpointingCallback` needs on a
  :class:`~tlt_lightning.rl.GRPOModule` (no ``forward``); the other helpers apply to its ``policy`` as is.
"""

from tlt_lightning.efficiency.activation_checkpointing import (
    ActivationCheckpointPlan,
    ActivationCheckpointProfile,
    DynamicActivationCheckpointing,
    apply_activation_checkpointing,
    find_blocks,
    profile_blocks,
)
from tlt_lightning.efficiency.callbacks import (
    ActivationCheckpointingCallback,
    HostMemoryCallback,
    LayerwisePrecisionCallback,
)
from tlt_lightning.efficiency.checkpoint_io import StreamingCheckpointIO
from tlt_lightning.efficiency.distill import DistillConfig, HierarchicalDistillation, distill_step
from tlt_lightning.efficiency.dora import DoraConfig, apply_dora, merge_dora
from tlt_lightning.efficiency.grpo import grpo_policy_loss, grpo_profile_batch
from tlt_lightning.efficiency.memory import ActivationMemoryMeter, MemoryReport, measure_step
from tlt_lightning.efficiency.precision import LayerwisePrecision, PrecisionConfig
from tlt_lightning.efficiency.qat import Int4QATConfig, convert_qat, prepare_qat, quantize_ptq
from tlt_lightning.efficiency.sampler import (
    ImportanceSampler,
    ImportanceSamplerConfig,
    LossScorer,
    RhoLossScorer,
    Scorer,
)
from tlt_lightning.efficiency.training import DistillationModule, ImportanceSamplingCallback, QATCallback

__all__ = [
    "ActivationCheckpointPlan",
    "ActivationCheckpointProfile",
    "ActivationCheckpointingCallback",
    "ActivationMemoryMeter",
    "DistillConfig",
    "DistillationModule",
    "DoraConfig",
    "DynamicActivationCheckpointing",
    "HierarchicalDistillation",
    "HostMemoryCallback",
    "ImportanceSampler",
    "ImportanceSamplerConfig",
    "ImportanceSamplingCallback",
    "Int4QATConfig",
    "LayerwisePrecision",
    "LayerwisePrecisionCallback",
    "LossScorer",
    "MemoryReport",
    "PrecisionConfig",
    "QATCallback",
    "RhoLossScorer",
    "Scorer",
    "StreamingCheckpointIO",
    "apply_activation_checkpointing",
    "apply_dora",
    "convert_qat",
    "distill_step",
    "find_blocks",
    "grpo_policy_loss",
    "grpo_profile_batch",
    "measure_step",
    "merge_dora",
    "prepare_qat",
    "profile_blocks",
    "quantize_ptq",
]
