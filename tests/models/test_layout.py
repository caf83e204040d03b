import copy
import pickle

import pytest
import torch
from torch import nn

from tlt_lightning import kernels
from tlt_lightning.drafter import Drafter, DrafterConfig
from tlt_lightning.models import HFTarget, load_model, set_weight_layout
from tlt_lightning.models.layout import _PACKABLE, FEW_ROWS_LINEAR, PackedLinear, _packable_dtypes
from tlt_lightning.rollout import RolloutConfig, RolloutEngine
from tlt_lightning.rollout.speculative import SpeculativeRolloutLoop
from tlt_lightning.speculative import DraftSpec


def _linears(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


def _is_column_major(w: torch.Tensor) -> bool:
    return w.stride() == (1, w.shape[0]) and not w.is_contiguous()


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_private_onednn_ops_work_on_the_installed_torch():
    """The packed layout calls private oneDNN ops: this fails on a torch (within the package's range) where
    they stopped matching F.linear, instead of the layout silently falling back."""
    assert torch.float32 in _PACKABLE
    assert _packable_dtypes() == _PACKABLE


class _BrokenOps:
    """An op namespace of a torch whose private ops are gone or changed."""

    def _is_mkldnn_bf16_supported(self) -> bool:
        return True

    def _reorder_linear_weight(self, weight, rows):
        return weight

    def _linear_pointwise(self, x, weight, bias, *args):
        if x.dtype == torch.bfloat16:
            raise RuntimeError("_linear_pointwise() takes 4 arguments")
        return x @ weight.T  # no bias: another result


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_changed_private_ops_fall_back_to_f_linear_with_a_warning():
    with pytest.warns(
        UserWarning, match=r"private oneDNN ops failed a check \(RuntimeError: _linear_pointwise"
    ):
        assert _packable_dtypes(_BrokenOps()) == ()

    class WrongFloat32(_BrokenOps):
        def _is_mkldnn_bf16_supported(self) -> bool:
            return False

    with pytest.warns(UserWarning, match=r"with F.linear in \['torch.float32'\]: .* gave another result"):
        assert _packable_dtypes(WrongFloat32()) == ()


def test_unknown_layouts_are_rejected():
    with pytest.raises(
        ValueError, match=r"weight layout must be one of \('out_in', 'in_out', 'packed'\), got 'auto'"
    ):
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
    for layout in ("out_in", "in_out", "packed"):
        target.set_weight_layout(layout)
        result = engine.generate(prompts, generator=torch.Generator().manual_seed(3))
        runs[layout] = [r.token_ids.tolist() for r in result.rollouts]
    assert runs["in_out"] == runs["out_in"] == runs["packed"]


needs_packing = pytest.mark.skipif(torch.float32 not in _PACKABLE, reason="oneDNN is not available")


@needs_packing
def test_packed_layout_uses_the_packed_copy_in_inference_only(monkeypatch):
    model = load_model("tiny-llama", seed=0).model.eval()
    ids = torch.randint(3, 128, (2, 9))
    before = model(input_ids=ids).logits
    params = {n: p for n, p in model.named_parameters()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    changed = set_weight_layout(model, "packed")
    assert changed == len(_linears(model)) == 4 * 7 + 1  # the tied head is packed too
    assert all(type(m) is PackedLinear for m in _linears(model))
    assert set_weight_layout(model, "packed") == 0  # idempotent
    assert dict(model.named_parameters()) == params  # same Parameters
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=1e-5, atol=1e-5)
    assert len(calls) == 4 * 7 + 1
    calls.clear()
    model(input_ids=ids, labels=ids).loss.backward()  # training takes F.linear and gets gradients
    assert not calls and all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert set_weight_layout(model, "out_in") == changed
    assert all(type(m) is nn.Linear and not hasattr(m, "_packed_weight") for m in _linears(model))


@needs_packing
def test_packed_linear_follows_autocast():
    linear = nn.Linear(16, 8)
    packed = copy.deepcopy(linear)
    set_weight_layout(packed, "packed")
    x = torch.randn(3, 16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = linear(x)  # fp32 weights autocast to bf16: packing would multiply in fp32
        assert packed(x).dtype == expected.dtype == torch.bfloat16
        torch.testing.assert_close(packed(x), expected)
    assert packed._packed_weight._packed is None  # F.linear under autocast
    bf16 = copy.deepcopy(packed).to(torch.bfloat16)
    if torch.bfloat16 in _PACKABLE:  # bf16 weights autocast to bf16: packed, fp32 inputs cast
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            torch.testing.assert_close(bf16(x), linear.to(torch.bfloat16)(x.bfloat16()))
        assert bf16._packed_weight._packed is not None


@pytest.mark.skipif(
    torch.bfloat16 not in _PACKABLE or not kernels.available(), reason="no bf16 packing or C++ kernels here"
)
def test_one_or_two_bf16_rows_multiply_by_the_few_rows_kernel():
    """Once the kernels are loaded, a packed bf16 linear of up to FEW_ROWS_LINEAR rows multiplies by
    few_rows_linear (oneDNN is slow for a row or two); more rows by the packed copy. Same values."""
    linear = nn.Linear(64, 96, dtype=torch.bfloat16)
    packed = copy.deepcopy(linear)
    set_weight_layout(packed, "packed")
    for rows in (1, FEW_ROWS_LINEAR, FEW_ROWS_LINEAR + 1):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        with torch.no_grad(), torch.profiler.profile() as prof:
            got = packed(x)
        names = {e.name for e in prof.events()}
        few = rows <= FEW_ROWS_LINEAR
        assert ("tlt_lightning::few_rows_linear" in names) == few
        assert ("mkldnn::_linear_pointwise" in names) != few
        torch.testing.assert_close(got.float(), linear(x).float(), atol=2e-2, rtol=2e-2)


@needs_packing
def test_packed_copy_follows_optimizer_steps_and_is_not_copied():
    torch.manual_seed(0)
    ids = torch.randint(3, 128, (2, 12))
    model = load_model("tiny-qwen2", seed=0).model
    set_weight_layout(model, "packed")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        with torch.inference_mode():  # a rollout between steps packs the current weights
            packed = model(input_ids=ids).logits
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        model.eval()
        with torch.no_grad():
            after = model(input_ids=ids).logits
        set_weight_layout(model, "out_in")
        with torch.no_grad():
            torch.testing.assert_close(after, model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
        set_weight_layout(model, "packed")
        assert not torch.allclose(after, packed)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        linear = next(m for m in clone.modules() if isinstance(m, PackedLinear))
        assert linear._packed_weight._packed is None  # packed lazily again, never shared
        with torch.no_grad():
            torch.testing.assert_close(clone(input_ids=ids).logits, after, rtol=1e-5, atol=1e-5)


@needs_packing
@pytest.mark.parametrize("arm", [DraftSpec(4), DraftSpec(3, 2, 6)], ids=["chain", "tree"])
def test_speculative_greedy_output_is_the_same_packed(arm):
    target = HFTarget(load_model("tiny-llama", seed=0).model.eval())
    drafter = Drafter(DrafterConfig.from_target(target, draft_vocab_size=64), target).eval()
    config = RolloutConfig(max_new_tokens=32, temperature=0)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [20, 21]]
    plain = [r.token_ids.tolist() for r in RolloutEngine(target, config).generate(prompts).rollouts]
    target.set_weight_layout("packed")
    loop = SpeculativeRolloutLoop(target, drafter, config, strategy=arm, threshold=8)
    result = loop.generate(prompts)
    assert [r.token_ids.tolist() for r in result.rollouts] == plain
    assert drafter.weight_layout == "packed"  # it follows the target: fc and the layer's 7 projections
    assert sum(type(m) is PackedLinear for m in drafter.modules()) == 8
    assert result.stats.mean_accept_length >= 1


@needs_packing
@pytest.mark.parametrize("layout", ["packed", "in_out"])
def test_released_weight_copies_are_remade_on_next_use(layout):
    """An RL step drops the decoding copies between its rollouts and its update: the next rollout remakes
    them, with the same outputs."""
    torch.manual_seed(0)
    target = HFTarget(load_model("tiny-llama", seed=0).model.eval())
    target.set_weight_layout(layout)
    ids = torch.randint(3, 128, (1, 9))
    hidden = torch.randn(4, target.info.hidden_size)
    with torch.inference_mode():
        logits, head = target.model(input_ids=ids).logits, target.lm_head(hidden)
        assert target.release_weight_copies() > 0
        assert target.release_weight_copies() == 0  # nothing left to drop
        torch.testing.assert_close(target.model(input_ids=ids).logits, logits, rtol=0, atol=0)
        torch.testing.assert_close(target.lm_head(hidden), head, rtol=0, atol=0)
    assert target.release_weight_copies() > 0
