"""Drafts without a model: prompt lookup (n-gram), the tokens that followed the latest earlier
occurrence of a sequence's last n tokens, in its prompt or output (agents, code edits and
retrieval-augmented answers quote their input, and those quotes are drafted whole); and a
client's predicted output (OpenAI's `prediction`), followed where the output keeps to it."""

from __future__ import annotations


def ngram_draft(tokens: list[int], max_draft: int, min_n: int, max_n: int) -> list[int]:
    """Up to `max_draft` tokens to propose after `tokens`: for the longest n in [min_n, max_n] whose
    last-n suffix occurred earlier, what followed its latest earlier occurrence. Empty when none did."""
    if max_draft < 1:
        return []
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + max_draft]
    return []


def predicted_draft(predicted: list[int], output: list[int], max_draft: int, max_n: int) -> list[int]:
    """Up to `max_draft` tokens of the prediction to propose after `output`: the next ones while the
    output is the prediction's beginning, else what follows the output's last tokens (up to max_n
    of them, down to one) where they last occur in the prediction."""
    if output == predicted[: len(output)]:
        return predicted[len(output) : len(output) + max_draft]
    for n in range(min(max_n, len(output)), 0, -1):
        suffix = output[-n:]
        for start in range(len(predicted) - n, -1, -1):
            if predicted[start : start + n] == suffix:
                return predicted[start + n : start + n + max_draft]
    return []
