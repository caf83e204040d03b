"""Deployable drafter export: the EAGLE / EAGLE-3 format of vLLM and SGLang, and the way back."""

from __future__ import annotations

import dataclasses
import json
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from tlt_lightning import cli
from tlt_lightning.drafter import (
    Drafter,
    export_drafter,
    export_drafter_model,
    import_drafter,
    load_drafter,
    save_drafter,
)
from tlt_lightning.drafter.eagle_format import flat_eagle_config
from tlt_lightning.drafter.export import VLLM_CPU_HEAD_SIZES
from tlt_lightning.drafter.io import CONFIG_NAME
from tlt_lightning.models import HFTarget, load_model

from .conftest import make_drafter

V, H, HEADS, KV, HEAD_DIM, INTER, L = 128, 64, 4, 2, 16, 128, 4  # the tiny registry models
DRAFT_VOCAB = 48


def trained_drafter(target, kind: str, draft_vocab: int | None, seed: int = 0) -> Drafter:
    """A drafter whose every tensor is random (norms and biases too) and whose vocabulary is not a prefix."""
    counts = torch.rand(V, generator=torch.Generator().manual_seed(seed)) if draft_vocab else None
    d = make_drafter(target, kind, draft_vocab, seed=seed, token_counts=counts)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return d


def inputs(drafter: Drafter, n: int = 2, q: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (n, q), generator=g)
    features = torch.randn(n, q, drafter.config.num_features, H, generator=g)
    return tokens, features, torch.arange(q).expand(n, q)


def logits_of(drafter: Drafter, seed: int = 0) -> torch.Tensor:
    """``[n, q, V_draft]`` drafter logits on random tokens and features (causal, no cache)."""
    tokens, features, positions = inputs(drafter, seed=seed)
    q = tokens.shape[1]
    mask = torch.ones(q, q, dtype=torch.bool).tril().expand(tokens.shape[0], 1, q, q)
    with torch.no_grad():
        return drafter.logits(drafter(tokens, drafter.lift(features), positions, mask))


def export(tmp_path, target, kind, draft_vocab, dtype=None, seed=0, engine="vllm"):
    d = trained_drafter(target, kind, draft_vocab, seed)
    ckpt = save_drafter(d, tmp_path / "ckpt")
    return d, export_drafter(ckpt, tmp_path / "eagle", target, dtype=dtype, engine=engine)


both_kinds = pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
both_engines = pytest.mark.parametrize("engine", ["vllm", "sglang"])
both_vocabs = pytest.mark.parametrize("draft_vocab", [None, DRAFT_VOCAB], ids=["full-vocab", "draft-vocab"])


# ----------------------------------------------------------------------------------- round trip


@both_kinds
@both_vocabs
@both_engines
def test_round_trip_gives_identical_logits(tmp_path, target, kind, draft_vocab, engine):
    if engine == "sglang" and kind == "eagle3" and target.info.model_type == "qwen2":
        pytest.skip("refused: SGLang's EAGLE-3 has no q/k/v biases (test_sglang_refuses_...)")
    d, out = export(tmp_path, target, kind, draft_vocab, engine=engine)
    torch.manual_seed(123)  # another init: the import must overwrite every tensor
    back = import_drafter(out, target)
    assert back.config == d.config
    assert torch.equal(back.draft_ids, d.draft_ids)
    assert torch.equal(logits_of(back), logits_of(d))
    assert torch.equal(logits_of(back, seed=1), logits_of(d, seed=1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "eagle"]  # no temp dirs left


@both_kinds
def test_standard_keys_alone_rebuild_the_drafter(tmp_path, qwen2, kind):
    """Without our own record (as a third-party EAGLE checkpoint would come) the import is the same."""
    d, out = export(tmp_path, qwen2, kind, DRAFT_VOCAB)
    config = json.loads((out / "config.json").read_text())
    del config["tlt_lightning"]
    (out / "config.json").write_text(json.dumps(config))
    back = import_drafter(out, qwen2)
    assert back.config == d.config
    assert torch.equal(logits_of(back), logits_of(d))


def test_third_party_vocabulary_layouts_load(tmp_path, llama):
    """Full vocabulary written with identity ``d2t``; a reduced one without ``t2d`` (vLLM needs none)."""
    d, out = export(tmp_path, llama, "eagle3", None)
    weights = load_file(out / "model.safetensors")
    save_file(
        {**weights, "d2t": torch.zeros(V, dtype=torch.long), "t2d": torch.ones(V, dtype=torch.bool)},
        out / "model.safetensors",
    )
    assert torch.equal(logits_of(import_drafter(out, llama)), logits_of(d))
    save_file({**weights, "d2t": torch.ones(V, dtype=torch.long)}, out / "model.safetensors")
    with pytest.raises(ValueError, match="d2t is not all zero, but the draft vocabulary is the full one"):
        import_drafter(out, llama)
    d, out = export(tmp_path / "reduced", llama, "eagle3", DRAFT_VOCAB)
    weights = load_file(out / "model.safetensors")
    del weights["t2d"]
    save_file(weights, out / "model.safetensors")
    assert torch.equal(logits_of(import_drafter(out, llama)), logits_of(d))
    save_file({**weights, "d2t": weights["d2t"] + V}, out / "model.safetensors")
    with pytest.raises(ValueError, match="d2t and t2d do not describe the same draft vocabulary of 48 ids"):
        import_drafter(out, llama)


def test_bfloat16_export_loads_back_as_the_rounded_drafter(tmp_path, llama):
    d, out = export(tmp_path, llama, "eagle3", DRAFT_VOCAB, dtype="bfloat16")
    back = import_drafter(out, llama, dtype=torch.bfloat16)
    assert back.dtype == torch.bfloat16
    rounded = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in d.state_dict().items()}
    assert all(torch.equal(back.state_dict()[k], v) for k, v in rounded.items())


# ----------------------------------------------------------------------------------- the format


def expected_tensors(model_type: str, kind: str, draft_vocab: int | None) -> dict[str, list[int]]:
    """Names and shapes of DESIGN.md's EAGLE / EAGLE-3 format, written out by hand."""
    layer, q_in = ("layers.0", H) if kind == "eagle1" else ("midlayer", 2 * H)
    out = {
        "fc.weight": [H, 2 * H if kind == "eagle1" else 3 * H],
        f"{layer}.self_attn.q_proj.weight": [HEADS * HEAD_DIM, q_in],
        f"{layer}.self_attn.k_proj.weight": [KV * HEAD_DIM, q_in],
        f"{layer}.self_attn.v_proj.weight": [KV * HEAD_DIM, q_in],
        f"{layer}.self_attn.o_proj.weight": [H, HEADS * HEAD_DIM],
        f"{layer}.post_attention_layernorm.weight": [H],
        f"{layer}.mlp.gate_proj.weight": [INTER, H],
        f"{layer}.mlp.up_proj.weight": [INTER, H],
        f"{layer}.mlp.down_proj.weight": [H, INTER],
    }
    if model_type == "qwen2":  # attention_bias: all four projections (o_proj's is zero)
        out |= {
            f"{layer}.self_attn.q_proj.bias": [HEADS * HEAD_DIM],
            f"{layer}.self_attn.k_proj.bias": [KV * HEAD_DIM],
            f"{layer}.self_attn.v_proj.bias": [KV * HEAD_DIM],
            f"{layer}.self_attn.o_proj.bias": [H],
        }
    if kind == "eagle3":
        out |= {
            "midlayer.input_layernorm.weight": [H],
            "midlayer.hidden_norm.weight": [H],
            "norm.weight": [H],
            "lm_head.weight": [draft_vocab or V, H],
        }
        if draft_vocab:
            out |= {"d2t": [draft_vocab], "t2d": [V]}
    return out


@both_kinds
@both_vocabs
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@both_engines
def test_names_shapes_and_dtypes_follow_the_eagle_format(tmp_path, target, kind, draft_vocab, dtype, engine):
    if engine == "sglang" and kind == "eagle3" and target.info.model_type == "qwen2":
        pytest.skip("refused: SGLang's EAGLE-3 has no q/k/v biases (test_sglang_refuses_...)")
    d, out = export(tmp_path, target, kind, draft_vocab, dtype=dtype, engine=engine)
    expected = expected_tensors(target.info.model_type, kind, draft_vocab)
    if engine == "sglang" and kind == "eagle1":  # SGLang's EAGLE-1 fc has a bias
        expected["fc.bias"] = [H]
    with safe_open(out / "model.safetensors", framework="pt") as f:
        shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    assert shapes == expected
    float_dtype = getattr(torch, dtype)
    for name, t in tensors.items():
        want = {"d2t": torch.int64, "t2d": torch.bool}.get(name, float_dtype)
        assert t.dtype == want, name
    if "fc.bias" in tensors:
        assert not tensors["fc.bias"].any()
    # The engines load every *.safetensors at the top level (vLLM failed on a d2t there): only the weights.
    files = {"README.md", "config.json", "model.safetensors"}
    if kind == "eagle1" and draft_vocab:  # engines' EAGLE-1 has no draft vocabulary: a subfolder
        files |= {"draft_vocab"}
        side = load_file(out / "draft_vocab" / "draft_vocab.safetensors")
        assert {k: (list(v.shape), v.dtype) for k, v in side.items()} == {
            "d2t": ([draft_vocab], torch.int64),
            "t2d": ([V], torch.bool),
        }
        assert torch.equal(torch.load(out / "draft_vocab" / "hot_token_ids.pt"), d.draft_ids)
        assert sorted(p.name for p in (out / "draft_vocab").iterdir()) == [
            "draft_vocab.safetensors",
            "hot_token_ids.pt",
        ]
    assert {p.name for p in out.iterdir()} == files
    for path in out.rglob("*"):  # readable by a server's user
        assert path.stat().st_mode & 0o777 == (0o755 if path.is_dir() else 0o644), path
    if draft_vocab and kind == "eagle3":  # target id = draft id + d2t, ascending; t2d marks them
        ids = torch.arange(draft_vocab) + tensors["d2t"]
        assert torch.equal(ids, d.draft_ids) and torch.equal(tensors["t2d"].nonzero().flatten(), ids)
    if "midlayer.self_attn.o_proj.bias" in tensors or "layers.0.self_attn.o_proj.bias" in tensors:
        assert not any(t.any() for k, t in tensors.items() if k.endswith("o_proj.bias"))
    card = (out / "README.md").read_text()
    if engine == "vllm":
        assert f'"method": "{"eagle3" if kind == "eagle3" else "eagle"}"' in card
    else:
        assert f"--speculative-algorithm {'EAGLE3' if kind == 'eagle3' else 'EAGLE'}" in card
        assert ("draft_vocab/hot_token_ids.pt" in card) == (kind == "eagle1" and bool(draft_vocab))
    assert all(f"`{name}`" in card for name in expected)


@both_kinds
@both_engines
def test_config_json_is_what_vllm_and_sglang_read(tmp_path, target, kind, engine):
    if engine == "sglang" and kind == "eagle3" and target.info.model_type == "qwen2":
        pytest.skip("refused: SGLang's EAGLE-3 has no q/k/v biases (test_sglang_refuses_...)")
    _, out = export(tmp_path, target, kind, DRAFT_VOCAB, engine=engine)
    raw = json.loads((out / "config.json").read_text())
    config = layer_config(out)  # the layer's Llama config, as the engines build it
    assert isinstance(config, LlamaConfig) and config.model_type == "llama"
    eagle1 = {"vllm": "EagleLlamaForCausalLM", "sglang": "LlamaForCausalLMEagle"}[engine]
    assert config.architectures == ["LlamaForCausalLMEagle3" if kind == "eagle3" else eagle1]
    assert raw["tlt_lightning"]["engine"] == engine
    if engine == "vllm":  # vLLM's own forms, which transformers refuses by name (no random LlamaForCausalLM)
        assert raw["model_type"] == ("speculators" if kind == "eagle3" else "eagle")
        with pytest.raises(ValueError, match=raw["model_type"]):
            AutoModelForCausalLM.from_pretrained(out)
        raw = flat_eagle_config(raw)
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (1, H, INTER)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (HEADS, KV, HEAD_DIM)
    assert config.vocab_size == V and config.hidden_act == "silu" and not config.tie_word_embeddings
    assert config.attention_bias is (target.info.model_type == "qwen2")
    assert (
        config.rope_parameters["rope_theta"]
        == raw["rope_theta"]
        == target.hf_config.rope_parameters["rope_theta"]
    )
    assert config.rms_norm_eps == target.hf_config.rms_norm_eps
    if kind == "eagle3":
        assert config.draft_vocab_size == DRAFT_VOCAB and config.norm_before_residual is False
        # vLLM taps the stream entering layer i, SGLang the output of layer i: (1, 2, 3) vs (0, 1, 2).
        assert config.eagle_aux_hidden_state_layer_ids == [1, 2, 3]
        if engine == "sglang":
            assert config.eagle_config == {
                "use_aux_hidden_state": True,
                "eagle_aux_hidden_state_layer_ids": [0, 1, 2],
            }
    else:
        assert "draft_vocab_size" not in raw and "eagle_config" not in raw


def layer_config(out) -> LlamaConfig:
    """The Llama config of an export's layer: SGLang's flat config.json, or vLLM's nested forms unfolded."""
    raw = json.loads((out / "config.json").read_text())
    if "model_type" in raw and raw["model_type"] == "llama":
        return AutoConfig.from_pretrained(out)
    return LlamaConfig(**flat_eagle_config(raw))


def engine_logits(out, target, tokens, features, positions) -> torch.Tensor:
    """``[n, q, V]`` what vLLM's EagleLlamaForCausalLM / Eagle3LlamaForCausalLM compute from the export
    alone (a prefill, causal), written from their source: fc, one Llama layer (EAGLE-1 without
    input_layernorm; EAGLE-3 over cat(input_layernorm(embed), hidden_norm(g)) with residual g), then the
    target's LM head (EAGLE-1) or norm + lm_head scattered through d2t (EAGLE-3)."""
    w = load_file(out / "model.safetensors")
    config = layer_config(out)
    eagle3 = config.architectures == ["LlamaForCausalLMEagle3"]
    p = "midlayer." if eagle3 else "layers.0."
    n, q = tokens.shape

    def rms(x, name):
        return w[name] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps))

    def lin(x, name):
        return F.linear(x, w[f"{name}.weight"], w.get(f"{name}.bias"))

    embeds = target.embed(tokens)
    if eagle3:
        g = lin(features.flatten(-2), "fc")
        x = torch.cat([rms(embeds, p + "input_layernorm.weight"), rms(g, p + "hidden_norm.weight")], -1)
        residual = g
    else:
        x = residual = lin(torch.cat([embeds, features[..., 0, :]], -1), "fc")
    hd, heads, kv = config.head_dim, config.num_attention_heads, config.num_key_value_heads
    qs = lin(x, p + "self_attn.q_proj").view(n, q, heads, hd).transpose(1, 2)
    ks = lin(x, p + "self_attn.k_proj").view(n, q, kv, hd).transpose(1, 2)
    vs = lin(x, p + "self_attn.v_proj").view(n, q, kv, hd).transpose(1, 2)
    cos, sin = LlamaRotaryEmbedding(config)(x, positions)
    qs, ks = apply_rotary_pos_emb(qs, ks, cos, sin)
    ks, vs = ks.repeat_interleave(heads // kv, 1), vs.repeat_interleave(heads // kv, 1)
    att = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(1, 2).reshape(n, q, -1)
    h = residual + lin(att, p + "self_attn.o_proj")
    m = rms(h, p + "post_attention_layernorm.weight")
    h = h + lin(F.silu(lin(m, p + "mlp.gate_proj")) * lin(m, p + "mlp.up_proj"), p + "mlp.down_proj")
    if not eagle3:
        return target.lm_head(h)
    logits = F.linear(rms(h, "norm.weight"), w["lm_head.weight"])
    ids = torch.arange(logits.shape[-1]) + w.get("d2t", torch.zeros((), dtype=torch.long))
    full = logits.new_full((n, q, config.vocab_size), -math.inf)
    full[..., ids] = logits
    return full


@both_kinds
@both_vocabs
def test_the_export_computes_what_the_engines_compute(tmp_path, target, kind, draft_vocab):
    d, out = export(tmp_path, target, kind, draft_vocab)
    tokens, features, positions = inputs(d)
    with torch.no_grad():
        engine = engine_logits(out, target, tokens, features, positions)
    ours = logits_of(d)
    # EAGLE-1 engines draft over the full vocabulary: compare on the drafter's own tokens.
    torch.testing.assert_close(engine[..., d.draft_ids], ours, rtol=1e-5, atol=1e-5)
    if kind == "eagle3" and draft_vocab:
        assert torch.isinf(engine).sum() == engine[..., :1].numel() * (V - draft_vocab)


# ----------------------------------------------------------------------------------- errors


def test_a_target_architecture_without_eagle_drafters_is_refused(tmp_path, llama):
    ckpt = save_drafter(trained_drafter(llama, "eagle3", None), tmp_path / "ckpt")
    meta = json.loads((ckpt / CONFIG_NAME).read_text())
    meta["config"]["model_type"] = "gpt2"
    (ckpt / CONFIG_NAME).write_text(json.dumps(meta))
    with pytest.raises(
        ValueError,
        match=r"cannot export a drafter for target architecture 'gpt2': vLLM and SGLang "
        r"load EAGLE drafters only for targets of Llama layout; supported target architectures: "
        r"\('llama', 'qwen2'\)",
    ):
        export_drafter(ckpt, tmp_path / "eagle", llama)
    assert not (tmp_path / "eagle").exists()


def test_configs_the_engines_cannot_run_are_refused(tmp_path, llama):
    d = trained_drafter(llama, "eagle3", None)
    gelu = Drafter(dataclasses.replace(d.config, hidden_act="gelu"), llama)
    with pytest.raises(ValueError, match="hidden_act is 'gelu'.*supports only 'silu'"):
        export_drafter_model(gelu, tmp_path / "a")
    embeddings = Drafter(dataclasses.replace(d.config, feature_layers=(0, 2, 3)), llama)
    with pytest.raises(ValueError, match=r"eagle3 feature_layers must lie in \[1, 3\].*got \(0, 2, 3\)"):
        export_drafter_model(embeddings, tmp_path / "b")
    final = Drafter(dataclasses.replace(d.config, feature_layers=(1, 2, 4)), llama)
    with pytest.raises(ValueError, match=r"must lie in \[1, 3\]"):
        export_drafter_model(final, tmp_path / "c")
    with pytest.raises(
        ValueError, match=r"dtype must be one of \['bfloat16', 'float16', 'float32'\], got 'int8'"
    ):
        export_drafter_model(d, tmp_path / "d", dtype="int8")
    assert list(tmp_path.iterdir()) == []


def test_sglang_refuses_an_eagle3_drafter_with_attention_biases(tmp_path, qwen2, llama):
    d = trained_drafter(qwen2, "eagle3", None)
    with pytest.raises(
        ValueError,
        match=r"cannot export for SGLang: this eagle3 drafter has attention biases.*"
        r"engine='vllm', or use an eagle1 drafter",
    ):
        export_drafter_model(d, tmp_path / "a", engine="sglang")
    with pytest.raises(ValueError, match=r"engine must be one of \['sglang', 'vllm'\], got 'trtllm'"):
        export_drafter_model(trained_drafter(llama, "eagle1", None), tmp_path / "b", engine="trtllm")
    assert list(tmp_path.iterdir()) == []
    export_drafter_model(
        trained_drafter(qwen2, "eagle1", None), tmp_path / "c", engine="sglang"
    )  # EAGLE-1 is fine


def test_export_replaces_an_export_but_not_other_directories(tmp_path, llama):
    first = export_drafter_model(trained_drafter(llama, "eagle1", None, seed=0), tmp_path / "eagle")
    second = trained_drafter(llama, "eagle1", None, seed=1)
    export_drafter_model(second, first)
    assert torch.equal(logits_of(import_drafter(first, llama)), logits_of(second))
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("important")
    with pytest.raises(ValueError, match="exists and is not a drafter export; refusing to overwrite it"):
        export_drafter_model(second, other)
    assert (other / "keep.txt").read_text() == "important"
    # A user's file inside an earlier export is never deleted by re-exporting over it.
    (first / "notes.md").write_text("my benchmark notes")
    with pytest.raises(
        ValueError, match=r"also holds files an export does not write: \['notes.md'\].*move them away"
    ):
        export_drafter_model(trained_drafter(llama, "eagle1", None, seed=2), first)
    assert (first / "notes.md").read_text() == "my benchmark notes"
    assert torch.equal(logits_of(import_drafter(first, llama)), logits_of(second))  # untouched


def test_an_export_with_the_side_file_at_the_top_level_still_imports(tmp_path, llama):
    """Exports written before ``draft_vocab/`` kept the side files beside the weights; re-exporting
    replaces them."""
    d, out = export(tmp_path, llama, "eagle1", DRAFT_VOCAB)
    for name in ("draft_vocab.safetensors", "hot_token_ids.pt"):
        (out / "draft_vocab" / name).rename(out / name)
    (out / "draft_vocab").rmdir()
    assert torch.equal(logits_of(import_drafter(out, llama)), logits_of(d))
    export_drafter_model(d, out)
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md",
        "config.json",
        "draft_vocab",
        "model.safetensors",
    ]


def test_import_refuses_what_it_cannot_load_exactly(tmp_path, llama, qwen2):
    d, out = export(tmp_path, qwen2, "eagle3", DRAFT_VOCAB)
    with pytest.raises(ValueError, match="the export was made for a 'qwen2' target, got a 'llama' target"):
        import_drafter(out, llama)
    other = HFTarget(load_model("tiny-qwen2", seed=1).model)  # same shapes, other weights
    with pytest.raises(ValueError, match="lm_head.weight is not the target's LM head.*check_head=False"):
        import_drafter(out, other)
    assert import_drafter(out, other, check_head=False).config == d.config
    weights = load_file(out / "model.safetensors")
    save_file({**weights, "embed_tokens.weight": other.embed(torch.arange(V))}, out / "model.safetensors")
    with pytest.raises(ValueError, match="embed_tokens.weight is not the target's embedding"):
        import_drafter(out, qwen2)
    save_file({**weights, "embed_tokens.weight": qwen2.embed(torch.arange(V))}, out / "model.safetensors")
    assert torch.equal(logits_of(import_drafter(out, qwen2)), logits_of(d))  # its own embedding: loads
    weights = load_file(out / "model.safetensors")
    weights["midlayer.self_attn.o_proj.bias"] += 1.0
    save_file(weights, out / "model.safetensors")
    with pytest.raises(ValueError, match="o_proj.bias is non-zero, but a qwen2 drafter has no such bias"):
        import_drafter(out, qwen2)
    del weights["midlayer.self_attn.o_proj.bias"], weights["fc.weight"]
    save_file(weights, out / "model.safetensors")
    with pytest.raises(ValueError, match=r"does not fit the drafter: missing \['fc.weight'\]"):
        import_drafter(out, qwen2)
    (out / "config.json").write_text(json.dumps({"architectures": ["MedusaModel"], "num_hidden_layers": 1}))
    with pytest.raises(ValueError, match=r"architectures \['MedusaModel'\] is not an EAGLE drafter"):
        import_drafter(out, qwen2)
    with pytest.raises(ValueError, match="config.json not found"):
        import_drafter(tmp_path / "nowhere", qwen2)


# ----------------------------------------------------------------------------------- CLI


def test_cli_export_drafter_writes_a_loadable_export(tmp_path, llama, capsys):
    d = trained_drafter(
        llama, "eagle3", DRAFT_VOCAB
    )  # llama fixture = tiny-llama, seed 0, as the CLI loads it
    ckpt = save_drafter(d, tmp_path / "ckpt")
    out = tmp_path / "eagle"
    assert cli.main(["--threads", "1", "export-drafter", str(ckpt), str(out), "--model", "tiny-llama"]) == 0
    assert (
        f"wrote a eagle3 drafter ({DRAFT_VOCAB} of {V} tokens) for tiny-llama to {out}"
        in capsys.readouterr().out
    )
    assert torch.equal(logits_of(import_drafter(out, llama)), logits_of(load_drafter(ckpt, llama)))
    assert (
        cli.main(["export-drafter", str(ckpt), str(out), "--model", "tiny-llama", "--dtype", "bfloat16"]) == 0
    )
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with pytest.raises(SystemExit, match=r"export-drafter: .*config.json not found"):
        cli.main(["export-drafter", str(tmp_path / "missing"), str(tmp_path / "x"), "--model", "tiny-llama"])
    with pytest.raises(SystemExit, match="drafter config does not match the target: model_type is 'llama'"):
        cli.main(["export-drafter", str(ckpt), str(tmp_path / "y"), "--model", "tiny-qwen2"])


def test_cli_export_drafter_infers_the_target_and_checks_the_kind(tmp_path, llama, capsys):
    ckpt = save_drafter(trained_drafter(llama, "eagle1", DRAFT_VOCAB), tmp_path / "ckpt")
    out = tmp_path / "sglang"
    assert cli.main(["export-drafter", str(ckpt), str(out), "--engine", "sglang"]) == 0  # no --model
    assert f"for tiny-llama to {out}, for sglang" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle"]
    with pytest.raises(
        SystemExit,
        match=r"is an eagle1 drafter and --kind is eagle3: a checkpoint is never converted; "
        r"train an eagle3 drafter \(`tlt-lightning drafter warmup --kind eagle3`\)",
    ):
        cli.main(["export-drafter", str(ckpt), str(tmp_path / "x"), "--kind", "eagle3"])
    (ckpt / "warmup.json").write_text(json.dumps({"model": "tiny-qwen2"}))  # the recorded target wins
    with pytest.raises(SystemExit, match="drafter config does not match the target: model_type is 'llama'"):
        cli.main(["export-drafter", str(ckpt), str(tmp_path / "y")])
    (ckpt / "warmup.json").unlink()
    meta = json.loads((ckpt / CONFIG_NAME).read_text())
    meta["config"]["hidden_size"] = 96
    (ckpt / CONFIG_NAME).write_text(json.dumps(meta))
    with pytest.raises(
        SystemExit,
        match=r"cannot tell the target of .*a llama model with hidden size 96, 4 layers and "
        r"128 tokens, and no registry model matches; pass --model NAME_OR_HF_DIR",
    ):
        cli.main(["export-drafter", str(ckpt), str(tmp_path / "z")])


def test_a_head_size_vllm_cpu_cannot_run_is_exported_with_a_warning(tmp_path, llama):
    d = trained_drafter(llama, "eagle1", None)
    assert d.config.head_dim not in VLLM_CPU_HEAD_SIZES  # tiny models: vLLM-CPU cannot serve them
    with pytest.warns(UserWarning, match=rf"head_dim {d.config.head_dim} .* vLLM on a CPU cannot serve"):
        out = export_drafter_model(d, tmp_path / "vllm")
    assert (out / "config.json").is_file()  # still written: GPU vLLM serves it
    fits = Drafter(dataclasses.replace(d.config, head_dim=64), llama)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        export_drafter_model(fits, tmp_path / "fits")
        export_drafter_model(d, tmp_path / "sglang", engine="sglang")
