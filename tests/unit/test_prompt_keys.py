"""Which token blocks each prefix key of a prompt needs: for random conversations rendered by
SmolLM2's chat template and tokenized by its GGUF tokenizer, a request that shares a key with
another shares the token blocks the other's mapping gives that key; and a template that rewrites a
message's text maps no key past it."""

from __future__ import annotations

import random

import pytest

from shoal.model.registry import resolve_model
from shoal.model.tokenizer import Tokenizer
from shoal.protocol.prefix_keys import canonical_chat, canonical_completion, prefix_blocks
from shoal.worker.prompt_keys import key_blocks

BLOCK = 16
WORDS = ["alpha", "beta", "gamma", "the", "a", "über", "naïve", "12", "34.5", "!", "?", "\n", "  ", "don't"]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(resolve_model("smollm2-135m-instruct").path)


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def mapping(tokenizer: Tokenizer, messages: list[dict]) -> tuple[list[bytes], list[int], list[int]]:
    canonical = canonical_chat(messages)
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids, ends = tokenizer.encode_with_ends(rendered, add_special_tokens=False)
    return list(prefix_blocks(canonical.text)), key_blocks(canonical, rendered, ends, BLOCK), ids


def test_requests_sharing_a_key_share_the_blocks_it_maps_to(tokenizer):
    rng = random.Random(3)
    shared_keys = 0
    for _ in range(40):
        history = [{"role": "system", "content": text(rng, rng.randint(20, 80))}]
        for _ in range(rng.randint(0, 3)):
            history += [
                {"role": "user", "content": text(rng, rng.randint(5, 40))},
                {"role": "assistant", "content": text(rng, rng.randint(5, 40))},
            ]
        one = history + [{"role": "user", "content": text(rng, rng.randint(5, 40))}]
        other = history + [{"role": "user", "content": text(rng, rng.randint(5, 40))}]
        keys_one, blocks_one, ids_one = mapping(tokenizer, one)
        keys_other, _, ids_other = mapping(tokenizer, other)
        assert blocks_one == sorted(blocks_one) and blocks_one[-1] <= len(ids_one) // BLOCK
        for key, blocks in zip(keys_one, blocks_one):
            if key in keys_other:
                shared_keys += 1
                assert ids_one[: blocks * BLOCK] == ids_other[: blocks * BLOCK]
        # The shared history's keys reach all but about a block of the history's tokens.
        common = sum(1 for a, b in zip(keys_one, keys_other) if a == b)
        history_blocks = len(tokenizer.encode(tokenizer.apply_chat_template(history), add_special_tokens=False))
        assert blocks_one[common - 1] * BLOCK >= history_blocks - 3 * BLOCK
    assert shared_keys > 100


def test_a_completion_prompt_maps_its_own_text(tokenizer):
    prompt = "The quick brown fox jumps over the lazy dog. " * 12
    ids, ends = tokenizer.encode_with_ends(prompt)
    canonical = canonical_completion(prompt)
    blocks = key_blocks(canonical, prompt, ends, BLOCK)
    assert blocks[-1] >= len(ids) // BLOCK - 1
    token_ids = list(range(100, 180))
    canonical = canonical_completion(token_ids)
    offsets = [len(" ".join(map(str, token_ids[: i + 1]))) for i in range(len(token_ids))]
    assert key_blocks(canonical, canonical.text, offsets, BLOCK)[-1] >= len(token_ids) // BLOCK - 1


def test_a_message_the_template_rewrites_ends_the_mapped_keys(tokenizer):
    messages = [{"role": "system", "content": "x " * 100}, {"role": "user", "content": "question " * 30}]
    canonical = canonical_chat(messages)
    rendered = tokenizer.apply_chat_template(messages).replace("question", "QUESTION")
    ids, ends = tokenizer.encode_with_ends(rendered, add_special_tokens=False)
    blocks = key_blocks(canonical, rendered, ends, BLOCK)
    system_end = len(tokenizer.encode(rendered[: rendered.index("QUESTION")], add_special_tokens=False))
    assert max(blocks) * BLOCK <= system_end
