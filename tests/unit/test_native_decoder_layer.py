"""The fused C++ decoder layer: the same function as the torch layer, its four tensor-parallel
segments give its own bits, and a token's output never depends on the rest of the batch."""

from __future__ import annotations

import pytest
import torch

from shoal.model.config import LlamaConfig
from shoal.model.llama import LlamaModel
from shoal.model.native_kernels import load_native_kernels
from shoal.model.paged_attention import build_attention_metadata

# Head dim 48 (three lanes of 16 and a RoPE half of 24, not whole lanes), qkv bias, GQA 6/2, and
# an intermediate size that is no multiple of 16: every tail path of the kernels runs.
CONFIG = LlamaConfig(
    vocab_size=96,
    hidden_size=96,
    intermediate_size=200,
    num_layers=2,
    num_heads=6,
    num_kv_heads=2,
    head_dim=48,
    max_position_embeddings=256,
    attention_bias=True,
)
BLOCK = 8


def random_weights(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The same weights for every dtype (drawn in float32, then rounded to `dtype`)."""
    g = torch.Generator().manual_seed(7)
    c = CONFIG
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size), "model.norm.weight": (c.hidden_size,)}
    shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (c.hidden_size,),
            p + "post_attention_layernorm.weight": (c.hidden_size,),
            p + "self_attn.q_proj.weight": (q, c.hidden_size),
            p + "self_attn.q_proj.bias": (q,),
            p + "self_attn.k_proj.weight": (kv, c.hidden_size),
            p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, c.hidden_size),
            p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (c.hidden_size, q),
            p + "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
        }
    weights = {name: torch.randn(shape, generator=g) * 0.2 for name, shape in shapes.items()}
    for name in weights:
        if name.endswith("norm.weight"):
            weights[name] = 1 + weights[name]
    return {name: w.to(dtype) for name, w in weights.items()}


def model(dtype: torch.dtype, prepack: bool) -> LlamaModel:
    return LlamaModel(CONFIG, random_weights(dtype), 16, prepack=prepack, attention_kernel="rows")


def run(m: LlamaModel, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Prefills the prompts as one batch on fresh caches; each prompt's final hidden states."""
    caches = m.allocate_kv_cache(64, BLOCK)
    tables, next_block = [], 0
    for prompt in prompts:
        blocks = -(-len(prompt) // BLOCK)
        tables.append(list(range(next_block, next_block + blocks)))
        next_block += blocks
    meta = build_attention_metadata(
        [len(p) for p in prompts], [0] * len(prompts), [tables], BLOCK, CONFIG.num_kv_heads, 3, 8, m.device, (0,), False
    )
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    return list(m.forward(ids, positions, caches, meta).split([len(p) for p in prompts]))


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, CONFIG.vocab_size, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(autouse=True)
def needs_kernels():
    assert load_native_kernels() is not None, "the native kernels must build on the CI machine"


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


def test_the_fused_layer_computes_what_the_torch_layer_does():
    fused, plain = model(torch.float32, prepack=True), model(torch.float32, prepack=False)
    assert all(layer.native is not None for layer in fused.layers)
    assert all(layer.native is None for layer in plain.layers)
    prompts = [prompt(37, 1), prompt(5, 2)]
    for got, want in zip(run(fused, prompts), run(plain, prompts)):
        assert relative_error(got, want) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_in_16_bits_the_fused_layer_is_as_close_to_float32_as_the_torch_layer(dtype):
    """Both round after every operation; the fused layer's error is the torch layer's, give or take."""
    reference = run(model(torch.float32, prepack=False), [prompt(37, 1)])[0]
    fused = run(model(dtype, prepack=True), [prompt(37, 1)])[0]
    plain = run(model(dtype, prepack=False), [prompt(37, 1)])[0]
    assert relative_error(fused, reference) < 1.5 * relative_error(plain, reference) + 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_segments_give_the_whole_layers_bits(dtype):
    m = model(dtype, prepack=True)
    layer = m.layers[0]
    prompts = [prompt(21, 3)]
    [meta] = build_attention_metadata([21], [0], [[[0, 1, 2]]], BLOCK, CONFIG.num_kv_heads, 3, 8, m.device, (0,), False)
    hidden = m.embed_tokens(torch.tensor(prompts[0]))
    layout = (meta.token_positions, meta.slot_rows, meta.block_tables, meta.token_sequences)
    whole = layer.native.forward(hidden, *m.allocate_kv_cache(8, BLOCK)[0], *layout)
    attended = layer.native.output(layer.native.attention(hidden, *m.allocate_kv_cache(8, BLOCK)[0], *layout), hidden)
    assert torch.equal(layer.native.down(layer.native.mlp(attended), attended), whole)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompts_hidden_states_do_not_depend_on_its_batch(dtype):
    m = model(dtype, prepack=True)
    mine = prompt(29, 4)
    alone = run(m, [mine])[0]
    for others in ([prompt(3, 5)], [prompt(40, 6), prompt(1, 7)], [prompt(n, 8 + n) for n in range(1, 12)]):
        for place in (0, len(others)):
            batch = others[:place] + [mine] + others[place:]
            assert torch.equal(run(m, batch)[place], alone), (len(others), place)


def test_argmax_rows_is_torchs_argmax():
    kernels = load_native_kernels()
    logits = torch.randn(12, 1000)
    logits[1, 10] = logits[1, 500] = logits[1].max() + 1  # a tie: the first one
    logits[2, 999] = float("nan")
    logits[3, 4] = float("inf")
    logits[4, 7], logits[4, 3] = float("nan"), float("inf")
    logits[5] = 0.0
    assert torch.equal(kernels.argmax_rows(logits), logits.argmax(dim=-1))
    short = torch.randn(3, 37)  # shorter than two lanes
    assert torch.equal(kernels.argmax_rows(short), short.argmax(dim=-1))
