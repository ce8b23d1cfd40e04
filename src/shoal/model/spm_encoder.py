"""llama.cpp's SentencePiece (SPM) merging of one text fragment into token ids.

The fragment's characters start as symbols. Every adjacent pair whose concatenation is a token is a
candidate; the candidate whose token has the highest score is merged first (ties: the leftmost), and
the new symbol's pairs with its neighbours become candidates, until none is left. A final symbol that
is a token gives its id; one that is not (a character outside the vocabulary) gives the ids of its
UTF-8 bytes (`<0xXX>` tokens). This is `llm_tokenizer_spm_session` in llama.cpp's src/llama-vocab.cpp;
it is not merge-rank BPE (a `tokenizers` BPE model ranks each split of a token separately, and breaks
ties by rank, not by position).

No merge can cross a point between two characters that no token holds side by side, so the fragment
is cut at such points (between a word and the U+2581 after it, in most vocabularies) and the pieces
merged alone, each remembered: the same ids, in a fraction of the time for text that repeats words.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

_CACHE_SIZE = 1 << 16  # pieces remembered (cleared when full)


class SpmEncoder:
    """Merges a fragment (spaces already escaped to U+2581) into ids.

    `pieces` maps every token text to its id (the last id where a text repeats, as llama.cpp's map
    does), `scores` holds each id's score, and `byte_ids[b]` the id that stands for byte b, or None
    where the vocabulary has none."""

    def __init__(self, pieces: Mapping[str, int], scores: Sequence[float], byte_ids: Sequence[int | None]):
        if len(byte_ids) != 256:
            raise ValueError("byte_ids needs one entry per byte value")
        self._pieces = dict(pieces)
        self._scores = [float(s) for s in scores]
        self._byte_ids = list(byte_ids)
        self._max_chars = max((len(text) for text in self._pieces), default=1)
        # Every two characters that stand side by side in some token.
        self._pairs = {text[i : i + 2] for text in self._pieces for i in range(len(text) - 1)}
        self._cache: dict[str, list[int]] = {}

    def encode(self, text: str) -> list[int]:
        pairs, cache = self._pairs, self._cache
        ids: list[int] = []
        start = 0
        for end in range(1, len(text) + 1):
            if end < len(text) and text[end - 1 : end + 1] in pairs:
                continue
            chunk = text[start:end]
            start = end
            merged = cache.get(chunk)
            if merged is None:
                merged = self.merge(chunk)
                if len(cache) >= _CACHE_SIZE:
                    cache.clear()
                cache[chunk] = merged
            ids.extend(merged)
        return ids

    def merge(self, text: str) -> list[int]:
        """`text` merged as one fragment, uncut and not remembered (what `encode` equals)."""
        n = len(text)
        if n == 0:
            return []
        pieces, scores, max_chars = self._pieces, self._scores, self._max_chars
        # Symbol i starts at character i; its length is 0 once merged into the symbol on its left.
        length = [1] * n
        prev = list(range(-1, n - 1))
        following = list(range(1, n + 1))
        following[-1] = -1
        heap: list[tuple[float, int, int, int]] = []
        for i in range(n - 1):
            token = pieces.get(text[i : i + 2])
            if token is not None:
                heap.append((-scores[token], i, i + 1, 2))
        heapq.heapify(heap)
        push, pop = heapq.heappush, heapq.heappop
        while heap:
            _, left, right, size = pop(heap)
            left_len, right_len = length[left], length[right]
            if left_len == 0 or right_len == 0 or left_len + right_len != size:
                continue  # one side was merged since this pair was queued
            length[left], length[right] = size, 0
            after = following[right]
            following[left] = after
            if after >= 0:
                prev[after] = left
            before = prev[left]
            if before >= 0 and (joined := length[before] + size) <= max_chars:
                token = pieces.get(text[before : before + joined])
                if token is not None:
                    push(heap, (-scores[token], before, left, joined))
            if after >= 0 and (joined := size + length[after]) <= max_chars:
                token = pieces.get(text[left : left + joined])
                if token is not None:
                    push(heap, (-scores[token], left, after, joined))
        ids: list[int] = []
        i = 0
        while i >= 0:
            symbol = text[i : i + length[i]]
            token = pieces.get(symbol)
            if token is not None:
                ids.append(token)
            else:
                ids.extend(self._byte_id(b) for b in symbol.encode("utf-8", "surrogatepass"))
            i = following[i]
        return ids

    def _byte_id(self, byte: int) -> int:
        token = self._byte_ids[byte]
        if token is None:
            raise ValueError(f"the vocabulary has no token for byte 0x{byte:02X} (nor an unknown token)")
        return token
