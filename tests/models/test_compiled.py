"""The compiled decode path (``HFTarget(decode="compiled")``) emits what the eager paths emit.

Compiling costs seconds per graph on the tiny models (more on a cold Inductor cache), so the fast
tests share one compiled target per model and kind of graph whose query bucket (8 queries, features
of the last layer) serves plain decoding, chain and tree verification alike: every call pads its
queries, and with static graphs its rows (to 16) and keys (to 256), which is what these tests are after.
"""

import copy
import logging
from dataclasses import replace

import pytest
import torch
from torch._dynamo import eval_frame
from torch._dynamo.utils import counters
from transformers import MistralConfig, MistralForCausalLM

from tests.models.test_attention import head_dim_64_qwen2
from tests.rollout.test_engine import random_prompts
from tlt_lightning import kernels
from tlt_lightning.drafter import Drafter, DrafterConfig
from tlt_lightning.models import CompileConfig, HFTarget, compiled, load_model
from tlt_lightning.models.compiled import Bucket, CompiledDecode, forward, guards
from tlt_lightning.rollout import RolloutConfig, RolloutEngine
from tlt_lightning.rollout.engine import causal_decode_mask
from tlt_lightning.rollout.speculative import SpeculativeRolloutLoop
from tlt_lightning.speculative import DraftSpec

SHARED = CompileConfig(batch_buckets=(16,), query_buckets=(8,), kv_step=256, dynamic=False)
DYNAMIC = CompileConfig(batch_buckets=(16,), query_buckets=(8,), dynamic=True)


@pytest.fixture(scope="module", params=[SHARED, DYNAMIC], ids=["static", "dynamic"])
def compiled_pair(tiny_target, request) -> tuple[HFTarget, HFTarget]:
    """The fixture's model behind transformers' path and behind the compiled one (one module, not mutated)."""
    return tiny_target, HFTarget(tiny_target.model, decode="compiled", compile_config=request.param)


def expected_graphs(target: HFTarget, features: tuple[int, ...]) -> set[Bucket]:
    """The graphs the shared bucket may compile: the static bucket, or the dynamic graph (and one of one
    row)."""
    if not target._compiled.dynamic:
        return {Bucket(16, 8, 256, features)}
    return {Bucket(0, 8, 0, features), Bucket(0, 8, 0, features, all_slots=True), Bucket(1, 8, 0, features)}


def features_of(target: HFTarget) -> tuple[int, ...]:
    return (
        target.info.num_layers,
    )  # what an EAGLE-1 drafter reads: plain and speculative steps share a graph


def no_warnings(caplog) -> None:
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_plain_greedy_decode_equals_transformers(compiled_pair, caplog):
    """12 requests x 40 tokens, rows leaving the batch as they finish: token for token, features close."""
    hf, compiled = compiled_pair
    config = RolloutConfig(max_new_tokens=40, temperature=0.0, feature_layers=features_of(hf))
    prompts = random_prompts(12, seed=5)
    expected = RolloutEngine(hf, config).generate(prompts)
    with caplog.at_level(logging.INFO, logger="tlt_lightning.models.compiled"):
        result = RolloutEngine(compiled, config).generate(prompts)
    for a, b in zip(expected.rollouts, result.rollouts):
        assert a.token_ids.tolist() == b.token_ids.tolist()
        torch.testing.assert_close(a.features, b.features, rtol=1e-4, atol=1e-5)
    assert set(compiled.compile_times) <= expected_graphs(compiled, features_of(hf))
    assert compiled._compiled.graph_calls[
        compiled._compiled.graph(compiled._compiled.bucket(12, 1, 30, features_of(hf)))
    ]
    no_warnings(caplog)


@pytest.mark.parametrize("arm", [DraftSpec(4), DraftSpec(3, 3, 6), DraftSpec(3, 2, sampled=True)], ids=str)
def test_chain_and_tree_verification_equal_plain_greedy(compiled_pair, arm, caplog):
    """Speculative greedy verifying through the graphs (chains of 5, trees of 7 tokens) equals plain
    greedy."""
    hf, compiled = compiled_pair
    drafter = Drafter(DrafterConfig.from_target(hf, draft_vocab_size=96), hf)
    prompts = random_prompts(10, seed=13)
    config = RolloutConfig(max_new_tokens=60, temperature=0.0)
    plain = RolloutEngine(hf, config).generate(prompts)
    with caplog.at_level(logging.WARNING):
        result = SpeculativeRolloutLoop(compiled, drafter, config, arm, threshold=1000).generate(prompts)
    assert all(s.token_ids.tolist() == p.token_ids.tolist() for s, p in zip(result.rollouts, plain.rollouts))
    assert all(result.stats.step_speculative)
    assert set(compiled.compile_times) <= expected_graphs(compiled, features_of(hf))  # reused, not recompiled
    no_warnings(caplog)


def decode_once(
    target: HFTarget,
    lens: torch.Tensor,
    q: int = 3,
    grad: bool = False,
    max_len: int = 32,
    rows: int | None = None,
) -> torch.Tensor:
    """One forward of ``q`` tokens per row after a prefill of ``lens`` tokens (cache of ``rows``, default one
    per row, of ``max_len``); ``[n, q, H]``."""
    n, width = lens.numel(), int(lens.max())
    cache = target.new_cache(rows or n, max_len)
    slots = torch.arange(width)
    mask = (slots[None, None, :] <= slots[None, :, None]) & (slots[None, None, :] < lens[:, None, None])
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        target.forward(
            torch.randint(3, 128, (n, width), generator=g), slots.expand(n, width), mask[:, None], cache
        )
    cache.lengths[:n] = lens
    positions = lens[:, None] + torch.arange(q)
    mask = causal_decode_mask(lens, q, int(positions.max()) + 1)
    ids = torch.randint(3, 128, (n, q), generator=g)
    with torch.set_grad_enabled(grad):
        return target.forward(ids, positions, mask, cache, feature_layers=features_of(target)).hidden


def test_weights_updated_after_compiling_are_followed(tiny_llama, fresh_compile):
    """The RL case: an optimizer changes the weights in place; the graph reads them (and their packed
    copies) anew."""
    model = copy.deepcopy(tiny_llama.model)  # never change the shared fixture's weights
    hf = HFTarget(model)
    compiled = HFTarget(model, decode="compiled", compile_config=SHARED)
    lens = torch.tensor([5, 9])
    before = decode_once(compiled, lens)
    torch.testing.assert_close(before, decode_once(hf, lens), rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)  # in place, as optimizer.step() does
    expected = decode_once(hf, lens)
    assert not torch.allclose(before, expected, atol=1e-3)
    torch.testing.assert_close(decode_once(compiled, lens), expected, rtol=1e-4, atol=1e-5)
    assert len(compiled._compiled.compile_times) == 1


@pytest.mark.parametrize("config", [SHARED, DYNAMIC], ids=["static", "dynamic"])
def test_graphs_never_serve_another_model_of_the_same_shapes(tiny_llama, config):
    """The graphs skip dynamo's guards on the model's modules: a second model of the same shapes whose
    norms differ in a plain attribute (their epsilon, baked into a graph) gets graphs of its own, not
    the first's."""
    other = copy.deepcopy(tiny_llama.model)
    for module in other.modules():
        if hasattr(module, "variance_epsilon"):
            module.variance_epsilon = 0.5
    lens = torch.tensor([5, 9])
    for model in (tiny_llama.model, other):
        expected = decode_once(HFTarget(model), lens)
        compiled = HFTarget(model, decode="compiled", compile_config=config)
        torch.testing.assert_close(decode_once(compiled, lens), expected, rtol=1e-4, atol=1e-5)
        assert sum(compiled._compiled.graph_calls.values()) == 1
    assert not torch.allclose(
        decode_once(HFTarget(other), lens), decode_once(HFTarget(tiny_llama.model), lens)
    )


@pytest.mark.parametrize("change", ["dtype", "layout"])
def test_weights_of_another_dtype_or_layout_get_new_graphs(change, caplog):
    """The graphs skip dynamo's guards on the model's modules: weights moved to another dtype, or laid out
    column-major (a one-row bf16 graph reads them as they are), are noticed and compiled for anew."""
    model = load_model("tiny-qwen2", dtype="float32" if change == "dtype" else "bfloat16", seed=0).model
    compiled = HFTarget(model, decode="compiled", compile_config=DYNAMIC)
    lens = torch.tensor([7])
    decode_once(compiled, lens, q=1)
    if change == "dtype":
        model.to(torch.bfloat16)
    else:
        compiled.set_weight_layout("in_out")
    with caplog.at_level(logging.WARNING, logger="tlt_lightning.models.compiled"):
        got = decode_once(compiled, lens, q=1).float()
    expected = decode_once(HFTarget(model), lens, q=1).float()
    assert (got - expected).abs().max() <= 5e-2 * expected.abs().max()
    assert "changed dtype, device or layout; compiling new graphs" in caplog.text


def test_the_packed_layout_shares_its_packed_weights(tiny_llama):
    model = copy.deepcopy(tiny_llama.model)
    target = HFTarget(model, decode="compiled", compile_config=SHARED)
    target.set_weight_layout("packed")
    packed = target._compiled._packed()
    o_proj = model.model.layers[0].self_attn.o_proj
    assert packed["layers.0.self_attn.o_proj"] is o_proj._packed_weight.packed(o_proj.weight)
    # Only the merged projections (q/k/v, gate/up) have copies of their own: one per layer and group.
    assert len(target._compiled._own_packs) == 2 * len(model.model.layers)
    assert all("+" in name for name in target._compiled._own_packs)


@pytest.mark.parametrize("merge", [True, False])
def test_merged_projections_are_one_product_of_the_stacked_weights(merge, monkeypatch):
    """A layer's q/k/v and gate/up projections are two products (4 a layer with o and down, 7 unmerged),
    equal to the separate ones up to rounding; q/k/v biases (Qwen2) are merged too."""
    calls = count_calls(monkeypatch, "packed_linear")
    model = load_model("tiny-qwen2", seed=0).model
    target = HFTarget(model, decode="compiled", compile_config=replace(DYNAMIC, merged_projections=merge))
    lens = torch.tensor([5, 9])
    torch.testing.assert_close(
        decode_once(target, lens), decode_once(HFTarget(model), lens), rtol=1e-4, atol=1e-5
    )
    assert len(calls) == (4 if merge else 7) * len(model.model.layers)  # one trace


def test_shapes_outside_the_buckets_fall_back_with_one_warning(tiny_llama, caplog):
    """Too many rows, too many queries, autograd: the eager result, one warning per kind, nothing compiled."""
    config = CompileConfig(batch_buckets=(1,), query_buckets=(1,))
    compiled = HFTarget(tiny_llama.model, decode="compiled", compile_config=config)
    lens = torch.tensor([4, 7])
    with caplog.at_level(logging.WARNING, logger="tlt_lightning.models.compiled"):
        for _ in range(2):
            torch.testing.assert_close(
                decode_once(compiled, lens), decode_once(tiny_llama, lens), rtol=0, atol=0
            )
        out = decode_once(compiled, lens[:1], grad=True)
    assert out.requires_grad
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert (
        "2 rows x 3 new tokens is outside the buckets (batch_buckets=(1,), query_buckets=(1,))" in messages[0]
    )
    assert "the graphs run without autograd" in messages[1]
    assert compiled.compile_seconds == 0 and not compiled._compiled.compile_times


def test_a_cache_without_spare_room_falls_back(tiny_llama, caplog):
    compiled = HFTarget(tiny_llama.model, decode="compiled", compile_config=SHARED)
    cache = tiny_llama.new_cache(2, 16)  # no spare slot for padding
    positions = torch.tensor([[3], [5]])
    mask = causal_decode_mask(torch.tensor([3, 5]), 1, 6)
    cache.begin_step(2, positions)
    with caplog.at_level(logging.WARNING), torch.no_grad():
        assert compiled._compiled(torch.tensor([[4], [5]]), positions, mask, cache) is None
    assert "the cache has no room for the bucket's padding" in caplog.text


def test_unsupported_models_decode_eagerly_with_a_warning(tiny_llama, caplog):
    small = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
    }
    with caplog.at_level(logging.WARNING):
        mistral = HFTarget(MistralForCausalLM(MistralConfig(**small)), decode="compiled")
    assert mistral.decode == "hf" and mistral.compile_seconds == 0
    assert (
        "decode='compiled' is not available for this model (decode='lean' supports decoder layers"
        in caplog.text
    )
    model = copy.deepcopy(tiny_llama.model)
    layer = model.model.layers[0].mlp
    layer.up_proj = type("WrappedLinear", (torch.nn.Linear,), {})(
        layer.up_proj.in_features, layer.up_proj.out_features, bias=False
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        wrapped = HFTarget(model, decode="compiled")
    assert wrapped.decode == "lean"
    assert "layers.0.mlp.up_proj is WrappedLinear; use decode='lean'" in caplog.text


def test_new_cache_has_room_for_the_buckets(tiny_llama):
    config = CompileConfig(batch_buckets=(4, 8), kv_step=16, dynamic=False)
    cache = HFTarget(tiny_llama.model, decode="compiled", compile_config=config).new_cache(5, 20)
    assert cache.keys.shape[1] == 8 and cache.keys.shape[3] == 33 and cache.max_len == 20
    static = CompiledDecode(tiny_llama.model, CompileConfig(query_buckets=(1, 2, 4, 8, 16), dynamic=False))
    assert static.bucket(3, 5, 300, (4,)) == static.graph(Bucket(4, 8, 512, (4,))) == Bucket(4, 8, 512, (4,))
    # By default every query count up to 16 is its own bucket: no padded queries.
    exact = CompiledDecode(tiny_llama.model, CompileConfig(dynamic=False))
    assert exact.bucket(3, 5, 300, (4,)) == Bucket(4, 5, 512, (4,))
    # Dynamic graphs (the CPU default): rows and keys as they are, one spare slot for padded queries.
    dynamic = HFTarget(tiny_llama.model, decode="compiled", compile_config=replace(config, dynamic=None))
    assert dynamic._compiled.dynamic
    cache = dynamic.new_cache(5, 20)
    assert cache.keys.shape[1] == 5 and cache.keys.shape[3] == 21
    assert dynamic._compiled.bucket(3, 5, 300, (4,)) == Bucket(3, 5, 300, (4,))
    assert dynamic._compiled.graph(Bucket(3, 5, 300, (4,))) == Bucket(0, 5, 0, (4,))
    assert dynamic._compiled.graph(Bucket(1, 5, 300, (4,))) == Bucket(1, 5, 0, (4,))
    assert dynamic._compiled.bucket(9, 1, 30) is None  # rows beyond the largest batch bucket


@pytest.mark.parametrize("skip_guards", [False, True], ids=["guarded", "skip-guards"])
def test_dynamic_graphs_serve_every_row_count_and_length_without_recompiling(
    tiny_llama, fresh_compile, skip_guards
):
    """One graph for every row count above one, key length and cache size (and one for a single row), and
    one more reading all of the cache's slots where it is at most all_slots_ratio times the keys; any
    recompile would show in dynamo's count of graphs, and in compile_times.

    Guarded, dynamo's guards pass for every call after the first of a graph: skipping them (the default,
    which this checks next) changes nothing."""
    config = CompileConfig(query_buckets=(4,), skip_guards=skip_guards)
    compiled = HFTarget(tiny_llama.model, decode="compiled", compile_config=config)
    graphs = counters["stats"]["unique_graphs"]
    cases = (
        ([5, 9], 32, None),
        ([3, 4, 6, 2, 7], 20, 8),
        ([12] * 9, 40, None),
        ([4], 32, 3),
        ([4], 9, None),
        ([5, 9], 28, 6),
        ([20, 1, 1], 24, None),
        ([5, 9], 16, 3),
        ([9, 2, 4, 1], 13, None),
    )  # the last three read all slots (25 for 23 keys...)
    for lens, max_len, rows in cases:
        lens = torch.tensor(lens)
        torch.testing.assert_close(
            decode_once(compiled, lens, max_len=max_len, rows=rows),
            decode_once(tiny_llama, lens),
            rtol=1e-4,
            atol=1e-5,
        )
    features = features_of(tiny_llama)
    all_slots = Bucket(0, 4, 0, features, all_slots=True)
    assert set(compiled.compile_times) == {Bucket(0, 4, 0, features), Bucket(1, 4, 0, features), all_slots}
    assert counters["stats"]["unique_graphs"] - graphs == 3
    assert compiled._compiled.graph_calls[all_slots] == 3
    guarded = compiled._compiled._guarded.values()
    assert [len(guards.cache_entries(own)) for own, _ in guarded] == [1, 1, 1]
    assert len(compiled._compiled._direct) == (3 if skip_guards else 0)


def test_calls_skip_guards_only_into_graphs_compiled_for_their_inputs(tiny_llama, fresh_compile):
    """A static graph is compiled for its cache's shape, and Inductor's kernels for the thread count: a
    cache of another size, or another thread count, never reaches the guard-free call of a graph built
    for others."""
    compiled = HFTarget(tiny_llama.model, decode="compiled", compile_config=SHARED)
    lens = torch.tensor([5, 9])
    expected = decode_once(tiny_llama, lens)
    threads = torch.get_num_threads()
    try:
        for max_len, n_threads in ((32, 1), (32, 1), (300, 1), (32, 2)):
            torch.set_num_threads(n_threads)
            torch.testing.assert_close(
                decode_once(compiled, lens, max_len=max_len), expected, rtol=1e-4, atol=1e-5
            )
    finally:
        torch.set_num_threads(threads)
    assert len(compiled._compiled._direct) == 3
    assert sum(compiled._compiled.graph_calls.values()) == 4


def skip_guards_warning(problem: str) -> str:
    return (
        f"CompileConfig.skip_guards needs {guards.DEBUG_API}, which {problem} "
        f"under torch {torch.__version__}; "
        "compiled graphs keep dynamo's guards (same results, slower calls)"
    )


def test_without_dynamos_debug_api_the_graphs_keep_their_guards(tiny_llama, monkeypatch, caplog):
    """A torch without the private API guard-free calls read compiled code through: one warning naming it and
    the torch version, then every call through dynamo's guards, with the eager results."""
    monkeypatch.delattr(eval_frame, guards.DEBUG_API.rsplit(".", 1)[1])
    monkeypatch.setattr(guards, "_warned", set())
    target = HFTarget(tiny_llama.model, decode="compiled", compile_config=DYNAMIC)
    lens = torch.tensor([5, 9])
    expected = decode_once(tiny_llama, lens)
    with caplog.at_level(logging.WARNING, logger="tlt_lightning.models.compiled"):
        for _ in range(3):
            torch.testing.assert_close(decode_once(target, lens), expected, rtol=1e-4, atol=1e-5)
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("tlt_lightning")]
    assert ours == [skip_guards_warning("is missing")]
    assert not target._compiled._direct and sum(target._compiled.graph_calls.values()) == 3
    assert len(target._compiled.compile_times) == 1  # guarded calls reuse the graph


def takes_a_frame_now(code):
    raise TypeError("expected a frame")


@pytest.mark.parametrize(
    ("api", "problem"),
    [
        (takes_a_frame_now, "failed (TypeError: expected a frame)"),
        (lambda code: (), "returned 'tuple', not a list"),
        (lambda code: [object()], "returned entries of type 'object' without a code object"),
    ],
    ids=["raises", "no-list", "no-code"],
)
def test_a_changed_debug_api_means_guarded_calls_and_one_warning(api, problem, monkeypatch, caplog):
    monkeypatch.setattr(eval_frame, guards.DEBUG_API.rsplit(".", 1)[1], api)
    monkeypatch.setattr(guards, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="tlt_lightning.models.compiled"):
        assert guards.guard_free(random_prompts) is None and guards.guard_free(random_prompts) is None
    assert [r.getMessage() for r in caplog.records] == [skip_guards_warning(problem)]


def test_layer_views_are_made_once_per_cache(tiny_llama, monkeypatch):
    """CUDA graphs write the per-layer cache views in place: the graphs must get the same, static-marked
    tensors every step (a fresh ``unbind`` each step made new inputs, and CUDA skipped the graphs)."""
    marked = []
    monkeypatch.setattr(torch._dynamo, "mark_static_address", marked.append)
    decode = CompiledDecode(tiny_llama.model)
    decode._cudagraphs = True  # as on CUDA in "reduce-overhead" mode
    cache = decode.new_cache(4, 2, 2, 20, 16)
    keys, values = decode.layer_views(cache)
    assert len(keys) == len(values) == 4 and keys[1].data_ptr() == cache.keys[1].data_ptr()
    assert len(marked) == 8 and all(t is m for t, m in zip(keys + values, marked))
    again = decode.layer_views(cache)
    assert all(a is b for a, b in zip(again[0] + again[1], keys + values)) and len(marked) == 8
    other = decode.new_cache(4, 2, 2, 20, 16)
    assert decode.layer_views(other)[0][0].data_ptr() == other.keys[0].data_ptr() and len(marked) == 16


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"batch_buckets": ()},
            r"batch_buckets must be a non-empty, strictly increasing tuple of positive ints, got \(\)",
        ),
        ({"batch_buckets": (4, 2)}, r"batch_buckets must be .* got \(4, 2\)"),
        (
            {"query_buckets": (1, 128)},
            r"query_buckets must be buckets of at most 64 queries .*, got \(1, 128\)",
        ),
        ({"kv_step": 0}, "kv_step must be a positive int, got 0"),
        ({"all_slots_ratio": -1.0}, r"all_slots_ratio must be >= 0 \(0: never read all slots\), got -1.0"),
        ({"mode": "fast"}, r"mode must be None or one of \('default', 'reduce-overhead'"),
    ],
)
def test_bad_compile_configs_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CompileConfig(**kwargs)


@pytest.mark.slow
def test_compiled_rollouts_equal_transformers_on_smollm2():
    """SmolLM2-135M, real countdown prompts, fp32 greedy: the compiled path emits the same tokens."""
    from tlt_lightning.rl.tasks import task_prompts

    loaded = load_model("smollm2-135m", dtype="float32")
    prompts = task_prompts(loaded.tokenizer, "countdown", 4, seed=0)
    config = RolloutConfig(max_new_tokens=48, temperature=0.0)
    hf = HFTarget(loaded.model)
    compiled = HFTarget(
        loaded.model, decode="compiled", compile_config=CompileConfig(batch_buckets=(4,), query_buckets=(1,))
    )
    results = [RolloutEngine(t, config).generate(prompts) for t in (hf, compiled)]
    for a, b in zip(*(r.rollouts for r in results)):
        assert a.token_ids.tolist() == b.token_ids.tolist()
    graphs = {Bucket(0, 1, 0, ()), Bucket(0, 1, 0, (), all_slots=True), Bucket(1, 1, 0, ())}
    assert compiled._compiled.graph_calls and set(compiled._compiled.graph_calls) <= graphs


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_compiled_drafter_steps_change_no_emitted_token(compiled_pair, kind, caplog):
    """The drafter's step through the same mechanism: greedy speculative output still equals plain greedy,
    and its graphs were used (compiled, no fallback)."""
    hf, compiled = compiled_pair
    torch.manual_seed(0)
    drafter = Drafter(DrafterConfig.from_target(hf, kind=kind, draft_vocab_size=96), hf)
    eager_drafts = copy.deepcopy(drafter)
    drafter.use_compiled_steps(compiled._compiled.config)
    prompts = random_prompts(10, seed=13)
    config = RolloutConfig(max_new_tokens=40, temperature=0.0)
    plain = RolloutEngine(hf, config).generate(prompts)
    arm = DraftSpec(3, 2, 6)
    with caplog.at_level(logging.WARNING):
        result = SpeculativeRolloutLoop(compiled, drafter, config, arm, threshold=1000).generate(prompts)
    reference = SpeculativeRolloutLoop(hf, eager_drafts, config, arm, threshold=1000).generate(prompts)
    assert all(s.token_ids.tolist() == p.token_ids.tolist() for s, p in zip(result.rollouts, plain.rollouts))
    assert drafter._compiled.graph_calls and not drafter._compiled._warned
    no_warnings(caplog)
    # Same drafts up to rounding: acceptance within a few percent of the eager drafter's.

    def mean(r):
        return float(r.stats.accept_lengths.float().mean())

    assert mean(result) == pytest.approx(mean(reference), rel=0.1)


@pytest.mark.parametrize("config", [SHARED, DYNAMIC], ids=["static", "dynamic"])
@pytest.mark.parametrize(
    ("name", "dtype", "tolerance"), [("tiny-llama", "float32", 1e-5), ("tiny-qwen2", "bfloat16", 5e-2)]
)
def test_hidden_states_within_the_documented_tolerance(name, dtype, tolerance, config):
    """models.compiled's documented tolerance: largest difference / largest |hidden| (decode, 3 rows of
    3 tokens)."""
    model = load_model(name, dtype=dtype, seed=0).model
    hf, compiled = HFTarget(model), HFTarget(model, decode="compiled", compile_config=config)
    lens = torch.tensor([5, 9, 3])
    expected, got = decode_once(hf, lens).float(), decode_once(compiled, lens).float()
    assert sum(compiled._compiled.graph_calls.values()) == 1
    assert (got - expected).abs().max() <= tolerance * expected.abs().max()


def test_row_gemv_is_f_linear():
    g = torch.Generator().manual_seed(0)
    x, weight, bias = (
        torch.randn(*s, generator=g, dtype=torch.bfloat16) for s in ((1, 1, 64), (48, 64), (48,))
    )
    expected = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
    for b, extra in ((bias, 0), (None, bias.float())):
        got = compiled.row_gemv(x, weight, b)
        assert got.shape == (1, 1, 48) and got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float() + extra, expected, atol=0.05, rtol=0.02)


def count_calls(monkeypatch, name: str) -> list[int]:
    """Wrap ``models.compiled.forward.<name>`` (what the traced function calls) so that each call (each trace,
    inside a graph) appends to the returned list."""
    calls: list[int] = []
    real = getattr(forward, name)
    monkeypatch.setattr(forward, name, lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.mark.parametrize("row_gemv", [True, False])
def test_one_row_bf16_decode_takes_row_gemv_within_the_tolerance(row_gemv, monkeypatch, fresh_compile):
    """A graph of one row of one token multiplies by row_gemv in bf16 (unless turned off); same tolerance."""
    calls = count_calls(monkeypatch, "row_gemv")
    model = load_model("tiny-qwen2", dtype="bfloat16", seed=0).model
    config = CompileConfig(batch_buckets=(1,), query_buckets=(1,), row_gemv=row_gemv)
    hf, target = HFTarget(model), HFTarget(model, decode="compiled", compile_config=config)
    lens = torch.tensor([7])
    expected, got = decode_once(hf, lens, q=1).float(), decode_once(target, lens, q=1).float()
    assert target.compile_seconds > 0
    assert bool(calls) == row_gemv  # traced once per linear when on, never when off
    assert (got - expected).abs().max() <= 5e-2 * expected.abs().max()


@pytest.mark.parametrize("matmul_attention", [True, False])
def test_graphs_of_several_rows_attend_by_matmul_on_a_cpu(matmul_attention, monkeypatch, fresh_compile):
    """Several rows: grouped_matmul_attention (unless turned off); one row: the flash kernel. Same
    tolerance."""
    calls = count_calls(monkeypatch, "grouped_matmul_attention")
    model = load_model("tiny-qwen2", dtype="bfloat16", seed=0).model
    config = CompileConfig(query_buckets=(4,), matmul_attention=matmul_attention)
    hf, target = HFTarget(model), HFTarget(model, decode="compiled", compile_config=config)
    traced = []
    for lens in (torch.tensor([7]), torch.tensor([7, 3, 9])):
        expected, got = decode_once(hf, lens).float(), decode_once(target, lens).float()
        assert (got - expected).abs().max() <= 5e-2 * expected.abs().max()
        traced.append(len(calls))  # traced once per layer when the graph compiles
    assert len(target.compile_times) == 2
    assert traced == ([0, model.config.num_hidden_layers] if matmul_attention else [0, 0])


@pytest.mark.skipif(not kernels.available(), reason="the C++ kernel did not build here")
@pytest.mark.parametrize("cpp_attention", [True, False])
def test_bf16_graphs_attend_by_the_cpp_kernel_within_the_tolerance(cpp_attention, fresh_compile):
    """Head dim 64 in bf16: graphs of one row and of several attend by the C++ kernel (unless turned off),
    which the profiler sees; hidden states within the documented tolerance either way."""
    model = head_dim_64_qwen2()
    compile_config = CompileConfig(query_buckets=(4,), cpp_attention=cpp_attention)
    hf, target = HFTarget(model), HFTarget(model, decode="compiled", compile_config=compile_config)
    for lens in (torch.tensor([7]), torch.tensor([7, 3, 9])):
        expected, got = (
            decode_once(hf, lens).float(),
            decode_once(target, lens).float(),
        )  # the latter compiles
        assert (got - expected).abs().max() <= 5e-2 * expected.abs().max()
        with torch.profiler.profile() as prof:
            decode_once(
                target, lens
            )  # an eager prefill (which attends by the kernel: models.attention), a graph call
        kernel_calls = [e for e in prof.events() if e.name == "tlt_lightning::decode_attention"]
        assert len(kernel_calls) == model.config.num_hidden_layers * (2 if cpp_attention else 1)
    assert len(target.compile_times) == 2


@pytest.mark.skipif(not kernels.available(), reason="the C++ kernels did not build here")
@pytest.mark.parametrize("few_rows_linear", [True, False])
def test_few_tokens_multiply_by_the_few_rows_kernel(few_rows_linear, fresh_compile):
    """A verify of one row (3 tokens), or a decode step of 2 rows, in bf16 multiplies by few_rows_linear
    (unless turned off), which the profiler sees once per linear; 3 rows of 3 tokens keep oneDNN. Hidden
    states within the tolerance either way."""
    model = load_model("tiny-qwen2", dtype="bfloat16", seed=0).model
    config = CompileConfig(query_buckets=(1, 3), few_rows_linear=few_rows_linear)
    hf, target = HFTarget(model), HFTarget(model, decode="compiled", compile_config=config)
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.get_decoder().modules())
    for lens, q, few in (
        (torch.tensor([7]), 3, True),
        (torch.tensor([7, 3]), 1, True),
        (torch.tensor([7, 3, 9]), 3, False),
    ):
        expected, got = decode_once(hf, lens, q).float(), decode_once(target, lens, q).float()  # compiles
        assert (got - expected).abs().max() <= 5e-2 * expected.abs().max()
        with torch.profiler.profile() as prof:
            decode_once(target, lens, q)
        calls = [e for e in prof.events() if e.name == "tlt_lightning::few_rows_linear"]
        assert len(calls) == (linears if few_rows_linear and few else 0)
