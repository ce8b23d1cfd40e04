"""KV for hybrid attention, at the length it is for: a Gemma 3 of the real layer pattern (18 layers,
one global in six, a 512-token window, as Gemma 3 270M; random weights, tiny widths) at 8k tokens of
context holds at most a third of the KV that full-length tables would, in a KV budget that full-
length tables would not fit; its tokens are those of one forward pass over full-length tables (every
block kept); a prefix hit, and the KV moved to another engine (P/D, migration), give them again. A
prefix evicted to the KV tier comes back with every group's blocks."""

from __future__ import annotations

import random
import types

import pytest

from shoal.engine.sampling_params import SamplingParams
from shoal.protocol.worker_load import WorkerLoad
from shoal.router.fleet.load_report import LoadReport
from tests.support.engine_runs import engine_factory, final_outputs
from tests.support.family_variants import COMMON, LAYER_VARIANTS
from tests.support.logits import forward_logits
from tests.support.tiny_model import write_random_family_model

LAYERS, WINDOW, CONTEXT, BLOCK = 18, 512, 8192, 16
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = [random.Random(3).randrange(3, 128) for _ in range(CONTEXT)]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gemma3-270m-pattern")
    fields = {
        **COMMON,
        "hidden_size": 32,
        "intermediate_size": 32,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "num_hidden_layers": LAYERS,
        "sliding_window": WINDOW,
        "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(LAYERS)],
        "max_position_embeddings": CONTEXT + 64,
    }
    write_random_family_model(directory, "Gemma3TextConfig", "Gemma3ForCausalLM", fields)
    return directory


def full_length_bytes(engine) -> int:
    """What one sequence of CONTEXT + max_tokens tokens would take with every layer's KV kept."""
    model = engine.model
    per_layer_token = model.kv_bytes_per_block_token() // len(model.kv_slots)
    return LAYERS * per_layer_token * (CONTEXT + GREEDY.max_tokens)


def test_gemma3_at_8k_tokens_holds_a_third_of_full_length_kv_and_the_same_tokens(gemma3, shoal_cache_dir):
    make = engine_factory(gemma3, shoal_cache_dir, block_size=BLOCK, max_num_batched_tokens=2048)
    reference = make(kv_cache_bytes=64 << 20)
    budget = int(0.4 * full_length_bytes(reference))
    engine = make(kv_cache_bytes=budget)
    # What the worker reports to routers: the longest sequence that fits, counted per KV group.
    report = LoadReport.from_shoal(
        WorkerLoad(
            num_kv_blocks=engine.block_manager.num_blocks, block_size=BLOCK, kv_capacity_tokens=engine.max_cached_tokens
        )
    )
    assert report.kv_capacity_tokens == engine.max_cached_tokens >= CONTEXT + GREEDY.max_tokens
    held = []
    engine.add_request("long", PROMPT, GREEDY)
    tokens = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens = output.outputs[0].token_ids
        if len(tokens) > 1:  # decoding at 8k tokens of context (prefill chunks hold their whole span)
            held.append(engine.block_manager.num_usable_blocks - engine.block_manager.num_free_blocks)
        engine.check_integrity()
    assert len(tokens) == GREEDY.max_tokens
    # Blocks hold kv_slots layers each: the most held, in layer-blocks, against full-length tables.
    full_length = LAYERS * -(-(CONTEXT + GREEDY.max_tokens) // BLOCK)
    assert max(held) * len(engine.model.kv_slots) <= full_length / 3
    # The tokens of a forward pass over full-length tables (greedy: each is the argmax after the last).
    logits = forward_logits(types.SimpleNamespace(engine=reference), PROMPT + tokens[:-1])
    assert logits[CONTEXT - 1 :].argmax(dim=-1).tolist() == tokens
    # A prefix hit: the full group's blocks and the windowed groups' last ones are found.
    engine.reset_counters()
    again = final_outputs(engine, {"again": (PROMPT, GREEDY)})["again"]
    assert again.token_ids == tokens and engine.prompt_tokens_computed <= BLOCK
    # The KV moved to another engine of the same budget, which then computes at most a block.
    receiver = make(kv_cache_bytes=budget)
    assert receiver.import_kv(engine.export_kv(PROMPT)) > 0
    receiver.reset_counters()
    moved = final_outputs(receiver, {"moved": (PROMPT, GREEDY)})["moved"]
    assert moved.token_ids == tokens and receiver.prompt_tokens_computed <= BLOCK


@pytest.fixture(scope="module")
def small_gemma3(tmp_path_factory):
    """Gemma 3's layer kinds at test scale: two layers with a 21-token window, one global."""
    config_class, model_class, fields = LAYER_VARIANTS["gemma3"]
    directory = tmp_path_factory.mktemp("gemma3-window-21")
    write_random_family_model(directory, config_class, model_class, {**COMMON, **fields})
    return directory


def test_an_evicted_hybrid_prefix_comes_back_from_the_kv_tier(small_gemma3, shoal_cache_dir):
    """The tier keeps each group's blocks under its own key: the full group's whole prefix and the
    windowed groups' last blocks come back, and only the last token is computed again."""
    make = engine_factory(small_gemma3, shoal_cache_dir, kv_tier_host_bytes=1 << 20)
    probe = make()
    block_bytes = probe.model.kv_bytes_per_block_token() * probe.block_manager.block_size
    engine = make(kv_cache_bytes=40 * block_bytes)
    prompt, params = list(range(5, 5 + 41)), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first = final_outputs(engine, {"first": (prompt, params)})["first"].token_ids
    for i in range(4):  # other prompts evict it from the 40-block paged cache
        other = [(7 * i + 3 * j) % 120 + 1 for j in range(41)]
        final_outputs(engine, {f"other-{i}": (other, params)})
    engine.reset_counters()
    again = final_outputs(engine, {"again": (prompt, params)})["again"].token_ids
    assert again == first and engine.prompt_tokens_computed == 1
    assert engine.stats().kv_tier.hits["host"] > 10  # more than the full group's 10 blocks
