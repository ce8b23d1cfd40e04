"""Requests as the simulated workers see them: token ids with the workload's sharing structure.

Every distinct message (role and content) is a segment of `estimate_tokens(content)` content
tokens followed by the chat template's MESSAGE_OVERHEAD_TOKENS, with ids of its own; a prompt is
its messages' segments in order. Equal messages give equal ids, so a shared system prompt, or a
conversation's history, hits the prefix cache exactly where the real engine's would. The tokens a
request generates are the first `max_tokens` ids of its answer's segment, which is the assistant
message of the conversation's next turn: a turn's prompt extends the previous turn's prompt and
output, as with a real chat template.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shoal.bench.text import MESSAGE_OVERHEAD_TOKENS, estimate_tokens
from shoal.bench.workloads import BenchRequest, Message
from shoal.protocol.prefix_keys import CanonicalPrompt

SEGMENT_BITS = 20  # token id = segment id << SEGMENT_BITS | position in the segment


@dataclass(frozen=True)
class SimRequest:
    """One workload request: its place in the workload, the body the router gets, its prompt as
    (segment id, tokens) pairs and the segment its output comes from."""

    index: int
    conversation_id: int
    turn: int
    arrival_s: float
    messages: tuple[Message, ...]
    max_tokens: int
    segments: tuple[tuple[int, int], ...]
    answer_segment: int

    @property
    def prompt_tokens(self) -> int:
        return sum(length for _, length in self.segments)

    def body(self, model: str) -> dict:
        """The chat completion body a client sends (as `shoal bench` does, without a session key)."""
        return {"model": model, "messages": list(self.messages), "max_tokens": self.max_tokens}

    def prompt_token_ids(self) -> list[int]:
        ids: list[int] = []
        for segment, length in self.segments:
            ids.extend(range(segment << SEGMENT_BITS, (segment << SEGMENT_BITS) + length))
        return ids

    def token_ends(self, canonical: CanonicalPrompt) -> list[int]:
        """Where each prompt token ends in the canonical text (`canonical_chat` of the messages), as
        a worker would find it: a message's template tokens where its text starts, its text's
        tokens spread evenly over the text."""
        ends, spans, reached = [], iter(canonical.spans), 0
        for message, (_, length) in zip(self.messages, self.segments):
            words = length - MESSAGE_OVERHEAD_TOKENS
            if message["content"]:
                start, text = next(spans)
                ends.extend([start] * MESSAGE_OVERHEAD_TOKENS)
                ends.extend(start + -(-(i + 1) * len(text) // words) for i in range(words))
                reached = start + len(text)
            else:
                ends.extend([reached] * length)
        return ends

    def output_token_id(self, position: int) -> int:
        """The id of the output token at `position` (0-based) of this request's answer."""
        return (self.answer_segment << SEGMENT_BITS) + position


def sim_requests(workload: Sequence[BenchRequest]) -> list[SimRequest]:
    """The workload's requests in their order, with segments shared wherever messages are equal."""
    segment_ids: dict[tuple[str, str], int] = {}

    def segment(message: Message) -> tuple[int, int]:
        key = (message["role"], message["content"])
        if key not in segment_ids:
            segment_ids[key] = len(segment_ids)
        length = estimate_tokens(message["content"]) + MESSAGE_OVERHEAD_TOKENS
        if length >= 1 << SEGMENT_BITS:
            raise ValueError(f"a message of {length} tokens is too long to simulate")
        return segment_ids[key], length

    next_turn = {(r.conversation_id, r.turn): r for r in workload}
    requests = []
    for r in workload:
        following = next_turn.get((r.conversation_id, r.turn + 1))
        if following is not None:
            answer = segment(following.messages[len(r.messages)])[0]
        else:
            answer = len(segment_ids)
            segment_ids[("answer", str(r.index))] = answer
        requests.append(
            SimRequest(
                r.index,
                r.conversation_id,
                r.turn,
                r.arrival_s,
                r.messages,
                r.max_tokens,
                tuple(segment(m) for m in r.messages),
                answer,
            )
        )
    return requests
