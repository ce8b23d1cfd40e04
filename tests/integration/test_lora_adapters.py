"""LoRA adapters from PEFT directories, made with `peft` here on the tiny model: read with their
scaling (plain and rsLoRA) so that each projection's B A is PEFT's own delta weight, and refused,
with the file and the reason, when they cannot be used (rank above the maximum, another base shape,
a corrupt or substituted file, DoRA). In the engine: PEFT's logits and greedy tokens; a batch
mixing four adapters and the base model gives each request its tokens alone (greedy and seeded);
at most max_loras adapters a step, max_cpu_loras held; loaded and unloaded at run time."""

from __future__ import annotations

import dataclasses
import hashlib
import math

import pytest
import torch

from shoal.engine.sampling_params import SamplingParams
from shoal.model.hf_loader import load_hf_config
from shoal.model.lora_adapter import LORA_TARGETS, LoraAdapterError, load_peft_adapter
from tests.support.engine_runs import mixed_prompts, run_to_completion
from tests.support.lora_adapters import write_adapter
from tests.support.tiny_model import write_tiny_model


@pytest.mark.parametrize("rslora", [False, True], ids=["lora", "rslora"])
def test_each_projection_adds_peft_s_own_delta(tiny_model_dir, tmp_path, rslora):
    adapted = write_adapter(tiny_model_dir, tmp_path, rank=8, alpha=16, use_rslora=rslora)
    adapter = load_peft_adapter("a", tmp_path, load_hf_config(tiny_model_dir), max_rank=16)
    assert adapter.scaling == (16 / math.sqrt(8) if rslora else 16 / 8)
    assert len(adapter.pairs) == 2 * len(LORA_TARGETS)
    for (layer, target), pair in adapter.pairs.items():
        block = adapted.base_model.model.model.layers[layer]
        module = getattr(block.self_attn if target in ("q_proj", "k_proj", "v_proj", "o_proj") else block.mlp, target)
        torch.testing.assert_close(pair.b @ pair.a, module.get_delta_weight("default"), rtol=1e-5, atol=1e-6)
    weights = (tmp_path / "adapter_model.safetensors").read_bytes()
    assert adapter.digest == hashlib.sha256(weights).hexdigest()


def test_an_adapter_that_cannot_be_used_is_refused_with_the_file_and_the_reason(tiny_model_dir, tmp_path):
    base = load_hf_config(tiny_model_dir)
    write_adapter(tiny_model_dir, tmp_path / "r16", rank=16)
    with pytest.raises(LoraAdapterError, match="rank 16 is above this engine's max_lora_rank 8"):
        load_peft_adapter("a", tmp_path / "r16", base, max_rank=8)
    other_base = write_tiny_model(tmp_path / "wide", hidden_size=96)
    write_adapter(other_base, tmp_path / "wide-adapter")
    with pytest.raises(
        LoraAdapterError,
        match=r"layer 0 down_proj has A \(8, 192\) and B \(96, 8\); this base model needs A \(8, 128\)",
    ):
        load_peft_adapter("a", tmp_path / "wide-adapter", base, max_rank=8)
    write_adapter(tiny_model_dir, tmp_path / "ok")
    digest = hashlib.sha256((tmp_path / "ok" / "adapter_model.safetensors").read_bytes()).hexdigest()
    assert load_peft_adapter("a", tmp_path / "ok", base, max_rank=8, sha256=digest.upper()).digest == digest
    with pytest.raises(LoraAdapterError, match="SHA-256 is .* not the 00 given"):
        load_peft_adapter("a", tmp_path / "ok", base, max_rank=8, sha256="00")
    weights = tmp_path / "ok" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(LoraAdapterError, match="adapter_model.safetensors: not a safetensors file"):
        load_peft_adapter("a", tmp_path / "ok", base, max_rank=8)
    write_adapter(tiny_model_dir, tmp_path / "dora", use_dora=True)
    with pytest.raises(LoraAdapterError, match="use_dora=True is not supported"):
        load_peft_adapter("a", tmp_path / "dora", base, max_rank=8)
    with pytest.raises(LoraAdapterError, match="adapter_config.json: cannot be read"):
        load_peft_adapter("a", tmp_path / "missing", base, max_rank=8)


# Families beyond Llama's whose layers place the adapted projections differently: q/k norms per head
# (Qwen3), norms after attention and the MLP with soft caps (Gemma 2), residual multipliers (Granite),
# fused q/k/v and gate/up projections (Phi-3: an adapter of qkv_proj split as the weight is).
LORA_FAMILIES = ("qwen3-qk-norm", "gemma2", "granite-multipliers", "phi3-fused-projections")


@pytest.mark.parametrize("attention_kernel", ["rows", "tiles"], ids=["native-layer", "torch-layer"])
@pytest.mark.parametrize("family", ["llama", *LORA_FAMILIES])
def test_the_model_with_an_adapter_gives_transformers_and_peft_s_logits(
    family, tiny_model_dir, shoal_cache_dir, tmp_path, attention_kernel
):
    """Float32, a tiny model with a random adapter on every projection: shoal's logits for a prompt
    whose rows all run the adapter are PEFT's; the layer run as one native object (its parts, each
    given the adapted rows' deltas) and as torch code alike. The base model's stay the base's."""
    from shoal import LLM
    from shoal.model.lora_batch import LoraBatch, PackedAdapter
    from tests.support.family_variants import COMMON, LAYER_VARIANTS
    from tests.support.logits import forward_logits
    from tests.support.tiny_model import write_random_family_model

    model_dir = tiny_model_dir
    if family != "llama":
        config_class, model_class, fields = LAYER_VARIANTS[family]
        model_dir = tmp_path / family
        write_random_family_model(model_dir, config_class, model_class, {**COMMON, **fields})
    adapted = write_adapter(model_dir, tmp_path / "adapter").eval()
    options = dict(dtype="float32", device="cpu", kv_cache_bytes=1 << 20, block_size=4)
    llm = LLM(str(model_dir), cache_dir=str(shoal_cache_dir), attention_kernel=attention_kernel, **options)
    model = llm.engine.model
    assert all((layer.native is not None) == (attention_kernel == "rows") for layer in model.layers)
    adapter = load_peft_adapter("a", tmp_path / "adapter", model.config, max_rank=8)
    packed = PackedAdapter(adapter, torch.float32, torch.device("cpu"), tile_rows=16, prepack=True)
    ids = [5, 17, 42, 8, 99, 23, 61, 7, 30, 12, 77]
    lora = LoraBatch.of_rows([packed] * len(ids), model.lora_widths, torch.device("cpu"))
    with torch.no_grad():
        expected = adapted(torch.tensor([ids])).logits[0]
        with adapted.disable_adapter():
            base = adapted(torch.tensor([ids])).logits[0]
    tolerance = 2e-4 if family == "llama" else 1e-3  # test_architectures' bound for the families
    assert (expected - base).abs().max() > 20 * tolerance  # the adapter changes the logits
    torch.testing.assert_close(forward_logits(llm, ids, lora), expected, rtol=0, atol=tolerance)
    torch.testing.assert_close(forward_logits(llm, ids), base, rtol=0, atol=tolerance)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    """Four random adapters of the tiny model (ranks 4 and 8), by name: their directories and PEFT models."""
    root = tmp_path_factory.mktemp("adapters")
    made = {}
    for i, (rank, alpha) in enumerate([(8, 16), (4, 8), (8, 32), (4, 4)]):
        directory = root / f"a{i}"
        made[f"a{i}"] = (directory, write_adapter(tiny_model_dir, directory, rank=rank, alpha=alpha).eval())
    return made


def modules(adapters) -> tuple[str, ...]:
    return tuple(f"{name}={directory}" for name, (directory, _) in adapters.items())


GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=3, max_tokens=16, ignore_eos=True)


def test_greedy_output_with_an_adapter_is_transformers_and_peft_s(make_tiny_engine, adapters):
    engine = make_tiny_engine(enable_lora=True, max_loras=2, lora_modules=modules(adapters))
    prompt = [5, 17, 42, 8, 99, 23, 61]
    for name, (_, reference) in adapters.items():
        with torch.no_grad():
            expected = reference.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
        assert run_to_completion(engine, {name: (prompt, GREEDY, name)})[name] == expected[0, len(prompt) :].tolist()


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_batch_over_four_adapters_and_the_base_gives_each_request_its_output_alone(
    make_tiny_engine, adapters, params
):
    """16 requests, over 4 adapters and the base model, at once (max_loras 4): each one's tokens are
    its tokens alone; half share a prompt prefix, which an adapter's request never takes from the
    base model's cache or another adapter's."""
    names = [None, *adapters]
    prompts = mixed_prompts(16, seed=11)
    requests = {f"r{i}": (prompt, params, names[i % len(names)]) for i, prompt in enumerate(prompts)}
    make = lambda: make_tiny_engine(enable_lora=True, max_loras=4, lora_modules=modules(adapters))  # noqa: E731
    alone = {}
    for request_id, request in requests.items():
        alone.update(run_to_completion(make(), {request_id: request}))
    engine = make()
    assert run_to_completion(engine, requests) == alone
    assert len({tuple(alone[f"r{i}"]) for i in range(5)}) == 5  # each adapter writes its own tokens


def test_a_step_runs_at_most_max_loras_adapters_and_memory_holds_max_cpu_loras(make_tiny_engine, adapters):
    """Four adapters under max_loras 2 and max_cpu_loras 2: every request still gets its tokens;
    adapters given back are read again when asked for."""
    requests = {name: ([9, 8, 7, 6, 5], GREEDY, name) for name in adapters}
    expected = {}
    for request_id, request in requests.items():
        expected.update(
            run_to_completion(make_tiny_engine(enable_lora=True, lora_modules=modules(adapters)), {request_id: request})
        )
    engine = make_tiny_engine(enable_lora=True, max_loras=2, max_cpu_loras=2, lora_modules=modules(adapters))
    scheduled, schedule = [], engine.scheduler.schedule

    def recording(*args, **kwargs):
        chunks = schedule(*args, **kwargs)
        scheduled.append({c.seq.lora for c in chunks})
        return chunks

    engine.scheduler.schedule = recording
    assert run_to_completion(engine, requests) == expected
    assert max(len(adapters_in_step) for adapters_in_step in scheduled) == 2
    assert len(engine.loras.held) == 2 and engine.loras.loads > len(adapters)  # some read again


def test_adapters_load_and_unload_at_run_time(make_tiny_engine, adapters):
    from shoal.errors import ModelNotFoundError

    engine = make_tiny_engine(enable_lora=True)
    directory, _ = adapters["a1"]
    with pytest.raises(ModelNotFoundError, match="the model 'a1' does not exist"):
        engine.add_request("x", [1, 2, 3], GREEDY, lora="a1")
    engine.load_lora_adapter("a1", str(directory))
    engine.add_request("running", [1, 2, 3], GREEDY, lora="a1")
    engine.step()
    engine.unload_lora_adapter("a1")  # the running request keeps it
    with pytest.raises(ModelNotFoundError):
        engine.add_request("y", [1, 2, 3], GREEDY, lora="a1")
    assert len(run_to_completion(engine, {})["running"]) == 16
    assert not engine.loras.retiring and "a1" not in engine.loras.held
    with pytest.raises(LoraAdapterError, match="rank 8 is above this engine's max_lora_rank 4"):
        make_tiny_engine(enable_lora=True, max_lora_rank=4).load_lora_adapter("a0", str(adapters["a0"][0]))


def test_held_adapters_count_in_the_memory_plan(tiny_model_dir, tmp_path):
    """adapter_memory_bytes bounds what a held adapter of that rank takes; the KV fraction is of what
    the held adapters leave free, and a fixed KV cache beside more adapters than fit is refused."""
    from shoal.config.engine import EngineConfig
    from shoal.engine.replica import kv_budget
    from shoal.model.lora_adapter import adapter_memory_bytes
    from shoal.model.lora_batch import PackedAdapter

    config = load_hf_config(tiny_model_dir)
    write_adapter(tiny_model_dir, tmp_path / "r8", rank=8)
    packed = PackedAdapter(
        load_peft_adapter("a", tmp_path / "r8", config, 8), torch.float32, torch.device("cpu"), 16, True
    )
    held = {id(t): t for pair in packed.adapter.pairs.values() for t in (pair.a, pair.b)}
    held |= {id(t): t for factors in packed.factors.values() for t in factors if isinstance(t, torch.Tensor)}
    taken = sum(t.numel() * t.element_size() for t in held.values())
    assert taken <= adapter_memory_bytes(config, 8) <= 2 * taken
    free, each = 1 << 30, adapter_memory_bytes(config, 16)
    plain = EngineConfig(model="m", kv_cache_fraction=0.5)
    lora = EngineConfig(model="m", kv_cache_fraction=0.5, enable_lora=True, max_loras=2, max_cpu_loras=6)
    assert kv_budget(plain, config, free) == free // 2
    assert kv_budget(lora, config, free) == (free - 6 * each) // 2
    too_many = EngineConfig(model="m", kv_cache_bytes=free - each, enable_lora=True, max_cpu_loras=2)
    with pytest.raises(MemoryError, match="2 LoRA adapters of rank up to 16"):
        kv_budget(too_many, config, free)


@pytest.mark.parametrize("half", [False, True], ids=["f32", "f16"])
def test_a_llama_cpp_lora_gguf_is_its_peft_adapter(tiny_model_dir, shoal_cache_dir, tmp_path, half):
    """The pairs of a LoRA GGUF (llama.cpp's layout: q/k rows in rotary order, alpha / rank) equal
    the PEFT adapter's it was written from (to float16 where it is float16), and an engine serving
    both gives the same tokens for each."""
    from shoal.model.lora_gguf import gguf_adapter, read_gguf_lora
    from tests.support.lora_adapters import tokens_with_adapter, write_gguf_lora

    base = load_hf_config(tiny_model_dir)
    write_adapter(tiny_model_dir, tmp_path / "peft", rank=8, alpha=16)
    path = write_gguf_lora(tmp_path / "peft", tmp_path / "a.gguf", base.num_heads, base.num_kv_heads, half)
    peft = load_peft_adapter("a", tmp_path / "peft", base, max_rank=16)
    read = gguf_adapter("a", read_gguf_lora(path), base, max_rank=16)
    assert (read.rank, read.scaling, set(read.pairs)) == (8, 2.0, set(peft.pairs))
    rounded = (lambda t: t.half().float()) if half else (lambda t: t)
    for key, pair in peft.pairs.items():
        assert torch.equal(read.pairs[key].a, rounded(pair.a))
        assert torch.equal(read.pairs[key].b, rounded(pair.b / 2.0) * 2.0)
    if not half:
        params = SamplingParams(temperature=0.8, seed=3, max_tokens=10, ignore_eos=True)
        modules = (f"p={tmp_path / 'peft'}", f"g={path}")
        run = lambda name: tokens_with_adapter(tiny_model_dir, shoal_cache_dir, modules, [5, 17, 42, 8], params, name)  # noqa: E731
        assert run("g") == run("p") != run(None)


def test_a_gguf_that_is_not_a_lora_of_this_model_is_refused_by_name(tiny_model_dir, tmp_path):
    import gguf

    from shoal.model.lora_gguf import gguf_adapter, read_gguf_lora
    from tests.support.lora_adapters import write_gguf_lora

    base = load_hf_config(tiny_model_dir)
    write_adapter(tiny_model_dir, tmp_path / "peft", rank=8, alpha=16)
    path = write_gguf_lora(tmp_path / "peft", tmp_path / "a.gguf", base.num_heads, base.num_kv_heads)
    with pytest.raises(LoraAdapterError, match="rank 8 is above this engine's max_lora_rank 4"):
        gguf_adapter("a", read_gguf_lora(path), base, max_rank=4)
    with pytest.raises(LoraAdapterError, match="SHA-256 is"):
        read_gguf_lora(path, sha256="0" * 64)
    model = gguf.GGUFWriter(str(tmp_path / "model.gguf"), "llama")
    model.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    for write in (model.write_header_to_file, model.write_kv_data_to_file, model.write_tensors_to_file, model.close):
        write()
    with pytest.raises(LoraAdapterError, match="a GGUF model, not a LoRA adapter"):
        read_gguf_lora(tmp_path / "model.gguf")
    other = read_gguf_lora(path)
    with pytest.raises(LoraAdapterError, match="a LoRA for gemma2 models"):
        gguf_adapter("a", dataclasses.replace(other, architecture="gemma2"), base, max_rank=16)
