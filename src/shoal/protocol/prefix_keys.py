"""Prefix keys: the names a router gives the prefixes of a request without a tokenizer, which a
worker gives again to the blocks it caches.

A request's canonical text (a chat's messages as `<|role|>content` lines, after its tools; a
completion's prompt) is cut into BLOCK_CHARS-character blocks, each named by a chained hash (of the
previous block's name and its characters), so equal names mean equal whole prefixes. With OpenAI's
prompt_cache_key a block of the key comes first. A LoRA adapter's requests have names of their own
(`salted_blocks`). Routers and workers compute these with the same functions, on the same body.

`CanonicalPrompt.spans` says where each message's own text sits in the canonical text: a worker
finds those texts again in the prompt its chat template renders, and so which of its token blocks
each prefix key needs (shoal.worker.prompt_keys).
"""

from __future__ import annotations

import hashlib
import json
from typing import NamedTuple

BLOCK_CHARS = 32


class CanonicalPrompt(NamedTuple):
    """`text`, and (offset in text, message text) for each message with text of its own, in order."""

    text: str
    spans: tuple[tuple[int, str], ...]


def canonical_chat(messages: list, tools: list | None = None, tool_choice: object = None) -> CanonicalPrompt:
    """A chat's canonical text: its tools (as JSON; they reach the prompt ahead of the conversation,
    and requests with the same tools share that prefix), then one `<|role|>content` line per message,
    so a conversation's next turn extends the previous one's text."""
    parts = [json.dumps(tools) if tools and tool_choice != "none" else ""]
    spans = []
    offset = len(parts[0])
    for message in messages:
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        content = content if isinstance(content, str) else ""
        header = f"<|{message.get('role')}|>"
        if content:
            spans.append((offset + len(header), content))
        line = f"{header}{content}\n"
        parts.append(line)
        offset += len(line)
    return CanonicalPrompt("".join(parts), tuple(spans))


def canonical_completion(prompt: str | list[int]) -> CanonicalPrompt:
    """A completion's canonical text: its prompt, or its token ids written out with spaces between."""
    text = prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
    return CanonicalPrompt(text, ((0, text),) if text else ())


def prefix_blocks(text: str, block_chars: int = BLOCK_CHARS, cache_key: str | None = None) -> tuple[bytes, ...]:
    """Chained hashes of the full blocks of `text` (a trailing partial block is not cached anyway).
    With a `cache_key` (OpenAI's prompt_cache_key), a block of the key comes first and the text's
    chain grows from it: requests with one key share that block whatever their text, so they go
    where the key went before (ahead of their text's prefix), and requests with other keys share
    none of its blocks."""
    blocks, parent = [], b""
    if cache_key is not None:
        parent = hashlib.blake2b(b"prompt_cache_key\0" + cache_key.encode(), digest_size=12).digest()
        blocks.append(parent)
    for start in range(0, len(text) - block_chars + 1, block_chars):
        parent = hashlib.blake2b(parent + text[start : start + block_chars].encode(), digest_size=12).digest()
        blocks.append(parent)
    return tuple(blocks)


def block_ends(text_length: int, cache_key: str | None, block_chars: int = BLOCK_CHARS) -> list[int]:
    """Where in the canonical text each of `prefix_blocks`' blocks ends (the key's block at 0)."""
    ends = [0] if cache_key is not None else []
    ends.extend(range(block_chars, text_length + 1, block_chars))
    return ends


def salted_blocks(blocks: tuple[bytes, ...], salt: str) -> tuple[bytes, ...]:
    """`blocks` made apart from every other salt's (a LoRA adapter's requests share no cached
    prefix with the base model's): still equal exactly where the blocks were."""
    key = hashlib.blake2b(salt.encode(), digest_size=32).digest()
    return tuple(hashlib.blake2b(block, digest_size=12, key=key).digest() for block in blocks)


def router_keys(text: str, cache_key: str | None, adapter: str | None) -> tuple[bytes, ...]:
    """The prefix keys a router gives a request with this canonical text, cache key and LoRA
    adapter (None: the base model)."""
    keys = prefix_blocks(text, cache_key=cache_key)
    return salted_blocks(keys, adapter) if adapter is not None else keys
