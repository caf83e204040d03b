"""The model card (``README.md``) of a drafter export: what it is, how vLLM and SGLang load it, its
tensors."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["model_card"]

_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.bool: "BOOL",
}


def _tensor_rows(tensors: dict[str, torch.Tensor], file: str) -> list[str]:
    return [
        f"| `{name}` | `{list(t.shape)}` | {_DTYPES.get(t.dtype, str(t.dtype))} | {file} |"
        for name, t in sorted(tensors.items())
    ]


def _vllm_usage(method: str) -> list[str]:
    return [
        "## vLLM",
        "",
        "```python",
        "from vllm import LLM",
        "llm = LLM(model=TARGET_MODEL, speculative_config={",
        f'    "method": "{method}", "model": "PATH/TO/THIS/DIR", "num_speculative_tokens": 4}})',
        "```",
        "",
    ]


def _sglang_usage(algo: str, token_map: bool) -> list[str]:
    return [
        "## SGLang",
        "",
        "```bash",
        f"python -m sglang.launch_server --model-path TARGET_MODEL --speculative-algorithm {algo} \\",
        "    --speculative-draft-model-path PATH/TO/THIS/DIR --speculative-num-steps 3 \\",
        "    --speculative-eagle-topk 1 --speculative-num-draft-tokens 4"
        + (
            " \\\n    --speculative-token-map PATH/TO/THIS/DIR/draft_vocab/hot_token_ids.pt"
            if token_map
            else ""
        ),
        "```",
        "",
    ]


def model_card(
    config: dict[str, Any], tensors: dict[str, torch.Tensor], side: dict[str, torch.Tensor]
) -> str:
    """Markdown for an export with ``config.json`` = ``config``, weights ``tensors`` and side file ``side``.

    Args:
        config: the export's ``config.json``
            (from :func:`~tlt_lightning.drafter.eagle_format.eagle_config`).
        tensors: ``model.safetensors``'s tensors.
        side: ``draft_vocab/draft_vocab.safetensors``'s tensors (EAGLE-1 with a reduced vocabulary),
            else empty.
    """
    engine = config["tlt_lightning"]["engine"]
    record = config["tlt_lightning"]["drafter_config"]
    kind, target_type = record["kind"], config["tlt_lightning"]["target_model_type"]
    eagle3 = kind == "eagle3"
    method, algo = ("eagle3", "EAGLE3") if eagle3 else ("eagle", "EAGLE")
    lines = [
        *_introduction(method, algo, target_type, eagle3),
        *_summary_table(config, record, tensors),
        *(_vllm_usage(method) if engine == "vllm" else _sglang_usage(algo, bool(side))),
        f"Exported for {'vLLM' if engine == 'vllm' else 'SGLang'} (the two differ in the EAGLE-1 "
        "architecture name and `fc` bias); `tlt-lightning export-drafter --engine vllm|sglang` writes "
        "the other.",
        "",
        "## Back into tlt-lightning",
        "",
        "```python",
        "from tlt_lightning.drafter import import_drafter",
        "from tlt_lightning.models import HFTarget, load_model",
        'drafter = import_drafter("PATH/TO/THIS/DIR", HFTarget(load_model(TARGET_MODEL).model))',
        "```",
        "",
        "## Tensors",
        "",
        "| name | shape | dtype | file |",
        "|---|---|---|---|",
        *_tensor_rows(tensors, "model.safetensors"),
        *_tensor_rows(side, "draft_vocab/draft_vocab.safetensors"),
        "",
        *_notes(target_type, record["draft_vocab_size"] or record["vocab_size"], bool(side)),
    ]
    return "\n".join(lines) + "\n"


def _introduction(method: str, algo: str, target_type: str, eagle3: bool) -> list[str]:
    """The front matter (tags), the title and what the drafter is for."""
    return [
        "---",
        "tags:",
        "- speculative-decoding",
        f"- {method}",
        "- tlt-lightning",
        "---",
        f"# {algo} drafter for a {target_type} target (tlt-lightning)",
        "",
        f"A one-layer {'EAGLE-3' if eagle3 else 'EAGLE'} drafter trained by "
        "tlt-lightning on the target model's own hidden states (TLT: trained on idle "
        "time during RL rollouts). It only *proposes* tokens: speculative decoding verifies every proposal "
        "against the target, so what the target generates does not change; a better drafter only makes "
        "generation faster. Use it with the exact target weights it was trained for.",
        "",
    ]


def _summary_table(
    config: dict[str, Any], record: dict[str, Any], tensors: dict[str, torch.Tensor]
) -> list[str]:
    """Kind, target, features read, draft vocabulary and size of the drafter."""
    eagle3 = record["kind"] == "eagle3"
    V = record["vocab_size"]
    Vd = record["draft_vocab_size"] or V
    params = sum(t.numel() for n, t in tensors.items() if t.is_floating_point())
    if eagle3:
        features = (
            f"`{config['eagle_aux_hidden_state_layer_ids']}` (vLLM: residual stream entering these layers)"
            f" = `{config['eagle_config']['eagle_aux_hidden_state_layer_ids']}`"
            " (SGLang: outputs of these layers)"
        )
    else:
        features = "the target's final normalised hidden state"
    vocab_note = f"{Vd} of {V} tokens" + ("" if Vd == V else " (`d2t`: draft id + d2t = target id)")
    shared = "embeddings" if eagle3 else "embeddings and LM head"
    return [
        "| | |",
        "|---|---|",
        f"| kind | `{record['kind']}` (`architectures: {config['architectures']}`) |",
        f"| target architecture | `{config['tlt_lightning']['target_model_type']}`, "
        f"{record['num_target_layers']} layers, hidden size {record['hidden_size']} |",
        f"| reads | {features} |",
        f"| draft vocabulary | {vocab_note} |",
        f"| weights | {params:,} parameters, {config['torch_dtype']} ({shared} shared with the target, "
        "not stored) |",
        "",
    ]


def _notes(target_type: str, draft_vocab_size: int, has_side_file: bool) -> list[str]:
    """Caveats: Qwen2's zero ``o_proj`` bias, where the draft vocabulary is, the ``tlt_lightning`` key."""
    lines = ["## Notes", ""]
    if target_type == "qwen2":
        lines.append(
            "- Qwen2 biases q/k/v but not o_proj; the Llama layer the engines build has one `attention_bias` "
            "switch, so `o_proj.bias` is stored as zeros (the same function)."
        )
    if has_side_file:
        lines.append(
            f"- The draft vocabulary ({draft_vocab_size} tokens) is in the subfolder `draft_vocab/` "
            "(the engines load every `*.safetensors` at the top level): vLLM's EAGLE-1 drafts over the "
            "full vocabulary (still lossless), SGLang uses it with `--speculative-token-map`."
        )
    lines.append(
        "- `tlt_lightning` in `config.json` records the drafter's own configuration; the engines ignore it."
    )
    return lines
