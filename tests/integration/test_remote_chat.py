"""`shoal chat --url`: a streamed, multi-turn terminal conversation with a running cluster over the
Responses API; the second turn is answered with the first in its context."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx


def test_a_terminal_conversation_with_the_cluster_keeps_its_history(deploy):
    _, url, _, _ = deploy(replicas=1)
    chat = subprocess.run(
        [
            sys.executable,
            "-m",
            "shoal.cli",
            "chat",
            "--url",
            url,
            "--model",
            "tiny",
            "--temperature",
            "0",
            "--max-tokens",
            "8",
        ],
        input="hello\nand then\n\n",
        text=True,
        capture_output=True,
        timeout=120,
        env={**os.environ, "OPENAI_API_KEY": ""},
    )
    assert chat.returncode == 0, chat.stderr
    banner, first, second, end = chat.stdout.split("\n> ")  # each prompt starts a line
    assert banner.startswith(f"shoal chat with tiny at {url}") and end == ""
    assert first and second
    expected = httpx.post(
        url + "/v1/chat/completions",
        timeout=60,
        json={
            "model": "tiny",
            "temperature": 0,
            "max_tokens": 8,
            "messages": [
                {"role": "user", "content": "hello"},
                {"role": "assistant", "content": first},
                {"role": "user", "content": "and then"},
            ],
        },
    ).json()["choices"][0]["message"]["content"]
    assert second == expected


def test_an_unreachable_cluster_is_reported_and_the_chat_goes_on():
    chat = subprocess.run(
        [sys.executable, "-m", "shoal.cli", "chat", "--url", "http://127.0.0.1:9", "--model", "x"],
        input="hello\n\n",
        text=True,
        capture_output=True,
        timeout=60,
    )
    assert chat.returncode == 0 and "cannot reach http://127.0.0.1:9" in chat.stderr
    assert "Traceback" not in chat.stderr
