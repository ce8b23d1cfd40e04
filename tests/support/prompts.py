"""Prompts shared by the parallelism tests."""

from __future__ import annotations

TINY_PROMPTS = [[(7 * i + j) % 90 + 3 for j in range(5 + 3 * i)] for i in range(8)]


TEXT_PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "Water boils at",
    "The best way to learn",
    "In 1492,",
    "My favourite colour is",
    "To be or not to be",
]
