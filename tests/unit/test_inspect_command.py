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
