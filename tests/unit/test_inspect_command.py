"""`shoal inspect`: a model's family, size and KV bytes from its headers, and whether it runs here."""

from __future__ import annotations

import json
import shutil

from safetensors.torch import load_file

from shoal.cli import main


def inspect(capsys, *argv: str) -> tuple[int, str]:
    code = main(["inspect", *argv])
    return code, capsys.readouterr().out


def test_the_bundled_gguf_is_a_llama_that_runs(capsys):
    code, out = inspect(capsys, "smollm2-135m-instruct", "--json")
    report = json.loads(out)
    assert code == 0 and report["runs"] and report["family"] == "llama" and report["format"] == "gguf"
    assert report["parameters"] == 134_515_008 and report["tensor_types"]["Q4_1"] > 0
    # 30 layers x 3 KV heads x (64 keys + 65 values: the ones column) x 2 bytes
    assert report["kv_bytes_per_token_16bit"] == 30 * 3 * 129 * 2


def test_a_hugging_face_directory_is_read_from_its_headers(capsys, tiny_model_dir):
    code, out = inspect(capsys, str(tiny_model_dir))
    weights = {}
    for path in tiny_model_dir.glob("*.safetensors"):
        weights.update(load_file(path))
    assert code == 0 and "runs here: yes" in out and "family: llama" in out
    assert f"parameters: {sum(t.numel() for t in weights.values()):,}" in out


def test_a_mixture_of_experts_reports_the_parameters_a_token_runs_through(capsys, tmp_path):
    from tests.support.family_variants import COMMON
    from tests.support.tiny_model import write_random_family_model

    fields = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=48, mlp_only_layers=[1])
    model = write_random_family_model(
        tmp_path, "Qwen3MoeConfig", "Qwen3MoeForCausalLM", {**COMMON, **fields, "num_hidden_layers": 3}
    )
    code, out = inspect(capsys, str(tmp_path), "--json")
    report = json.loads(out)
    total = sum(p.numel() for p in model.parameters())
    # Two sparse layers each leave 4 of their 6 experts (gate, up, down: 3 x 64 x 48 each) unused a token.
    assert code == 0 and report["parameters"] == total
    assert report["active_parameters"] == total - 2 * 4 * 3 * 64 * 48


def test_a_model_shoal_cannot_run_says_why(capsys, tiny_model_dir, tmp_path):
    unknown = tmp_path / "unknown"
    shutil.copytree(tiny_model_dir, unknown)
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "gemma9"}))
    code, out = inspect(capsys, str(unknown))
    assert code == 1 and "runs here: no:" in out and "model_type 'gemma9' is not supported" in out


def test_no_model_at_the_path_is_exit_status_2(capsys, tmp_path):
    assert main(["inspect", str(tmp_path / "absent")]) == 2
    assert "unknown model" in capsys.readouterr().err


def test_sliding_window_layers_count_their_window_not_the_context(capsys, tmp_path):
    from tests.support.family_variants import COMMON, LAYER_VARIANTS
    from tests.support.tiny_model import write_random_family_model

    config_class, model_class, fields = LAYER_VARIANTS["gemma3"]  # layers 0-1 windowed (21), layer 2 not
    write_random_family_model(tmp_path, config_class, model_class, {**COMMON, **fields})
    code, out = inspect(capsys, str(tmp_path), "--json")
    report = json.loads(out)
    per_layer_token = 2 * (16 + 17) * 2  # 2 KV heads x (16 keys + 17 values: the ones column) x 2 bytes
    assert code == 0 and report["kv_bytes_per_token_16bit"] == per_layer_token
    assert report["kv_window_bytes_16bit"] == 2 * 21 * per_layer_token
    _, text = inspect(capsys, str(tmp_path))
    assert "in its 1 full-attention layers; its 2 sliding-window layers hold at most 21 tokens each" in text
