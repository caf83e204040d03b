"""DoRA via peft: adapters on the policy and the drafter, merged weights give the same outputs."""

from __future__ import annotations

import pytest
import torch

from tlt_lightning.drafter import Drafter, DrafterConfig
from tlt_lightning.efficiency.dora import DoraConfig, apply_dora, merge_dora  # peft only when applied
from tlt_lightning.models import HFTarget, load_model

pytest.importorskip("peft")
# peft 0.18 still asks transformers for the deprecated name; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


def _perturb_adapters(model: torch.nn.Module) -> int:
    """Random adapter weights: fresh DoRA is the identity (lora_B = 0), merging it would prove nothing."""
    g = torch.Generator().manual_seed(0)
    touched = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(0.2 * torch.randn(p.shape, generator=g))
                touched += 1
    return touched


def test_policy_merge_gives_the_same_outputs():
    base = load_model("tiny-llama", seed=0).model
    keys = list(base.state_dict())
    model = apply_dora(base, DoraConfig(rank=4))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)  # base frozen; magnitudes are lora_ too
    assert any("lora_magnitude_vector" in n for n in trainable)  # DoRA, not plain LoRA
    assert _perturb_adapters(model) == 4 * 7 * 3  # 4 layers x 7 linears x (A, B, magnitude)
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    model.eval()
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        plain = load_model("tiny-llama", seed=0).model(input_ids=ids).logits
    assert (adapted - plain).abs().max() > 0.1  # the adapters do change the model
    merged = merge_dora(model)
    assert type(merged).__name__ == "LlamaForCausalLM" and list(merged.state_dict()) == keys
    with torch.no_grad():
        out = merged(input_ids=ids).logits
    torch.testing.assert_close(out, adapted, rtol=1e-4, atol=1e-4)  # fp32: reassociation only


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_drafter_merge_gives_the_same_outputs(kind):
    target = HFTarget(load_model("tiny-llama", seed=0).model)
    torch.manual_seed(0)
    drafter = Drafter(DrafterConfig.from_target(target, kind), target)
    keys = list(drafter.state_dict())
    model = apply_dora(drafter, DoraConfig(rank=4, trainable_modules=("fc",)))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any(".fc." in n for n in trainable) and any("self_attn.q_proj.lora_A" in n for n in trainable)
    _perturb_adapters(model)
    n, q, H = 2, 6, drafter.config.hidden_size
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(3, 128, (n, q), generator=g)
    hidden = torch.randn(n, q, H, generator=g)
    positions = torch.arange(q).expand(n, q)
    mask = torch.ones(q, q, dtype=torch.bool).tril().expand(n, 1, q, q)
    model.eval()
    with torch.no_grad():
        adapted = model(tokens, hidden, positions, mask)
    merged = merge_dora(model)
    assert isinstance(merged, Drafter) and list(merged.state_dict()) == keys  # exports as before
    with torch.no_grad():
        torch.testing.assert_close(merged(tokens, hidden, positions, mask), adapted, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rank": 0}, "rank must be an int >= 1"),
        ({"alpha": 0}, "alpha must be a positive number"),
        ({"dropout": 1.0}, r"dropout must be a number in \[0, 1\)"),
        ({"target_modules": ()}, "target_modules must name at least one module"),
        ({"target_modules": ("q_proj", "")}, "target_modules must be non-empty module names"),
    ],
)
def test_config_errors_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DoraConfig(**kwargs)


def test_apply_and_merge_errors():
    model = load_model("tiny-llama").model
    with pytest.raises(ValueError, match=r"target_modules \['qkv'\] match no nn.Linear"):
        apply_dora(model, DoraConfig(target_modules=("q_proj", "qkv")))
    with pytest.raises(TypeError, match="model must be a peft.PeftModel"):
        merge_dora(model)
    with pytest.raises(TypeError, match="config must be a DoraConfig"):
        apply_dora(model, {"rank": 4})
