"""Tests for reasoning-gym tasks, prompts, answer extraction and rewards (no real model)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerFast

from tlt_lightning.rl import DEFAULT_SYSTEM_PROMPT, SUPPORTED_TASKS, Prompt, TaskConfig, TaskDataset
from tlt_lightning.rl.rewards import Extraction, extract_answer, find_answer, follows_format
from tlt_lightning.rl.tasks import collate_prompts

# SmolLM2's template, default system message included, so prompts render as they will in training.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer with no merges (one token per byte) and a chat template."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    vocab.update({ch: i + 3 for i, ch in enumerate(sorted(alphabet))})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|im_end|>",
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make(tokenizer, **kwargs) -> TaskDataset:
    kwargs.setdefault("size", 8)
    return TaskDataset(TaskConfig(**kwargs), tokenizer)


# --- config validation --------------------------------------------------------------------------


def test_defaults_are_valid_and_easy():
    config = TaskConfig()
    assert config.name in SUPPORTED_TASKS
    assert config.reasoning_gym_kwargs()["max_terms"] == 2
    assert TaskConfig(easy=False).reasoning_gym_kwargs() == {}
    assert TaskConfig(task_kwargs={"max_terms": 3}).reasoning_gym_kwargs()["max_terms"] == 3


def test_unknown_task_lists_supported():
    with pytest.raises(ValueError, match=r"name must be one of \['basic_arithmetic', 'chain_sum'.*'nope'"):
        TaskConfig(name="nope")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"size": 0}, ValueError, r"size must be an int >= 1, got 0"),
        ({"size": 2.5}, TypeError, r"size must be an int >= 1, got 2.5"),
        ({"seed": -1}, ValueError, r"seed must be an int >= 0, got -1"),
        ({"seed": "1"}, TypeError, r"seed must be an int >= 0, got '1'"),
        ({"format_weight": -0.1}, ValueError, r"format_weight must be a float in \[0, 1\], got -0.1"),
        ({"format_weight": float("nan")}, ValueError, r"format_weight must be a float in \[0, 1\], got nan"),
        ({"format_weight": "0.1"}, TypeError, r"format_weight must be a float in \[0, 1\], got '0.1'"),
        ({"easy": 1}, TypeError, r"easy must be a bool, got 1"),
        ({"system_prompt": 3}, TypeError, r"system_prompt must be a str or None, got 3"),
        ({"task_kwargs": [1]}, TypeError, r"task_kwargs must be a dict with str keys, got \[1\]"),
        (
            {"task_kwargs": {"size": 3}},
            ValueError,
            r"task_kwargs must not set \['size'\]: use the TaskConfig",
        ),
    ],
)
def test_bad_config_fields(kwargs, error, match):
    with pytest.raises(error, match=match):
        TaskConfig(**kwargs)


def test_bad_task_kwargs_wrap_reasoning_gym_error():
    # Unknown field: reasoning-gym's config raises TypeError; invalid value: an AssertionError.
    with pytest.raises(
        ValueError, match=r"invalid for reasoning-gym task 'chain_sum': TypeError: .*max_termz"
    ):
        TaskConfig(name="chain_sum", task_kwargs={"max_termz": 3})
    with pytest.raises(
        ValueError,
        match=r"invalid for reasoning-gym task 'basic_arithmetic': AssertionError: min_terms must be",
    ):
        TaskConfig(name="basic_arithmetic", task_kwargs={"min_terms": 0})
    # The easy preset of another task is not silently applied to this one.
    with pytest.raises(ValueError, match=r"reasoning-gym task 'gsm_symbolic'.*min_terms"):
        TaskConfig(name="gsm_symbolic", task_kwargs={"min_terms": 2})


def test_tokenizer_needs_chat_template(tokenizer):
    plain = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer)
    with pytest.raises(ValueError, match=r"has no chat_template"):
        TaskDataset(TaskConfig(size=2), plain)
    with pytest.raises(TypeError, match=r"config must be a TaskConfig, got dict"):
        TaskDataset({"name": "chain_sum"}, tokenizer)


# --- prompts ------------------------------------------------------------------------------------


def test_a_render_function_replaces_the_chat_template(tokenizer):
    """``render`` (e.g. a torchtune tokenizer's) renders the messages; no chat template is needed then."""
    plain = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer)
    seen = []

    def render(messages):
        seen.append(messages)
        text = "|".join(f"{m['role']}:{m['content']}" for m in messages)
        return text, plain(text, add_special_tokens=False)["input_ids"]

    ds = TaskDataset(TaskConfig(size=2, system_prompt=None), plain, render=render)
    prompt = ds[0]
    assert seen == [[{"role": "user", "content": prompt.question}]]
    assert prompt.text == f"user:{prompt.question}" and plain.decode(prompt.input_ids) == prompt.text


def test_prompts_are_deterministic_in_the_seed(tokenizer):
    a, b = make(tokenizer, seed=3), make(tokenizer, seed=3)
    assert [a[i] for i in range(len(a))] == [b[i] for i in range(len(b))]
    other = make(tokenizer, seed=4, task_kwargs={"max_digits": 3})
    assert [a[i].question for i in range(8)] != [other[i].question for i in range(8)]


def test_prompt_rendering(tokenizer):
    ds = make(tokenizer)
    prompt = ds[1]
    assert isinstance(prompt, Prompt) and prompt.index == 1 and len(ds) == 8
    assert prompt.question == prompt.entry["question"]
    assert prompt.text.startswith("<|im_start|>system\nYou are a careful math assistant.")
    assert "where X is only the final number." in prompt.text  # {answer} filled in
    assert prompt.text.endswith(f"{prompt.question}<|im_end|>\n<|im_start|>assistant\n")
    assert prompt.input_ids == tokenizer(prompt.text, add_special_tokens=False)["input_ids"]
    assert prompt.input_ids.count(1) == 3  # <|im_start|> of system, user, assistant
    assert ds[-1] == ds[7]
    with pytest.raises(IndexError, match=r"index 8 is out of range for a task of size 8"):
        ds[8]


def test_system_prompt_none_uses_template_default_and_expression_wording(tokenizer):
    assert "SmolLM" in make(tokenizer, system_prompt=None)[0].text
    countdown = make(tokenizer, name="countdown", size=2)
    assert "where X is only the arithmetic expression." in countdown[0].text
    assert "{answer}" in DEFAULT_SYSTEM_PROMPT


def test_dataloader_with_collate(tokenizer):
    ds = make(tokenizer)
    batch = next(iter(DataLoader(ds, batch_size=4, collate_fn=collate_prompts)))
    assert [p.index for p in batch] == [0, 1, 2, 3]


# --- rewards ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SUPPORTED_TASKS))
def test_each_task_scores_right_and_wrong_answers(tokenizer, name):
    ds = make(tokenizer, name=name, size=3)
    for i in range(len(ds)):
        answer = ds[i].entry["answer"]
        right = ds.score(i, f"Let me think.\nThe answer is {answer}.")
        assert right.correctness == 1.0 and right.answer == answer
        assert right.total == pytest.approx(1.0 + ds.config.format_weight)
        tagged = ds.score(ds[i], f"<answer>{answer}</answer>")
        assert tagged.correctness == 1.0
        assert ds.reward(i, "The answer is 123456789.") < 1.0
        assert ds.reward(i, "I do not know.") < 1.0


def test_format_reward_adds_exactly_format_weight(tokenizer):
    ds = make(tokenizer, format_weight=0.25)
    answer = ds[0].entry["answer"]
    plain = ds.score(0, f"{ds[0].entry['metadata']['expression']} = {answer}")
    marked = ds.score(0, f"The answer is {answer}.")
    assert plain.correctness == marked.correctness == 1.0
    assert plain.format == 0.0 and marked.format == 0.25
    assert marked.total - plain.total == 0.25
    # The bonus is for the format, not for being right.
    assert ds.score(0, "The answer is 123456789.").format == 0.25
    assert make(tokenizer, format_weight=0.0).score(0, f"The answer is {answer}.").total == 1.0


def test_batched_rewards(tokenizer):
    ds = make(tokenizer)
    answers = [ds[i].entry["answer"] for i in (0, 0, 1)]
    out = ds.rewards([0, 0, 1], [f"The answer is {answers[0]}.", "nothing", f"= {answers[2]}"])
    assert out.shape == (3,) and out.dtype == torch.float32
    assert out.tolist() == pytest.approx([1.1, 0.0, 1.0])
    with pytest.raises(ValueError, match=r"same length, got 2 and 1"):
        ds.rewards([0, 1], ["x"])


def test_scorer_failure_names_task_and_index(tokenizer, monkeypatch):
    ds = make(tokenizer)

    def broken(answer, entry):
        raise KeyError("metadata")

    monkeypatch.setattr(ds.source, "score_answer", broken)
    with pytest.raises(RuntimeError, match=r"task 'chain_sum' failed to score prompt 5 .*KeyError"):
        ds.reward(5, "The answer is 3.")
    with pytest.raises(TypeError, match=r"completion must be a str, got NoneType"):
        ds.reward(0, None)


# --- extraction ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<answer>42</answer>", Extraction("42", "tag")),
        ("I think <answer> x = -7 </answer> is right", Extraction("-7", "tag")),
        ("So we get \\boxed{1,250}.", Extraction("1250", "boxed")),
        ("The result is +7.00 exactly", Extraction("7", "phrase")),
        ("Therefore, the answer is 12.", Extraction("12", "phrase")),
        ("The final answer to this problem is 15.", Extraction("15", "phrase")),
        ("Final answer: **-3**", Extraction("-3", "phrase")),
        ("The answer is 5 - 3 = 2.", Extraction("2", "phrase")),
        ("The answer is 4. Check: 1 + 3 = 4, not 5.", Extraction("4", "phrase")),
        ("The answer is unclear. Anyway 2 + 2 = 4", Extraction("4", "equals")),
        ("2 + -1 = 3.", Extraction("3", "equals")),
        ("We subtract \u2212 and get \u22124 = \u22124", Extraction("-4", "equals")),
        ("Adding them gives 9 apples and 2.5 pears", Extraction("2.5", "last_number")),
        ("No numbers here at all.", None),
        ("", None),
    ],
)
def test_find_answer_numbers(completion, expected):
    assert find_answer(completion) == expected
    assert extract_answer(completion) == (expected.answer if expected else None)


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<answer>(5 + 3) * 2</answer>", Extraction("(5 + 3) * 2", "tag")),
        ("The answer is 10 - 2 = 8.", Extraction("10 - 2", "phrase")),
        ("Try 9 * 9 = 81.\nThen\n10 + 4 = 14", Extraction("10 + 4", "expression")),
        ("Use 7 and 5.\n\n3", None),
        ("<answer>__import__('os').getcwd()</answer>", None),
        ("<answer>8</answer>", Extraction("8", "tag")),
    ],
)
def test_find_answer_expressions(completion, expected):
    assert find_answer(completion, kind="expression") == expected


def test_follows_format_and_bad_kind():
    assert follows_format("The answer is 7.")
    assert follows_format("<answer>7</answer>")
    assert not follows_format("3 + 4 = 7")
    assert not follows_format("nothing")
    with pytest.raises(ValueError, match=r"kind must be one of \('number', 'expression'\), got 'text'"):
        find_answer("7", kind="text")
