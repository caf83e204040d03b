import pytest
import torch

from tlt_lightning.models import HFTarget, load_model
from tlt_lightning.rollout import RolloutConfig, RolloutEngine, RolloutStats
from tlt_lightning.rollout.engine import sample_tokens
from tlt_lightning.speculative import SamplingParams, sampling_probs


def random_prompts(n: int, seed: int = 0, low: int = 1, high: int = 20) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (n,), generator=g)
    return [torch.randint(3, 128, (int(k),), generator=g).tolist() for k in lengths]


def hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False)
    return out[0, len(prompt) :].tolist()


def test_greedy_equals_hf_generate_token_for_token(tiny_target):
    prompts = random_prompts(12)
    result = RolloutEngine(tiny_target, RolloutConfig(max_new_tokens=30, temperature=0)).generate(prompts)
    for prompt, rollout in zip(prompts, result.rollouts):
        assert rollout.token_ids.tolist() == hf_greedy(tiny_target.model, prompt, 30)
        assert rollout.prompt_ids.tolist() == prompt


def eos_candidate(target, prompts, max_new=24) -> int:
    """A token the greedy rollouts first emit at many different steps, but not in every rollout.

    Used as EOS, it makes requests stop at different steps while some run to the length limit.
    """
    result = RolloutEngine(target, RolloutConfig(max_new_tokens=max_new, temperature=0)).generate(prompts)
    best, best_spread = 0, -1
    for token in range(3, 128):
        firsts = {
            int((r.token_ids == token).int().argmax())
            for r in result.rollouts
            if (r.token_ids == token).any()
        }
        hits = sum(bool((r.token_ids == token).any()) for r in result.rollouts)
        if hits < len(prompts) and len(firsts) > best_spread:
            best, best_spread = token, len(firsts)
    return best


def test_eos_and_max_length_stop_each_request_independently(tiny_llama):
    prompts = random_prompts(16, seed=1)
    eos = eos_candidate(tiny_llama, prompts)
    model = load_model("tiny-llama", seed=0).model
    model.generation_config.eos_token_id = eos
    target = HFTarget(model)
    result = RolloutEngine(target, RolloutConfig(max_new_tokens=24, temperature=0)).generate(prompts)
    reasons = {r.finish_reason for r in result.rollouts}
    assert reasons == {"eos", "length"}, "the workload must mix both ways of stopping"
    for prompt, rollout in zip(prompts, result.rollouts):
        ref = hf_greedy(model, prompt, 24)  # HF stops at the same EOS
        assert rollout.token_ids.tolist() == ref
        if rollout.finish_reason == "eos":
            assert rollout.token_ids[-1] == eos and (rollout.token_ids[:-1] != eos).all()
        else:
            assert rollout.length == 24
    sizes = result.stats.step_batch_sizes
    assert sizes[0] < 16 or sizes[-1] < sizes[0], "finished requests must leave the batch"
    assert all(a >= b for a, b in zip(sizes, sizes[1:]))
    finish = {r.finish_time for r in result.rollouts if r.finish_reason == "eos"}
    assert len(finish) > 1 and all(r.first_token_time <= r.finish_time for r in result.rollouts)
    assert result.stats.generated_tokens == int(result.lengths.sum())
    stats = result.stats
    assert len(stats.step_cpu_times) == len(stats.step_times) == stats.num_steps
    assert all(0 < cpu <= wall + 1e-3 for cpu, wall in zip(stats.step_cpu_times, stats.step_times))
    assert stats.decode_tokens_per_s == pytest.approx(
        (stats.generated_tokens - stats.prefill_tokens) / sum(stats.step_times)
    )
    assert RolloutStats().decode_tokens_per_s == 0.0  # no decode step (every response ended at the prefill)


def test_sampling_is_reproducible_and_logprobs_match_a_direct_forward(tiny_target):
    prompts = random_prompts(6, seed=2)
    cfg = RolloutConfig(max_new_tokens=16, temperature=0.7, top_p=0.9, top_k=50, feature_layers=(2, 4))
    engine = RolloutEngine(tiny_target, cfg)
    a = engine.generate(prompts, generator=torch.Generator().manual_seed(7))
    b = engine.generate(prompts, generator=torch.Generator().manual_seed(7))
    c = engine.generate(prompts, generator=torch.Generator().manual_seed(8))
    assert all(torch.equal(x.token_ids, y.token_ids) for x, y in zip(a.rollouts, b.rollouts))
    assert any(not torch.equal(x.token_ids, y.token_ids) for x, y in zip(a.rollouts, c.rollouts))
    params = SamplingParams(0.7, 0.9, 50)
    for prompt, rollout in zip(prompts, a.rollouts):
        seq = torch.tensor([prompt + rollout.token_ids.tolist()])
        with torch.no_grad():
            out = tiny_target.model(seq, output_hidden_states=True)
        pred = slice(len(prompt) - 1, seq.shape[1] - 1)  # positions that predicted each token
        probs = sampling_probs(out.logits[0, pred], params)
        expected = probs.gather(-1, rollout.token_ids[:, None]).squeeze(-1).log()
        torch.testing.assert_close(rollout.logprobs, expected, atol=1e-4, rtol=1e-4)
        assert torch.isfinite(rollout.logprobs).all()
        # Features come from the same forward passes: hidden states 2 and 4 at the predicting positions
        # (up to fp32 summation order: cached batched decoding vs one full forward).
        torch.testing.assert_close(
            rollout.features[:, 0], out.hidden_states[2][0, pred], atol=1e-4, rtol=1e-4
        )
        torch.testing.assert_close(
            rollout.features[:, 1], out.hidden_states[4][0, pred], atol=1e-4, rtol=1e-4
        )


def test_a_groups_copies_of_a_prompt_share_one_prefill_and_sample_apart(tiny_target, monkeypatch):
    """GRPO samples each prompt ``group_size`` times: the copies are prefilled once, their cache rows
    copied, and each continues from its own draws (log-probabilities and features as a direct forward's)."""
    distinct = random_prompts(3, seed=4, low=4)
    prompts = [p for p in distinct for _ in range(4)][::-1]  # copies adjacent, in other chunks than theirs
    prefilled = []
    forward = tiny_target.forward

    def counting(input_ids, *args, **kwargs):
        if input_ids.shape[1] > 1:
            prefilled.extend(input_ids.tolist())
        return forward(input_ids, *args, **kwargs)

    monkeypatch.setattr(tiny_target, "forward", counting)
    cfg = RolloutConfig(max_new_tokens=12, temperature=1.0, feature_layers=(2,), prefill_chunk=2)
    result = RolloutEngine(tiny_target, cfg).generate(prompts, generator=torch.Generator().manual_seed(3))
    assert sorted(row[: len(p)] for row, p in zip(prefilled, distinct[::-1])) == sorted(distinct)
    assert len(prefilled) == 3
    for prompt, rollout in zip(prompts, result.rollouts):
        assert rollout.prompt_ids.tolist() == prompt
        seq = torch.tensor([prompt + rollout.token_ids.tolist()])
        with torch.no_grad():
            out = tiny_target.model(seq, output_hidden_states=True)
        pred = slice(len(prompt) - 1, seq.shape[1] - 1)
        expected = out.logits[0, pred].log_softmax(-1).gather(-1, rollout.token_ids[:, None]).squeeze(-1)
        torch.testing.assert_close(rollout.logprobs, expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(
            rollout.features[:, 0], out.hidden_states[2][0, pred], atol=1e-4, rtol=1e-4
        )
    for g in range(3):
        group = {tuple(r.token_ids.tolist()) for r in result.rollouts[4 * g : 4 * g + 4]}
        assert len(group) > 1  # the copies drew apart


def test_many_requests_at_once(tiny_llama):
    prompts = random_prompts(160, seed=3)
    result = RolloutEngine(tiny_llama, RolloutConfig(max_new_tokens=4, prefill_chunk=48)).generate(
        prompts, generator=torch.Generator().manual_seed(0)
    )
    assert len(result.rollouts) == 160 and result.stats.step_batch_sizes[0] == 160
    assert all(r.length == 4 or (r.finish_reason == "eos" and r.length < 4) for r in result.rollouts)


def without_eos(name: str = "tiny-llama") -> HFTarget:
    model = load_model(name, seed=0).model
    model.generation_config.eos_token_id = model.config.eos_token_id = None
    return HFTarget(model)


def test_requests_stop_at_the_context_length():
    prompt = random_prompts(1, seed=4, low=505, high=506)[0]  # context is 512 tokens
    target = without_eos()
    assert target.info.eos_token_ids == ()
    result = RolloutEngine(target, RolloutConfig(max_new_tokens=50, temperature=0)).generate([prompt, [5]])
    assert [r.length for r in result.rollouts] == [7, 50]
    assert result.rollouts[0].finish_reason == "length"


def test_bfloat16_target_runs():
    target = without_eos()
    target.model.to(torch.bfloat16)
    result = RolloutEngine(target, RolloutConfig(max_new_tokens=8, feature_layers=(4,))).generate(
        random_prompts(3)
    )
    assert result.rollouts[0].features.dtype == torch.bfloat16 and (result.lengths == 8).all()


@pytest.mark.parametrize(
    ("prompts", "error", "match"),
    [
        ([], ValueError, "prompts is empty"),
        ([[5, 6], []], ValueError, r"prompts\[1\] is empty"),
        ([[5] * 512], ValueError, r"prompts\[0\] has 512 tokens.*context of 512"),
        ([[5, 999]], ValueError, r"prompts\[0\] has token ids outside \[0, 128\)"),
        (["hello"], TypeError, r"prompts\[0\] must be a sequence of int token ids"),
    ],
)
def test_bad_prompts_are_rejected(tiny_llama, prompts, error, match):
    with pytest.raises(error, match=match):
        RolloutEngine(tiny_llama).generate(prompts)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens must be a positive int, got 0"),
        ({"temperature": -0.5}, "temperature must be finite and >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -1}, "top_k must be an int >= 0"),
        ({"prefill_chunk": 0}, "prefill_chunk must be > 0"),
    ],
)
def test_bad_config_is_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RolloutConfig(**kwargs)


@pytest.mark.slow
def test_smollm2_greedy_equals_hf(smollm2):
    tok = smollm2.tokenizer
    questions = ["What is 7 + 5?", "Name a fruit.", "Say hello in French.", "What color is the sky?"]
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)["input_ids"]
        for q in questions
    ]
    target = HFTarget(smollm2.model)
    result = RolloutEngine(target, RolloutConfig(max_new_tokens=40, temperature=0)).generate(prompts)
    for prompt, rollout in zip(prompts, result.rollouts):
        assert rollout.token_ids.tolist() == hf_greedy(smollm2.model, prompt, 40)


def test_greedy_sample_tokens_breaks_bf16_ties_as_argmax():
    """Greedy picks the lowest of tied top tokens (``torch.argmax``'s rule) in bf16, where ties are common."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 3, (64, 500), generator=g).to(torch.bfloat16)  # every row has tied maxima
    tokens, logprobs = sample_tokens(logits, RolloutConfig(temperature=0.0), None)
    assert torch.equal(tokens, logits.float().argmax(-1))
    assert torch.equal(tokens, (logits == logits.amax(-1, keepdim=True)).int().argmax(-1))
    assert not logprobs.any()


def test_max_new_tokens_past_the_context_is_capped_with_one_warning_and_small_buffers():
    target = without_eos()
    prompts = [random_prompts(1, seed=4, low=500, high=501)[0], [5, 6]]  # context is 512 tokens
    widths = []
    new_cache = target.new_cache
    target.new_cache = lambda batch, width: widths.append(width) or new_cache(batch, width)
    capped = RolloutEngine(target, RolloutConfig(max_new_tokens=100_000, temperature=0))
    with pytest.warns(UserWarning, match=r"max_new_tokens=100000 reaches past the model's context \(512"):
        result = capped.generate(prompts)
    exact = RolloutEngine(target, RolloutConfig(max_new_tokens=510, temperature=0)).generate(prompts)
    assert widths == [512, 512]  # sized by what can be generated, not by max_new_tokens
    assert [r.length for r in result.rollouts] == [12, 510]
    for a, b in zip(result.rollouts, exact.rollouts, strict=True):
        assert torch.equal(a.token_ids, b.token_ids) and a.finish_reason == b.finish_reason == "length"
