import pytest
import torch
from torch import nn

from tlt_lightning.models import HFTarget, load_model, set_weight_layout
from tlt_lightning.rollout import RolloutConfig, RolloutEngine


def _linears(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


def _is_column_major(w: torch.Tensor) -> bool:
    return w.stride() == (1, w.shape[0]) and not w.is_contiguous()


def test_unknown_layouts_are_rejected():
    with pytest.raises(ValueError, match=r"weight layout must be one of \('out_in', 'in_out'\), got 'auto'"):
        set_weight_layout(nn.Linear(2, 3), "auto")


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_relayout_keeps_parameters_values_and_outputs(name):
    model = load_model(name, seed=0).model.eval()
    ids = torch.randint(3, 128, (2, 9))
    before = model(input_ids=ids).logits
    params = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    tied = model.config.tie_word_embeddings
    changed = set_weight_layout(model, "in_out")
    # Every linear except a head tied to the embedding (4 layers x 7 projections, + an untied head).
    assert changed == 4 * 7 + (0 if tied else 1)
    for n, (param, value) in params.items():
        current = dict(model.named_parameters())[n]
        assert current is param and torch.equal(current, value)  # same Parameter, same values
    head = model.get_output_embeddings().weight
    assert _is_column_major(head) != tied and head.is_contiguous() == tied
    assert all(_is_column_major(m.weight) for m in _linears(model.model))
    torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=1e-5, atol=1e-5)
    assert set_weight_layout(model, "in_out") == 0  # idempotent
    assert set_weight_layout(model, "out_in") == changed
    assert all(m.weight.is_contiguous() for m in _linears(model))


def test_training_steps_keep_the_layout_and_match_row_major():
    torch.manual_seed(0)
    ids = torch.randint(3, 128, (2, 12))
    models = [load_model("tiny-qwen2", seed=0).model.train() for _ in range(2)]
    set_weight_layout(models[1], "in_out")
    for model in models:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(2):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
    for (n, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=n)
    assert all(_is_column_major(m.weight) for m in _linears(models[1].model))


def test_tied_head_copy_follows_in_place_updates():
    target = HFTarget(load_model("tiny-llama", seed=0).model.eval())
    assert target.set_weight_layout("in_out") > 0 and target.weight_layout == "in_out"
    hidden = torch.randn(3, 4, target.info.hidden_size)
    weight = target.model.get_output_embeddings().weight
    with torch.no_grad():
        torch.testing.assert_close(target.lm_head(hidden), hidden @ weight.T)
        weight.mul_(2.0)  # an optimizer step: in place, bumps the version
        torch.testing.assert_close(target.lm_head(hidden), hidden @ weight.T)
    # With gradients on, the live weight is used (a training forward through the adapter).
    target.lm_head(hidden).sum().backward()
    assert weight.grad is not None


def test_engine_outputs_do_not_depend_on_the_layout():
    target = HFTarget(load_model("tiny-llama", seed=0).model.eval())
    engine = RolloutEngine(target, RolloutConfig(max_new_tokens=24, temperature=1.0))
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]] * 3
    runs = {}
    for layout in ("out_in", "in_out"):
        target.set_weight_layout(layout)
        result = engine.generate(prompts, generator=torch.Generator().manual_seed(3))
        runs[layout] = [r.token_ids.tolist() for r in result.rollouts]
    assert runs["in_out"] == runs["out_in"]
