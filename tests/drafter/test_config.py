from __future__ import annotations

import dataclasses

import pytest
from transformers import MistralConfig, MistralForCausalLM

from tlt_lightning.drafter import DrafterConfig
from tlt_lightning.models import HFTarget


def test_from_target_llama(llama):
    cfg = DrafterConfig.from_target(llama)
    assert (cfg.kind, cfg.model_type, cfg.hidden_size, cfg.vocab_size) == ("eagle1", "llama", 64, 128)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size) == (
        4,
        2,
        16,
        128,
    )
    assert cfg.feature_layers == (4,) and cfg.rollout_feature_layers == (4,)
    assert not cfg.attention_bias and cfg.rope_parameters["rope_theta"] == 10000.0
    assert cfg.draft_vocab == 128 and not cfg.reduced_vocab


def test_from_target_qwen2_eagle3(qwen2):
    cfg = DrafterConfig.from_target(qwen2, "eagle3", draft_vocab_size=32)
    assert cfg.attention_bias and not cfg.o_proj_bias
    assert cfg.feature_layers == (1, 2, 3) and cfg.rollout_feature_layers == (1, 2, 3, 4)
    assert cfg.draft_vocab == 32 and cfg.reduced_vocab


def test_full_draft_vocab_is_normalised_to_none(llama):
    assert DrafterConfig.from_target(llama, draft_vocab_size=128).draft_vocab_size is None


def test_unsupported_model_type_raises():
    cfg = MistralConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    target = HFTarget(MistralForCausalLM(cfg))
    with pytest.raises(ValueError, match=r"'mistral'.*supported: \('llama', 'qwen2'\)"):
        DrafterConfig.from_target(target)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"kind": "medusa"}, r"kind must be one of .*'medusa'"),
        ({"hidden_size": 0}, r"hidden_size must be a positive int, got 0"),
        ({"num_key_value_heads": 3}, r"num_key_value_heads must divide num_attention_heads \(4\), got 3"),
        ({"draft_vocab_size": 500}, r"draft_vocab_size must be <= vocab_size \(128\)"),
        ({"feature_layers": (4, 5)}, r"feature_layers must have 1 entries for kind 'eagle1'"),
        ({"feature_layers": (2,)}, r"feature_layers must be \(4,\) \(the final state\)"),
        (
            {"kind": "eagle3", "feature_layers": (1, 2, 9)},
            r"feature_layers must lie in \[0, num_target_layers=4\]",
        ),
        ({"rope_parameters": {"rope_type": "default"}}, r"rope_theta'\] must be a positive number, got None"),
        ({"hidden_act": "swish2"}, r"hidden_act must be one of"),
        ({"rms_norm_eps": 0}, r"rms_norm_eps must be a float in \(0, 1\)"),
    ],
)
def test_validation_names_field_and_value(llama, change, match):
    cfg = DrafterConfig.from_target(llama)
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(cfg, **change)


def test_dict_round_trip_and_unknown_fields(qwen2):
    cfg = DrafterConfig.from_target(qwen2, "eagle3", 40)
    assert DrafterConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match=r"unknown drafter config fields \['bogus'\]"):
        DrafterConfig.from_dict({**cfg.to_dict(), "bogus": 1})
    data = cfg.to_dict()
    del data["hidden_size"]
    with pytest.raises(ValueError, match="invalid drafter config.*hidden_size"):
        DrafterConfig.from_dict(data)


def test_check_target_names_mismatch(llama, qwen2):
    cfg = DrafterConfig.from_target(llama)
    with pytest.raises(ValueError, match="model_type is 'llama', target has 'qwen2'"):
        cfg.check_target(qwen2)
