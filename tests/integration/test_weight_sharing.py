"""Without prepacking, the engine computes straight from the memory-mapped cache file's pages; with
it (the default), on its own packed copy with the native kernels."""

from __future__ import annotations


def test_unpacked_engine_uses_the_mapped_weights_without_copies(make_tiny_engine):
    engine = make_tiny_engine(share_weights=True)
    mapped = engine.checkpoint.weights
    layer = engine.model.layers[0]
    assert layer.down.weights[0].data_ptr() == mapped["model.layers.0.mlp.down_proj.weight"].data_ptr()
    assert [w.data_ptr() for w in layer.qkv.weights] == [
        mapped[f"model.layers.0.self_attn.{p}_proj.weight"].data_ptr() for p in "qkv"
    ]
    assert engine.model.embed.data_ptr() == mapped["model.embed_tokens.weight"].data_ptr()
    assert layer.down.backend == "onednn"  # batch-invariant kernels straight on the shared pages


def test_prepacked_engine_uses_the_native_kernels(make_tiny_engine):
    for dtype, packed in (("float32", "f32"), ("bfloat16", "bf16"), ("float16", "f16")):
        assert make_tiny_engine(dtype=dtype).model.layers[0].down.description == f"native {packed}"
