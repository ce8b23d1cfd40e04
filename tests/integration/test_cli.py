"""The `shoal` command runs the engine on a model and prints the completion."""

from __future__ import annotations

import subprocess
import sys


def test_generate_prints_a_completion(tiny_model_dir, shoal_cache_dir):
    env_cmd = [
        sys.executable,
        "-m",
        "shoal.cli",
        "generate",
        "--model",
        str(tiny_model_dir),
        "--dtype",
        "float32",
        "--max-tokens",
        "8",
        "--temperature",
        "0",
        "hello",
    ]
    result = subprocess.run(
        env_cmd,
        capture_output=True,
        text=True,
        timeout=300,
        env={"SHOAL_CACHE_DIR": str(shoal_cache_dir), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()


def test_chat_streams_a_reply_and_ends_on_empty_line(tiny_model_dir, shoal_cache_dir):
    cmd = [
        sys.executable,
        "-m",
        "shoal.cli",
        "chat",
        "--model",
        str(tiny_model_dir),
        "--dtype",
        "float32",
        "--max-tokens",
        "8",
        "--temperature",
        "0",
    ]
    result = subprocess.run(
        cmd,
        input="hi there\n\n",
        capture_output=True,
        text=True,
        timeout=300,
        env={"SHOAL_CACHE_DIR": str(shoal_cache_dir), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    assert "> " in result.stdout and len(result.stdout.splitlines()) >= 2
