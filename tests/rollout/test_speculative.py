"""Speculative rollouts are lossless: same tokens under greedy, same distribution under sampling."""

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from scipy.stats import chisquare
from transformers import LlamaConfig, LlamaForCausalLM

from tests.rollout.test_engine import random_prompts
from tlt_lightning.drafter import Drafter, DrafterConfig, DrafterLoss, warmup_drafter
from tlt_lightning.models import CompileConfig, HFTarget
from tlt_lightning.models.kv_cache import KVCache
from tlt_lightning.rollout import RolloutConfig, RolloutEngine
from tlt_lightning.rollout.speculative import SpeculativeRolloutLoop
from tlt_lightning.speculative import DraftSpec, SamplingParams, sampling_probs

BOS = 1
SAMPLED = DraftSpec(3, 2, sampled=True)  # two sampled chains of 3 forking at the root
FORKED = DraftSpec(3, 2, sampled=True, fork_depth=2)  # forks at its first two levels: four chains of 3
EARLY = DraftSpec(6, min_confidence=0.3)  # a chain of up to 6 that stops once the drafter doubts it


class _ShiftedCache(KVCache):
    """The oracle's cache: drafter position ``p`` sits at slot ``p + 1``, so a row's last entry is
    at slot ``lengths``, one past what :meth:`KVCache.move_rows` copies."""

    def move_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.lengths[src] += 1
        super().move_rows(src, dst)
        self.lengths[src] -= 1
        self.lengths[dst] -= 1


class OracleDrafter:
    """Drafts with the target itself, so its draft distribution equals the target's.

    Used with ``drafter_context="prompt"``. A pair at drafter position ``p`` is ``(f_p, x_{p+1})``:
    the oracle reads ``x_{p+1}`` at target position ``p + 1`` in a full target cache of its own. It
    needs ``x_0``, which it takes to be ``BOS``: the prompts of the tests using it start with ``BOS``.
    """

    weight_layout = "out_in"  # its weights are the target's

    def __init__(self, target: HFTarget) -> None:
        self.target = target
        self.config = SimpleNamespace(feature_layers=(target.info.num_layers,))

    def set_weight_layout(self, layout):
        self.weight_layout = layout
        return 0

    def new_cache(self, max_batch, max_len):
        i = self.target.info
        return _ShiftedCache(
            i.num_layers, max_batch, i.num_kv_heads, max_len + 1, i.head_dim, self.target.dtype
        )

    def lift(self, features):
        return features[..., 0, :]

    def to_target_vocab(self, x, fill=0.0):
        return x

    def draft_to_target(self, ids):
        return ids

    def logits(self, hidden):
        return self.target.lm_head(hidden)

    def __call__(self, tokens, hidden_in, positions, attention_mask, cache, slots=None):
        scratch = cache.max_len - 1  # padding of the catch-up writes here: leave it there
        if slots is None:
            slots = positions
        shifted = torch.where(slots == scratch, slots, slots + 1)
        positions = positions + 1
        first = bool((positions[:, 0] == 1).all())
        if first:  # the first catch-up: every row starts at position 0 with BOS
            tokens = torch.cat([torch.full_like(tokens[:, :1], BOS), tokens], 1)
            positions = torch.cat([torch.zeros_like(positions[:, :1]), positions], 1)
            shifted = torch.cat([torch.zeros_like(shifted[:, :1]), shifted], 1)
            attention_mask = torch.cat([attention_mask[:, :, :1], attention_mask], 2)
        # The caller's mask is over its slots; ours are one further, with slot 0 = BOS always visible.
        mask = torch.cat([torch.ones_like(attention_mask[..., :1]), attention_mask], -1)
        mask = mask[..., : int(shifted.max()) + 1]
        if first:
            mask[:, :, 0, 1:] = False
        hidden = self.target.forward(tokens, positions, mask, cache, slots=shifted).hidden
        return hidden[:, 1:] if first else hidden


def with_eos(target: HFTarget, eos_token_ids: tuple[int, ...] = ()) -> HFTarget:
    """The same model with other end-of-sequence tokens (none by default); the model is not touched."""
    other = HFTarget(target.model)
    other.info = replace(other.info, eos_token_ids=eos_token_ids)
    return other


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
@pytest.mark.parametrize(
    "arm", [DraftSpec(1), DraftSpec(4), DraftSpec(3, 3, 6), SAMPLED, FORKED, EARLY], ids=str
)
def test_greedy_equals_plain_with_a_random_drafter(tiny_target, kind, arm):
    """64 requests x 200 tokens: a drafter that is almost always wrong changes nothing."""
    drafter = Drafter(DrafterConfig.from_target(tiny_target, kind=kind, draft_vocab_size=96), tiny_target)
    prompts = random_prompts(64, seed=11)
    config = RolloutConfig(max_new_tokens=200, temperature=0)
    plain = RolloutEngine(tiny_target, config).generate(prompts)
    spec = SpeculativeRolloutLoop(tiny_target, drafter, config, arm, threshold=1000)
    result = spec.generate(prompts)
    assert all(s.token_ids.tolist() == p.token_ids.tolist() for s, p in zip(result.rollouts, plain.rollouts))
    assert all(result.stats.step_speculative)
    assert result.stats.accept_lengths.numel() > 0


@pytest.mark.parametrize("arm", [DraftSpec(4), DraftSpec(3, 3, 6), SAMPLED, FORKED, EARLY], ids=str)
def test_greedy_equals_plain_with_a_trained_drafter(tiny_llama, arm):
    """64 requests x 200 tokens with a drafter trained on the target's own greedy rollouts: many
    drafts are accepted, and the output is still the plain greedy output token for token."""
    prompts = random_prompts(64, seed=21)
    config = RolloutConfig(max_new_tokens=200, temperature=0)
    drafter = Drafter(DrafterConfig.from_target(tiny_llama), tiny_llama)
    data = RolloutEngine(tiny_llama, replace(config, feature_layers=drafter.config.rollout_feature_layers))
    plain = data.generate(prompts)
    torch.manual_seed(0)
    warmup_drafter(
        drafter,
        tiny_llama,
        plain.rollouts,
        steps=300,
        lr=1e-2,
        batch_size=16,
        progress=False,
        max_len=200,
        loss_cfg=DrafterLoss(1.0, 1.0),
    )  # teacher-forced top-1 ~0.35 here
    drafter.eval()
    result = SpeculativeRolloutLoop(tiny_llama, drafter, config, arm, threshold=1000).generate(prompts)
    assert all(s.token_ids.tolist() == p.token_ids.tolist() for s, p in zip(result.rollouts, plain.rollouts))
    assert result.stats.mean_accept_length > 1.25, "the trained drafter should get drafts accepted"


@pytest.mark.parametrize(
    ("arm", "temperature"),
    [
        (DraftSpec(2), 1.0),
        (DraftSpec(5), 1.0),
        (DraftSpec(3), 0.0),
        (SAMPLED, 1.0),
        (SAMPLED, 0.0),
        (FORKED, 1.0),
        (FORKED, 0.0),
    ],
)
def test_oracle_drafter_accepts_everything(tiny_llama, arm, temperature):
    """Chain drafts sampled from the target's own distribution are always accepted (a sampled
    tree's first chain: its siblings never get a chance)."""
    target = with_eos(tiny_llama)
    prompts = [[BOS, *p] for p in random_prompts(6, seed=12)]
    depth = arm.num_steps
    config = RolloutConfig(max_new_tokens=1 + 4 * (depth + 1), temperature=temperature)
    loop = SpeculativeRolloutLoop(
        target, OracleDrafter(target), config, arm, threshold=100, drafter_context="prompt"
    )
    result = loop.generate(prompts, generator=torch.Generator().manual_seed(0))
    assert (result.stats.accept_lengths == depth + 1).all()
    assert result.stats.num_steps == 4
    plain = RolloutEngine(target, config).generate(prompts, generator=torch.Generator().manual_seed(0))
    if temperature == 0:
        assert all(
            a.token_ids.tolist() == b.token_ids.tolist() for a, b in zip(plain.rollouts, result.rollouts)
        )


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_oracle_drafter_accepts_every_draft_of_a_chain_that_stops_early(tiny_llama, temperature):
    """The oracle's drafts are always accepted, however many it made before its confidence fell:
    each step emits its drafts plus one, and the depths vary from step to step."""
    target = with_eos(tiny_llama)
    prompts = [[BOS, *p] for p in random_prompts(1, seed=12)]
    arm = DraftSpec(8, min_confidence=0.2)
    config = RolloutConfig(max_new_tokens=60, temperature=temperature)
    loop = SpeculativeRolloutLoop(
        target, OracleDrafter(target), config, arm, threshold=100, drafter_context="prompt"
    )
    result = loop.generate(prompts, generator=torch.Generator().manual_seed(1))
    depths = torch.tensor(result.stats.step_draft_depths)
    assert (result.stats.accept_lengths[:-1] == depths[:-1] + 1).all()  # the last step is cut at the limit
    assert 1 <= depths.min() < depths.max() <= 8, depths.tolist()
    if temperature == 0:
        plain = RolloutEngine(target, config).generate(prompts)
        assert result.rollouts[0].token_ids.tolist() == plain.rollouts[0].token_ids.tolist()


def test_oracle_drafter_keeps_accepting_after_rows_finish(tiny_llama):
    """Rows that end early are removed and the last rows move into their slots, drafter cache and
    all: a moved row must keep drafting from its own context. With the oracle every step but a
    request's last (cut at its end-of-sequence token) accepts the whole chain."""
    target = with_eos(tiny_llama, eos_token_ids=tuple(range(10, 22)))
    prompts = [[BOS, *p] for p in random_prompts(16, seed=13)]
    arm = DraftSpec(3)
    config = RolloutConfig(max_new_tokens=1 + 12 * (arm.num_steps + 1), temperature=1.0)
    loop = SpeculativeRolloutLoop(
        target, OracleDrafter(target), config, arm, threshold=100, drafter_context="prompt"
    )
    result = loop.generate(prompts, generator=torch.Generator().manual_seed(3))
    sizes = result.stats.step_batch_sizes
    assert len(set(sizes)) >= 3 and sizes[-1] < sizes[0], "rows should have finished at different steps"
    per_step = result.stats.accept_lengths.split(sizes)
    for step, (accepts, size, size_after) in enumerate(zip(per_step, sizes, [*sizes[1:], 0])):
        short = int((accepts < arm.num_steps + 1).sum())
        assert short <= size - size_after, (
            f"step {step}: {short} rows accepted less, {size - size_after} finished"
        )


@pytest.mark.parametrize("arm", [DraftSpec(3, 2, 4), DraftSpec(4, 3, 12)], ids=str)
def test_oracle_drafter_trees_accept_their_argmax_path(tiny_llama, arm):
    """Under greedy, a tree from the target's own distribution is accepted along its argmax path:
    fully whenever the pruned tree kept that path, which a wide tree nearly always does."""
    target = with_eos(tiny_llama)
    prompts = [[BOS, *p] for p in random_prompts(6, seed=12)]
    config = RolloutConfig(max_new_tokens=40, temperature=0)
    loop = SpeculativeRolloutLoop(
        target, OracleDrafter(target), config, arm, threshold=100, drafter_context="prompt"
    )
    result = loop.generate(prompts)
    plain = RolloutEngine(target, config).generate(prompts)
    assert all(a.token_ids.tolist() == b.token_ids.tolist() for a, b in zip(plain.rollouts, result.rollouts))
    assert result.stats.accept_lengths.float().mean() >= 0.7 * (arm.num_steps + 1)


def test_threshold_switches_speculation_on_in_the_tail(tiny_llama):
    drafter = Drafter(DrafterConfig.from_target(tiny_llama), tiny_llama)
    # Long prompts in a 512-token context: each request's own limit makes the batch shrink step by step.
    prompts = [[5] * (470 + 3 * i) for i in range(12)]
    config = RolloutConfig(max_new_tokens=40, temperature=1.0)
    loop = SpeculativeRolloutLoop(tiny_llama, drafter, config, DraftSpec(3), threshold=6)
    stats = loop.generate(prompts, generator=torch.Generator().manual_seed(1)).stats
    for size, spec in zip(stats.step_batch_sizes, stats.step_speculative):
        assert spec == (size < 6)
    assert any(stats.step_speculative) and not all(stats.step_speculative)


def tiny_vocab_target(
    vocab: int = 6, decode: str = "hf", compile_config: CompileConfig | None = None
) -> HFTarget:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = model.config.eos_token_id = None
    return HFTarget(model, decode=decode, compile_config=compile_config)


def exact_joint(target: HFTarget, prompt: list[int], params: SamplingParams, length: int) -> torch.Tensor:
    """``[V] * length`` exact law of the first ``length`` sampled tokens, by enumeration."""
    V = target.info.vocab_size
    joint = torch.ones(())
    seqs = [[]]
    for _ in range(length):
        batch = torch.tensor([prompt + s for s in seqs])
        with torch.no_grad():
            logits = target.model(batch).logits[:, -1]
        probs = sampling_probs(logits, params).double()  # [len(seqs), V]
        joint = (joint.reshape(-1, 1) * probs).reshape(-1)
        seqs = [s + [v] for s in seqs for v in range(V)]
    return joint.reshape([V] * length)


def assert_sampling_exact(
    temperature: float,
    top_p: float,
    arm: DraftSpec,
    drafter_vocab: int | None = None,
    batch: int = 20_000,
    calls: int = 1,
    decode: str = "hf",
    compile_config: CompileConfig | None = None,
) -> list[int]:
    """Chi-square: the joint law of tokens 2-3 (produced by speculative steps) equals the target's,
    over ``calls`` rollouts of ``batch`` requests; returns the draft depth of every step."""
    target = tiny_vocab_target(decode=decode, compile_config=compile_config)
    config = DrafterConfig.from_target(target, draft_vocab_size=drafter_vocab)
    counts = None if drafter_vocab is None else torch.tensor([5, 1, 4, 0, 3, 2])  # drafts among 0, 2, 4
    drafter = Drafter(config, target, token_counts=counts)  # random: many rejections
    if compile_config is not None:  # the drafter's steps through the same mechanism
        drafter.use_compiled_steps(compile_config)
    params = SamplingParams(temperature, top_p)
    prompt, n = [1, 4, 2], batch * calls
    config = RolloutConfig(max_new_tokens=3, temperature=temperature, top_p=top_p, prefill_chunk=batch)
    loop = SpeculativeRolloutLoop(target, drafter, config, arm, threshold=batch + 1)
    generator, rollouts, depths = torch.Generator().manual_seed(3), [], []
    for _ in range(calls):
        result = loop.generate([prompt] * batch, generator=generator)
        assert all(result.stats.step_speculative)
        rollouts += result.rollouts
        depths += result.stats.step_draft_depths
    tokens = torch.stack([r.token_ids for r in rollouts])  # [n, 3]
    V = target.info.vocab_size
    expected = exact_joint(target, prompt, params, 3).sum(0).reshape(-1)  # tokens 2 and 3
    observed = torch.bincount(tokens[:, 1] * V + tokens[:, 2], minlength=V * V).double()
    keep = expected > 0
    assert observed[~keep].sum() == 0, "a token outside the top-p nucleus was emitted"
    _, pvalue = chisquare(observed[keep].numpy(), (expected[keep] / expected[keep].sum() * n).numpy())
    assert pvalue > 1e-3
    if decode == "compiled":  # the graphs verified the drafts; nothing fell back to the eager path
        assert target._compiled.graph_calls and not target._compiled._warned
        assert drafter._compiled.graph_calls and not drafter._compiled._warned
    return depths


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (1.0, 0.9), (0.7, 1.0)])
@pytest.mark.parametrize(
    "arm",
    [
        DraftSpec(2),
        DraftSpec(2, 2, 3),
        DraftSpec(2, 3, sampled=True),
        DraftSpec(2, 2, sampled=True, fork_depth=2),
    ],
    ids=str,
)
def test_sampling_is_exact_end_to_end(temperature, top_p, arm):
    assert_sampling_exact(temperature, top_p, arm)


@pytest.mark.parametrize("arm", [DraftSpec(2), DraftSpec(2, 2, 3)], ids=str)
def test_sampling_is_exact_through_the_lean_forward(arm):
    """The lean decode path (``HFTarget(decode="lean")``) verifies chains and trees: still the target's
    law."""
    assert_sampling_exact(1.0, 0.9, arm, decode="lean")


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("arm", [DraftSpec(2), DraftSpec(2, 2, 3)], ids=str)
def test_sampling_is_exact_through_the_compiled_forward(arm, dynamic):
    """Chains and trees drafted and verified in compiled graphs (every step padded to 4 tokens, and with
    static graphs to 20k rows; dynamic ones take the shrinking batch as it is): the target's law."""
    config = CompileConfig(batch_buckets=(20_000,), query_buckets=(4,), dynamic=dynamic)
    assert_sampling_exact(1.0, 0.9, arm, decode="compiled", compile_config=config)


@pytest.mark.parametrize("arm", [DraftSpec(4), DraftSpec(3, 3, 6), SAMPLED], ids=str)
def test_greedy_equals_plain_through_the_lean_forward(tiny_target, arm):
    """Speculative greedy on the lean path equals plain greedy on transformers' path, token for token."""
    lean = HFTarget(tiny_target.model, decode="lean")
    drafter = Drafter(DrafterConfig.from_target(lean, draft_vocab_size=96), lean)
    prompts = random_prompts(32, seed=13)
    config = RolloutConfig(max_new_tokens=120, temperature=0)
    plain = RolloutEngine(tiny_target, config).generate(prompts)
    result = SpeculativeRolloutLoop(lean, drafter, config, arm, threshold=1000).generate(prompts)
    assert all(s.token_ids.tolist() == p.token_ids.tolist() for s, p in zip(result.rollouts, plain.rollouts))
    assert all(result.stats.step_speculative)


@pytest.mark.parametrize("arm", [DraftSpec(2), DraftSpec(2, 2, sampled=True)], ids=str)
def test_sampling_is_exact_with_a_reduced_draft_vocabulary(arm):
    """Drafts sampled on a 3-token draft vocabulary (its distribution scattered into the target's
    6 tokens for verification): the target's other tokens still come out at their own rates."""
    assert_sampling_exact(1.0, 0.9, arm, drafter_vocab=3)


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_sampling_is_exact_when_chains_stop_on_their_own_drafts(top_p):
    """Whether a chain goes on depends on the tokens it drafted (their probabilities): with few
    requests per rollout the stop varies from step to step, and the law of the output is still the
    target's (2000 rollouts of 4 requests)."""
    depths = assert_sampling_exact(1.0, top_p, DraftSpec(2, min_confidence=0.25), batch=4, calls=2000)
    share = torch.bincount(torch.tensor(depths), minlength=3)[1:] / len(depths)
    assert (share > 0.1).all(), f"depth 1 / 2 shares {share.tolist()}: the stop should vary"


def test_bad_loop_arguments_are_rejected(tiny_llama):
    drafter = Drafter(DrafterConfig.from_target(tiny_llama), tiny_llama)
    with pytest.raises(ValueError, match="drafter_context must be 'response' or 'prompt', got 'all'"):
        SpeculativeRolloutLoop(tiny_llama, drafter, drafter_context="all").generate([[5]])
    with pytest.raises(ValueError, match="threshold must be >= 1, got 0"):
        SpeculativeRolloutLoop(tiny_llama, drafter, threshold=0).generate([[5]])
    loop = SpeculativeRolloutLoop(
        tiny_llama, drafter, RolloutConfig(max_new_tokens=8), DraftSpec(20), max_depth=16
    )
    with pytest.raises(ValueError, match="drafts deeper or verifies more tokens than max_depth=16"):
        loop.generate([[5]])
    loop = SpeculativeRolloutLoop(
        tiny_llama, drafter, RolloutConfig(max_new_tokens=8), DraftSpec(6, 3, sampled=True), max_depth=16
    )
    with pytest.raises(ValueError, match="strategy chain6x3 drafts deeper or verifies more tokens"):
        loop.generate([[5]])


SHIPPED_DRAFTER = Path(__file__).parents[2] / "examples" / "drafters" / "smollm2-countdown"


@pytest.mark.slow
def test_the_shipped_drafter_is_lossless_and_accepted_on_smollm2(smollm2):
    """The drafter shipped in ``examples/`` loads for the real SmolLM2 and, greedy and in fp32,
    reproduces plain decoding token for token while several drafts per step are accepted."""
    from tlt_lightning.drafter import load_drafter
    from tlt_lightning.rl.tasks import task_prompts

    target = HFTarget(smollm2.model)
    drafter = load_drafter(SHIPPED_DRAFTER, target).eval()
    prompts = task_prompts(smollm2.tokenizer, "countdown", 6, seed=1000)
    config = RolloutConfig(max_new_tokens=64, temperature=0)
    plain = RolloutEngine(target, config).generate(prompts)
    spec = SpeculativeRolloutLoop(target, drafter, config, DraftSpec(6), threshold=100)
    result = spec.generate(prompts)
    assert all(s.token_ids.tolist() == p.token_ids.tolist() for s, p in zip(result.rollouts, plain.rollouts))
    assert result.stats.mean_accept_length > 2.5


@pytest.mark.slow
def test_the_example_runs_with_the_shipped_drafter(capsys):
    import runpy

    example = runpy.run_path(str(SHIPPED_DRAFTER.parents[1] / "speculative_rollout.py"))
    example["main"](str(SHIPPED_DRAFTER), max_new_tokens=16)
    out = capsys.readouterr().out
    assert "plain:" in out and "mean accept length" in out
