"""The second turn of a chat computes only its new tokens; the metrics say how many were cached."""

from __future__ import annotations

from shoal import LLM, SamplingParams


def test_second_chat_turn_reuses_the_first(shoal_cache_dir):
    llm = LLM(
        "smollm2-135m-instruct", dtype="float32", device="cpu", kv_cache_bytes=32 << 20, cache_dir=str(shoal_cache_dir)
    )
    params = SamplingParams(temperature=0, max_tokens=16)
    conversation = [{"role": "user", "content": "Name three colours of the rainbow."}]
    first = llm.chat(conversation, params)[0]
    assert first.num_cached_tokens == 0
    conversation += [
        {"role": "assistant", "content": first.outputs[0].text},
        {"role": "user", "content": "And two more?"},
    ]
    computed_before = llm.engine.stats().prompt_tokens_computed
    second = llm.chat(conversation, params)[0]
    turn_one_tokens = len(first.prompt_token_ids)
    block = llm.engine.config.block_size
    assert second.num_cached_tokens >= (turn_one_tokens // block) * block > 0
    computed = llm.engine.stats().prompt_tokens_computed - computed_before
    assert computed == len(second.prompt_token_ids) - second.num_cached_tokens
    stats = llm.engine.stats()
    assert stats.prefix_cache_hit_tokens == second.num_cached_tokens
    assert stats.prefix_cache_query_tokens == turn_one_tokens + len(second.prompt_token_ids)
