"""Micro-batching of an optimizer step (rl/batch.py); their gradients are checked in test_module.py."""

import pytest
import torch

from tlt_lightning.rl.batch import PolicyBatch, head_logprobs, micro_batches


def test_without_a_token_budget_rows_are_split_in_order():
    lens = torch.tensor([5, 9, 2, 7, 3])
    assert [m.tolist() for m in micro_batches(lens, max_rows=2)] == [[0, 1], [2, 3], [4]]
    assert [m.tolist() for m in micro_batches(lens)] == [[0, 1, 2, 3, 4]]
    assert micro_batches(torch.zeros(0, dtype=torch.long), max_tokens=8) == []


@pytest.mark.parametrize("max_rows", [None, 1, 3])
@pytest.mark.parametrize("max_tokens", [1, 40, 100, 10_000])
def test_a_token_budget_packs_rows_longest_first_within_it(max_rows, max_tokens):
    lens = torch.tensor([12, 50, 7, 33, 33, 90, 4, 21])
    chunks = micro_batches(lens, max_rows=max_rows, max_tokens=max_tokens)
    assert sorted(torch.cat(chunks).tolist()) == list(range(8))  # every row once
    flat = lens[torch.cat(chunks)]
    assert flat.tolist() == sorted(lens.tolist(), reverse=True)  # longest first
    for chunk in chunks:
        padded = chunk.numel() * int(lens[chunk].max())
        assert chunk.numel() == 1 or padded <= max_tokens  # a row over the budget goes alone
        assert max_rows is None or chunk.numel() <= max_rows
    # greedy: no micro-batch could have taken the next row as well
    for chunk, following in zip(chunks, chunks[1:]):
        grown = (chunk.numel() + 1) * int(lens[chunk].max())
        assert grown > max_tokens or chunk.numel() == max_rows, (chunk, following)


def test_rows_of_equal_length_keep_their_order():
    chunks = micro_batches(torch.tensor([6, 6, 6, 6]), max_tokens=12)
    assert [m.tolist() for m in chunks] == [[0, 1], [2, 3]]


def test_head_logprobs_runs_the_head_on_real_completion_tokens_only():
    torch.manual_seed(0)
    B, S, H, V = 3, 9, 8, 11
    prompt_lens, lengths = torch.tensor([2, 4, 3]), torch.tensor([5, 1, 6])
    T = int(lengths.max())
    mask = torch.arange(T) < lengths[:, None]
    tokens = torch.randint(V, (B, T)) * mask
    batch = PolicyBatch(
        torch.zeros(B, S, dtype=torch.long), (torch.arange(S) < (prompt_lens + lengths)[:, None]).long(),
        prompt_lens, tokens, mask, torch.ones(B), torch.zeros(B, T),
    )  # fmt: skip
    hidden = torch.randn(B, S, H, requires_grad=True)
    head = torch.nn.Linear(H, V)
    seen = []
    out = head_logprobs(hidden, batch, lambda x: seen.append(x.shape) or head(x), temperature=0.7)
    assert seen == [(int(lengths.sum()), H)]  # 12 rows, not B * T = 18 nor B * S = 27
    full = (head(hidden) / 0.7).log_softmax(-1)  # [B, S, V]
    for b in range(B):
        for t in range(T):
            expected = full[b, prompt_lens[b] - 1 + t, tokens[b, t]] if mask[b, t] else torch.tensor(0.0)
            torch.testing.assert_close(out[b, t], expected)
    (grad,) = torch.autograd.grad((out * mask).sum(), hidden)
    (expected_grad,) = torch.autograd.grad(
        sum(full[b, prompt_lens[b] - 1 + t, tokens[b, t]] for b, t in mask.nonzero().tolist()), hidden
    )
    torch.testing.assert_close(grad, expected_grad)


@pytest.mark.parametrize("multiple", [1, 8, 16])
def test_selected_rows_pad_to_a_multiple_and_keep_their_logprobs(multiple):
    from tlt_lightning.models import load_model
    from tlt_lightning.rl.batch import completion_logprobs

    torch.manual_seed(0)
    model = load_model("tiny-llama").model.eval()
    prompt_lens, lengths = torch.tensor([3, 5, 2]), torch.tensor([4, 2, 6])
    S, T = int((prompt_lens + lengths).max()), int(lengths.max())  # 8 tokens at most
    mask = torch.arange(T) < lengths[:, None]
    batch = PolicyBatch(
        torch.randint(1, 100, (3, S)) * (torch.arange(S) < (prompt_lens + lengths)[:, None]),
        (torch.arange(S) < (prompt_lens + lengths)[:, None]).long(),
        prompt_lens, torch.randint(1, 100, (3, T)) * mask, mask, torch.ones(3), torch.zeros(3, T),
    )  # fmt: skip
    rows = torch.tensor([0, 1])  # their longest: 7 tokens
    picked = batch.select(rows, multiple)
    assert picked.input_ids.shape[1] == -(-7 // multiple) * multiple  # 7, 8 or 16: past the batch's 8
    assert picked.attention_mask.sum(1).tolist() == [7, 7]
    with torch.no_grad():
        padded, trimmed = (completion_logprobs(model, b, 1.0) for b in (picked, batch.select(rows)))
    torch.testing.assert_close(padded, trimmed)
