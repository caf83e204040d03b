"""The EAGLE / EAGLE-3 checkpoint format that vLLM and SGLang load, and its mapping to :class:`DrafterConfig`.

A deployable drafter directory holds ``config.json`` (a Llama ``PretrainedConfig`` with one hidden
layer plus the EAGLE keys) and ``model.safetensors``. What the engines expect, read from their
loaders (vLLM ``model_executor/models/llama_eagle.py``, ``llama_eagle3.py``; SGLang
``models/llama_eagle.py``, ``llama_eagle3.py``):

* **EAGLE-1** (vLLM: ``architectures: ["LlamaForCausalLM"]``, which it maps to
  ``EagleLlamaForCausalLM``; SGLang: ``["LlamaForCausalLMEagle"]``, and its ``fc`` has a bias, so
  an SGLang export carries an explicit zero ``fc.bias``): ``fc.weight`` ``[H, 2H]`` over
  ``cat(embed, feature)``, then one Llama layer without ``input_layernorm`` (``layers.0.*``); its
  output goes through the *target's* LM head unnormalised. No ``lm_head``, no ``d2t``: the engines
  draft over the full vocabulary (a reduced draft vocabulary travels in a side file, see
  :mod:`.export`).
* **EAGLE-3** (``architectures: ["LlamaForCausalLMEagle3"]``): ``fc.weight`` ``[H, 3H]`` fuses three
  target layers; ``midlayer.*`` is a Llama layer whose q/k/v read ``cat(input_layernorm(embed),
  hidden_norm(g))`` (``2H``) with residual ``g`` (``norm_before_residual: false``); ``norm.weight``
  then ``lm_head.weight`` ``[V_draft, H]``; ``d2t`` ``[V_draft]`` int64 offsets (target id = draft
  id + ``d2t``) and ``t2d`` ``[V]`` bool when ``draft_vocab_size < vocab_size``.
* Embeddings are the target's (``embed_tokens`` is optional and not written).
* Auxiliary layers: vLLM reads top-level ``eagle_aux_hidden_state_layer_ids`` and captures the
  residual stream *entering* layer ``i`` (our feature index ``i``); SGLang reads
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` and captures the *output* of layer ``i``
  (it adds one), so both are written, each in its engine's convention.
* Llama attention has one ``attention_bias`` switch for q/k/v *and* o_proj. Qwen2 biases q/k/v
  only, so a Qwen2-target drafter is written with ``attention_bias: true`` and an all-zero
  ``o_proj.bias``: the same function in a layout the engines load. SGLang's EAGLE-3 layer has no
  attention biases at all, so a Qwen2 EAGLE-3 drafter cannot be exported for SGLang.
"""

from __future__ import annotations

from typing import Any

import torch

from tlt_lightning.drafter.config import DrafterConfig
from tlt_lightning.models.target import TargetModel

__all__ = [
    "EAGLE1_ARCHITECTURES",
    "EAGLE3_ARCHITECTURES",
    "ENGINES",
    "EXPORT_MODEL_TYPES",
    "TLT_KEY",
    "check_engine",
    "check_exportable",
    "config_from_eagle",
    "eagle_config",
]

# Target architectures whose layer a Llama EAGLE layer reproduces (same RMSNorm, SiLU MLP, RoPE).
EXPORT_MODEL_TYPES = ("llama", "qwen2")
# What config.json may name (first: what we write). vLLM's EAGLEConfig prefixes Eagle/Eagle3 itself.
EAGLE1_ARCHITECTURES = ("LlamaForCausalLM", "EagleLlamaForCausalLM", "LlamaForCausalLMEagle")
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# Serving engine -> the EAGLE-1 architecture it loads (EAGLE-3's is the same for both).
ENGINES = {"vllm": "LlamaForCausalLM", "sglang": "LlamaForCausalLMEagle"}
# Our own record inside config.json (engines ignore unknown keys): the exact DrafterConfig.
TLT_KEY = "tlt_lightning"
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def check_engine(engine: str) -> None:
    """``ValueError`` unless ``engine`` is one of :data:`ENGINES`."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {sorted(ENGINES)}, got {engine!r}")


def check_exportable(config: DrafterConfig, engine: str = "vllm") -> None:
    """Raise ``ValueError`` when ``engine`` (vLLM or SGLang) cannot run ``config`` as an EAGLE drafter.

    Raises:
        ValueError: the target architecture has no EAGLE drafter there (only Llama-layout targets:
            :data:`EXPORT_MODEL_TYPES`), the activation is not SiLU (their Llama MLP supports only
            SiLU), or an EAGLE-3 feature layer cannot be captured (they tap the residual stream
            entering layers ``1 .. L-1``: not the embeddings, not the final normalised state), or
            SGLang gets an EAGLE-3 drafter with attention biases (its EAGLE-3 layer has none).
    """
    check_engine(engine)
    check_model_type(config.model_type)
    if config.hidden_act != "silu":
        raise ValueError(
            f"cannot export: hidden_act is {config.hidden_act!r}, but the EAGLE drafters of vLLM and "
            "SGLang use a Llama MLP, which supports only 'silu'"
        )
    L = config.num_target_layers
    if config.kind == "eagle3" and any(not 1 <= i <= L - 1 for i in config.feature_layers):
        raise ValueError(
            f"cannot export: eagle3 feature_layers must lie in [1, {L - 1}] (the residual stream entering a "
            f"target layer, which is what vLLM and SGLang capture), got {config.feature_layers}"
        )
    if engine == "sglang" and config.kind == "eagle3" and (config.attention_bias or config.o_proj_bias):
        raise ValueError(
            "cannot export for SGLang: this eagle3 drafter has attention biases "
            f"(a {config.model_type!r} target's q/k/v biases), and SGLang's EAGLE-3 layer has none, "
            "so it would silently drop them; export with engine='vllm', or use an eagle1 drafter for SGLang"
        )


def check_model_type(model_type: str) -> None:
    """``ValueError`` unless a Llama EAGLE drafter reproduces the layer of a ``model_type`` target."""
    if model_type not in EXPORT_MODEL_TYPES:
        raise ValueError(
            f"cannot export a drafter for target architecture {model_type!r}: vLLM and SGLang load EAGLE "
            f"drafters only for targets of Llama layout; supported target architectures: {EXPORT_MODEL_TYPES}"
        )


def _rope_keys(rope: dict[str, Any]) -> dict[str, Any]:
    """Rope settings under both spellings: legacy ``rope_theta``/``rope_scaling`` and transformers 5's
    ``rope_parameters`` (engines built on either transformers major read theirs)."""
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    legacy = None if scaling.get("rope_type", "default") == "default" else scaling
    return {"rope_theta": rope["rope_theta"], "rope_scaling": legacy, "rope_parameters": dict(rope)}


def eagle_config(config: DrafterConfig, dtype: torch.dtype, engine: str = "vllm") -> dict[str, Any]:
    """The ``config.json`` of an ``engine`` export of a drafter shaped by ``config`` stored in ``dtype``.

    Raises:
        ValueError: see :func:`check_exportable`; ``dtype`` is not float32/bfloat16/float16.
    """
    check_exportable(config, engine)
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {list(DTYPE_NAMES.values())}, got {dtype}")
    c = config
    out: dict[str, Any] = {
        "architectures": [ENGINES[engine] if c.kind == "eagle1" else EAGLE3_ARCHITECTURES[0]],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": c.hidden_act,
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        **_rope_keys(c.rope_parameters),
        # q/k/v bias; Llama's o_proj follows it (a Qwen2 drafter gets a zero o_proj bias).
        "attention_bias": c.attention_bias or c.o_proj_bias,
        "mlp_bias": False,
        "vocab_size": c.vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": DTYPE_NAMES[dtype],
    }
    if c.kind == "eagle3":
        out["draft_vocab_size"] = c.draft_vocab
        out["norm_before_residual"] = False
        out["eagle_aux_hidden_state_layer_ids"] = list(c.feature_layers)  # vLLM: layer inputs
        out["eagle_config"] = {  # SGLang: layer outputs
            "use_aux_hidden_state": True,
            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in c.feature_layers],
        }
    out[TLT_KEY] = {
        "format_version": 1,
        "engine": engine,
        "target_model_type": c.model_type,
        "drafter_config": c.to_dict(),
    }
    return out


def _field(data: dict[str, Any], name: str) -> Any:
    if name not in data:
        raise ValueError(f"config.json has no {name!r}: not an EAGLE drafter config")
    return data[name]


def config_from_eagle(
    data: dict[str, Any], target: TargetModel, draft_vocab_size: int | None = None
) -> DrafterConfig:
    """Rebuild the :class:`DrafterConfig` of an EAGLE ``config.json`` (as a dict) for ``target``.

    Only the standard EAGLE keys are read, so third-party EAGLE checkpoints of the same layout load
    too; the target supplies what the format leaves out (its architecture and layer count).

    Args:
        data: the parsed ``config.json``.
        target: the target the drafter drafts for.
        draft_vocab_size: EAGLE-1 only (its config has no draft vocabulary): the size of the side
            file's vocabulary, ``None`` for the full one.

    Raises:
        ValueError: unknown architecture, a missing key, more than one layer, a target of another
            architecture than the record says, or a config :class:`DrafterConfig` rejects.
    """
    archs = list(_field(data, "architectures") or [])
    if archs and archs[0] in EAGLE3_ARCHITECTURES:
        kind = "eagle3"
    elif archs and archs[0] in EAGLE1_ARCHITECTURES:
        kind = "eagle1"
    else:
        raise ValueError(
            f"config.json architectures {archs} is not an EAGLE drafter; expected one of "
            f"{EAGLE1_ARCHITECTURES + EAGLE3_ARCHITECTURES}"
        )
    if _field(data, "num_hidden_layers") != 1:
        raise ValueError(
            f"config.json num_hidden_layers must be 1 (one drafter layer), got {data['num_hidden_layers']}"
        )
    info = target.info
    check_model_type(info.model_type)
    record = data.get(TLT_KEY) or {}
    if record.get("target_model_type", info.model_type) != info.model_type:
        raise ValueError(
            f"the export was made for a {record['target_model_type']!r} target, "
            f"got a {info.model_type!r} target"
        )
    H, heads = _field(data, "hidden_size"), _field(data, "num_attention_heads")
    rope = data.get("rope_parameters") or {
        **(data.get("rope_scaling") or {"rope_type": "default"}),
        "rope_theta": data.get("rope_theta", 10000.0),
    }
    bias = bool(data.get("attention_bias", False))
    qkv_bias, o_bias = (bias, False) if info.model_type == "qwen2" else (bias, bias)
    L = info.num_layers
    layers: tuple[int, ...] = (L,)
    vocab = draft_vocab_size
    if kind == "eagle3":
        ids = data.get("eagle_aux_hidden_state_layer_ids")
        sglang = (data.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if ids is None and sglang is not None:
            ids = [i + 1 for i in sglang]
        # vLLM's default when a checkpoint names none.
        layers = tuple(ids) if ids is not None else (2, L // 2, L - 3)
        vocab = data.get("draft_vocab_size")
    return DrafterConfig(
        kind=kind,
        model_type=info.model_type,
        hidden_size=H,
        num_attention_heads=heads,
        num_key_value_heads=data.get("num_key_value_heads") or heads,
        head_dim=data.get("head_dim") or H // heads,
        intermediate_size=_field(data, "intermediate_size"),
        vocab_size=_field(data, "vocab_size"),
        num_target_layers=L,
        rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
        rope_parameters=dict(rope),
        max_position_embeddings=data.get("max_position_embeddings", info.max_positions),
        attention_bias=qkv_bias,
        o_proj_bias=o_bias,
        hidden_act=data.get("hidden_act", "silu"),
        draft_vocab_size=vocab,
        feature_layers=layers,
    )
