"""The model card (``README.md``) of a drafter export: what it is, how vLLM and SGLang load it, its
tensors."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tlt_lightning.drafter.eagle_format import flat_eagle_config

__all__ = ["ModelCardInfo", "model_card"]


@dataclass(frozen=True)
class ModelCardInfo:
    """What a drafter's model card says beyond its weights; only what was recorded, nothing guessed.

    Args:
        license: the card's ``license`` (the target's terms usually bind its drafter); ``None``:
            ``other``, with a line asking to set it.
        tasks: what the drafter was trained on (e.g. reasoning-gym ``countdown``).
        acceptance: measured figures, name -> value (e.g. held-out acceptance of a warm-up).
        source: where ``tasks`` and ``acceptance`` come from (a file, a run).
    """

    license: str | None = None
    tasks: tuple[str, ...] = ()
    acceptance: dict[str, float] = field(default_factory=dict, hash=False)
    source: str | None = None

    @classmethod
    def from_warmup(cls, path: Path) -> ModelCardInfo:
        """The task and held-out acceptance a ``drafter warmup`` recorded in ``warmup.json`` (none: empty)."""
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError):
            return cls()
        after = record.get("held_out_after") if isinstance(record, dict) else None
        if not isinstance(after, dict):
            return cls()
        names = {"accept": "held-out acceptance (first draft token, T=1)", "top1": "held-out top-1 agreement"}
        measured = {names[k]: float(after[k]) for k in names if isinstance(after.get(k), (int, float))}
        task = record.get("task")
        return cls(tasks=(task,) if isinstance(task, str) else (), acceptance=measured, source=path.name)


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


def _vllm_usage(method: str, speculators: bool) -> list[str]:
    serve = [
        "`speculators_config` names the verifier (the target), so vLLM starts both from this directory:",
        "",
        "```bash",
        "vllm serve PATH/TO/THIS/DIR",
        "```",
        "",
        "or with the target named explicitly:",
        "",
    ]
    return [
        "## vLLM",
        "",
        *(serve if speculators else []),
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
    config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    side: dict[str, torch.Tensor],
    card: ModelCardInfo | None = None,
    base_model: str | None = None,
) -> str:
    """Markdown for an export with ``config.json`` = ``config``, weights ``tensors`` and side file ``side``.

    Args:
        config: the export's ``config.json``
            (from :func:`~tlt_lightning.drafter.eagle_format.eagle_config`).
        tensors: ``model.safetensors``'s tensors.
        side: ``draft_vocab/draft_vocab.safetensors``'s tensors (EAGLE-1 with a reduced vocabulary),
            else empty.
        card: license, tasks and measured acceptance (default: none known).
        base_model: the target's Hub id or directory (the front matter's ``base_model``).
    """
    card = card or ModelCardInfo()
    speculators = "speculators_config" in config
    config = flat_eagle_config(config)
    engine = config["tlt_lightning"]["engine"]
    record = config["tlt_lightning"]["drafter_config"]
    kind, target_type = record["kind"], config["tlt_lightning"]["target_model_type"]
    eagle3 = kind == "eagle3"
    method, algo = ("eagle3", "EAGLE3") if eagle3 else ("eagle", "EAGLE")
    lines = [
        *_front_matter(method, engine, speculators, card, base_model),
        *_introduction(algo, target_type, eagle3),
        *_summary_table(config, record, tensors),
        *_provenance(card),
        *(_vllm_usage(method, speculators) if engine == "vllm" else _sglang_usage(algo, bool(side))),
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


def _front_matter(
    method: str, engine: str, speculators: bool, card: ModelCardInfo, base_model: str | None
) -> list[str]:
    """The Hub's front matter: ``base_model``, ``library_name``, ``license``, ``tags`` (tasks included)."""
    tags = [
        "speculative-decoding",
        method,
        engine,
        *(["speculators"] if speculators else []),
        "tlt-lightning",
    ]
    tags += [f"task:{t}" for t in card.tasks]
    lines = ["---", *([f"base_model: {json.dumps(base_model)}"] if base_model else [])]
    lines += ["library_name: tlt-lightning", f"license: {card.license or 'other'}", "tags:"]
    return [*lines, *(f"- {t}" for t in tags), "---"]


def _provenance(card: ModelCardInfo) -> list[str]:
    """What it was trained on and what was measured, as recorded (nothing when nothing was)."""
    lines = []
    if card.tasks:
        lines += [f"Trained on rollouts of: {', '.join(f'`{t}`' for t in card.tasks)}.", ""]
    if card.acceptance:
        lines += [f"Measured ({card.source or 'at export'}):", ""]
        lines += [f"- {name}: {value:.3f}" for name, value in card.acceptance.items()] + [""]
    if card.license is None:
        lines += [
            "License: `other` until you set it; the target model's license usually binds its drafter.",
            "",
        ]
    return lines


def _introduction(algo: str, target_type: str, eagle3: bool) -> list[str]:
    """The title and what the drafter is for."""
    return [
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
        layers = record["feature_layers"]
        features = (
            f"`{layers}` (vLLM: residual stream entering these layers) = `{[i - 1 for i in layers]}`"
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
        f"| weights | {params:,} parameters, {config.get('torch_dtype')} ({shared} shared with the target, "
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
