"""The EAGLE / EAGLE-3 checkpoint format that vLLM and SGLang load, and its mapping to :class:`DrafterConfig`.

A deployable drafter directory holds ``config.json`` (a Llama ``PretrainedConfig`` with one hidden
layer plus the EAGLE keys) and ``model.safetensors``. What the engines expect, read from their
loaders (vLLM ``model_executor/models/llama_eagle.py``, ``llama_eagle3.py``; SGLang
``models/llama_eagle.py``, ``llama_eagle3.py``):

* **EAGLE-1** (vLLM: its own ``EAGLEConfig``, ``model_type: "eagle"`` with the layer's Llama config
  under ``model``, which it loads as ``EagleLlamaForCausalLM``; SGLang: a flat Llama config with
  ``architectures: ["LlamaForCausalLMEagle"]``, and its ``fc`` has a bias, so an SGLang export
  carries an explicit zero ``fc.bias``): ``fc.weight`` ``[H, 2H]`` over
  ``cat(embed, feature)``, then one Llama layer without ``input_layernorm`` (``layers.0.*``); its
  output goes through the *target's* LM head unnormalised. No ``lm_head``, no ``d2t``: the engines
  draft over the full vocabulary (a reduced draft vocabulary travels in a side file, see
  :mod:`.export`).
* **EAGLE-3** (``architectures: ["LlamaForCausalLMEagle3"]``): ``fc.weight`` ``[H, 3H]`` fuses three
  target layers; ``midlayer.*`` is a Llama layer whose q/k/v read ``cat(input_layernorm(embed),
  hidden_norm(g))`` (``2H``) with residual ``g`` (``norm_before_residual: false``); ``norm.weight``
  then ``lm_head.weight`` ``[V_draft, H]``; ``d2t`` ``[V_draft]`` int64 offsets (target id = draft
  id + ``d2t``) and ``t2d`` ``[V]`` bool when ``draft_vocab_size < vocab_size``.
* **EAGLE-3 for vLLM** is written in the format of vLLM's ``speculators`` library
  (``speculators_model_type: "eagle3"``, the layer's Llama config under ``transformer_layer_config``,
  ``speculators_config`` naming the verifier), so ``vllm serve DIR`` / ``LLM(model=DIR)`` starts the
  verifier with this drafter; vLLM's ``speculators`` reader knows no EAGLE-1, hence its own format.
* Neither vLLM form has ``model_type: "llama"``: transformers refuses them by name instead of building
  a random full ``LlamaForCausalLM`` around one layer (an SGLang export must stay a Llama config).
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
from tlt_lightning.validation import positive_int

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
    "flat_eagle_config",
]

# Target architectures whose layer a Llama EAGLE layer reproduces (same RMSNorm, SiLU MLP, RoPE).
EXPORT_MODEL_TYPES = ("llama", "qwen2")
# What config.json may name (first: what we write). vLLM's EAGLEConfig prefixes Eagle/Eagle3 itself.
EAGLE1_ARCHITECTURES = ("EagleLlamaForCausalLM", "LlamaForCausalLM", "LlamaForCausalLMEagle")
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator")
TARGET_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}  # the verifier's class
# Serving engine -> the EAGLE-1 architecture it loads (EAGLE-3's: LlamaForCausalLMEagle3, or speculators').
ENGINES = {"vllm": "EagleLlamaForCausalLM", "sglang": "LlamaForCausalLMEagle"}
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose config schema the vLLM EAGLE-3 export follows
DEFAULT_SPECULATIVE_TOKENS = 3  # what `LLM(model=DIR)` drafts per step unless speculative_config says
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


def eagle_config(
    config: DrafterConfig,
    dtype: torch.dtype,
    engine: str = "vllm",
    verifier: str | None = None,
    num_speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS,
) -> dict[str, Any]:
    """The ``config.json`` of an ``engine`` export of a drafter shaped by ``config`` stored in ``dtype``.

    Args:
        config: the drafter's config.
        dtype: the weights' dtype.
        engine: ``"vllm"`` or ``"sglang"``.
        verifier: vLLM EAGLE-3 only: the target's Hub id or directory, which ``vllm serve DIR`` loads
            as the verifier (``speculators_config.verifier.name_or_path``); ``None``: none recorded
            (the drafter then serves only with an explicit ``speculative_config``).
        num_speculative_tokens: vLLM EAGLE-3 only: draft tokens per step by default.

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
    record = {
        "format_version": 1,
        "engine": engine,
        "target_model_type": c.model_type,
        "drafter_config": c.to_dict(),
    }
    if engine == "vllm" and c.kind == "eagle1":  # vLLM's EAGLEConfig: the layer's Llama config under "model"
        layer = {**out, "architectures": ["LlamaForCausalLM"]}
        return {"model_type": "eagle", "architectures": out["architectures"], "model": layer, TLT_KEY: record}
    if engine == "vllm":
        return _speculators_config(out, c, verifier, num_speculative_tokens, record)
    if c.kind == "eagle3":
        out["draft_vocab_size"] = c.draft_vocab
        out["norm_before_residual"] = False
        out["eagle_aux_hidden_state_layer_ids"] = list(c.feature_layers)  # vLLM: layer inputs
        out["eagle_config"] = {  # SGLang: layer outputs
            "use_aux_hidden_state": True,
            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in c.feature_layers],
        }
    out[TLT_KEY] = record
    return out


def _speculators_config(
    layer: dict[str, Any],
    c: DrafterConfig,
    verifier: str | None,
    num_speculative_tokens: int,
    record: dict[str, Any],
) -> dict[str, Any]:
    """An EAGLE-3 ``config.json`` in the ``speculators`` format (``Eagle3SpeculatorConfig``'s schema)."""
    positive_int("num_speculative_tokens", num_speculative_tokens)
    return {
        "model_type": "speculators",  # vLLM's own config class; transformers knows no such model
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": num_speculative_tokens,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": [TARGET_ARCHITECTURES[c.model_type]]},
        },
        "transformer_layer_config": {k: v for k, v in layer.items() if k != "architectures"},
        "draft_vocab_size": c.draft_vocab,
        "norm_before_residual": False,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": list(c.feature_layers),  # the residual stream entering them
        "torch_dtype": layer["torch_dtype"],
        TLT_KEY: record,
    }


def flat_eagle_config(data: dict[str, Any]) -> dict[str, Any]:
    """An export's ``config.json`` as one flat Llama-style dict with EAGLE keys (the SGLang / legacy form):
    vLLM's nested ``eagle`` and ``speculators`` forms are unfolded, the others returned as they are."""
    if data.get("speculators_model_type") == "eagle3":
        layer = data.get("transformer_layer_config") or {}
        keys = ("draft_vocab_size", "norm_before_residual", "eagle_aux_hidden_state_layer_ids", TLT_KEY)
        return {
            **layer,
            **{k: data[k] for k in keys if k in data},
            "architectures": [EAGLE3_ARCHITECTURES[0]],
        }
    if data.get("model_type") == "eagle" and isinstance(data.get("model"), dict):
        return {**data["model"], "architectures": [ENGINES["vllm"]], TLT_KEY: data.get(TLT_KEY)}
    return data


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
    data = flat_eagle_config(data)
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
