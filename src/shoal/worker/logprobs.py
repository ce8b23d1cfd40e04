"""Engine logprobs rendered in OpenAI's completion and chat shapes."""

from __future__ import annotations


class LogprobRenderer:
    """Engine logprobs ({sampled id: lp, top ids...} per token) in OpenAI's completion or chat shape."""

    def __init__(self, tokenizer, top: int | None, chat: bool):
        self.tokenizer = tokenizer
        self.top = top
        self.chat = chat

    def _piece(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def __call__(self, token_ids: list[int], entries: list[dict[int, float]] | None) -> dict | None:
        if self.top is None or entries is None:
            return None
        pieces = [self._piece(t) for t in token_ids]
        tops = [sorted(e.items(), key=lambda kv: -kv[1])[: self.top] for e in entries]
        sampled = [e.get(t) for t, e in zip(token_ids, entries)]
        if self.chat:
            return {
                "content": [
                    {
                        "token": piece,
                        "logprob": lp,
                        "bytes": list(piece.encode()),
                        "top_logprobs": [
                            {"token": self._piece(i), "logprob": v, "bytes": list(self._piece(i).encode())}
                            for i, v in top
                        ],
                    }
                    for piece, lp, top in zip(pieces, sampled, tops)
                ]
            }
        return {
            "tokens": pieces,
            "token_logprobs": sampled,
            "top_logprobs": [{self._piece(i): v for i, v in top} for top in tops],
            "text_offset": [],
        }
