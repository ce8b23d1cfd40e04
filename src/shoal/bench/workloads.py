"""Workloads: seeded, deterministic lists of requests as plain data (no I/O), for a live run or a
simulator alike.

- `synthetic`: single-turn chats with prompt and output lengths from distributions.
- `multi-turn`: conversations over `system_prompts` system prompts (conversation i has number
  i mod N); turn k's messages are turn k-1's plus its answer and a new user message. Turn k may be
  sent only once turn k-1's answer has arrived; a live client puts the real answers in place of the
  generated ones (`with_answers`).
- `long-prompt`: single-turn chats of which exactly round(fraction · N) have long prompts.

Each kind of randomness (prompt lengths, output lengths, words, the long-prompt mix, arrivals) has
its own generator seeded from (seed, purpose): changing the arrival process, say, leaves the
prompts as they were.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Literal

from shoal.bench.arrivals import ArrivalProcess
from shoal.bench.lengths import Fixed, LengthDistribution
from shoal.bench.text import estimate_prompt_tokens, words

Message = dict[str, str]
Randoms = dict[str, random.Random]  # one generator per purpose
WorkloadKind = Literal["synthetic", "multi-turn", "long-prompt"]
MULTI_TURN_SYSTEM_PROMPT_TOKENS = 128


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload. `index` is its position in the workload, whose arrival times never
    decrease; `prompt_tokens` is an estimate (words plus chat-template overhead); turn k of a
    conversation comes after its turn k-1 and its messages extend turn k-1's."""

    index: int
    arrival_s: float
    messages: tuple[Message, ...]
    prompt_tokens: int
    max_tokens: int
    conversation_id: int
    turn: int


@dataclass(frozen=True)
class WorkloadConfig:
    """What to generate: `requests` ≥ 1 in all; `prompt_tokens` is each new user message's length;
    `system_prompt_tokens` the shared system prompt's (0: none), of which multi-turn conversations
    have `system_prompts` ≥ 1 distinct ones; `turns` ≥ 1 per conversation
    (multi-turn: ceil(requests / turns) conversations, the last turns cut to make `requests`);
    `long_fraction` in [0, 1] of the requests get `long_prompt_tokens` (long-prompt)."""

    kind: WorkloadKind
    requests: int
    prompt_tokens: LengthDistribution = Fixed(256)
    output_tokens: LengthDistribution = Fixed(128)
    system_prompt_tokens: int = 0
    system_prompts: int = 1
    turns: int = 3
    long_fraction: float = 0.1
    long_prompt_tokens: LengthDistribution = Fixed(2048)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("synthetic", "multi-turn", "long-prompt"):
            raise ValueError(f"unknown workload {self.kind!r}")
        if self.requests < 1:
            raise ValueError("a workload needs at least 1 request")
        if self.turns < 1:
            raise ValueError("a conversation needs at least 1 turn")
        if not 0 <= self.long_fraction <= 1:
            raise ValueError("the long-prompt fraction must be between 0 and 1")
        if self.system_prompt_tokens < 0:
            raise ValueError("the system prompt cannot have fewer than 0 tokens")
        if self.system_prompts < 1:
            raise ValueError("there must be at least 1 system prompt")

    def as_dict(self) -> dict:
        """For reports: lengths in their command-line form."""
        return {
            "kind": self.kind,
            "requests": self.requests,
            "prompt_tokens": str(self.prompt_tokens),
            "output_tokens": str(self.output_tokens),
            "system_prompt_tokens": self.system_prompt_tokens,
            "system_prompts": self.system_prompts,
            "turns": self.turns,
            "long_fraction": self.long_fraction,
            "long_prompt_tokens": str(self.long_prompt_tokens),
            "seed": self.seed,
        }


@dataclass(frozen=True)
class _Draft:
    """A request before its index, arrival time and prompt estimate are set."""

    messages: tuple[Message, ...]
    max_tokens: int
    conversation_id: int
    turn: int


def build_workload(config: WorkloadConfig, arrivals: ArrivalProcess) -> list[BenchRequest]:
    """The workload's requests in order of arrival; the same config and arrivals give the same list."""
    rngs = {
        purpose: random.Random(f"{config.seed}/{purpose}")
        for purpose in ("prompts", "outputs", "words", "mix", "arrivals")
    }
    count = config.system_prompts if config.kind == "multi-turn" else 1
    systems = [words(rngs["words"], config.system_prompt_tokens) for _ in range(count)]
    prefixes = [({"role": "system", "content": system},) if system else () for system in systems]
    drafts = (
        _conversations(config, prefixes, rngs)
        if config.kind == "multi-turn"
        else _single_turns(config, prefixes[0], rngs)
    )
    times = arrivals.times(len(drafts), rngs["arrivals"])
    return [
        BenchRequest(
            index, arrival, d.messages, estimate_prompt_tokens(d.messages), d.max_tokens, d.conversation_id, d.turn
        )
        for index, (d, arrival) in enumerate(zip(drafts, times))
    ]


def _single_turns(config: WorkloadConfig, prefix: tuple[Message, ...], rngs: Randoms) -> list[_Draft]:
    long = set()
    if config.kind == "long-prompt":
        long = set(rngs["mix"].sample(range(config.requests), round(config.long_fraction * config.requests)))
    drafts = []
    for i in range(config.requests):
        length = (config.long_prompt_tokens if i in long else config.prompt_tokens).sample(rngs["prompts"])
        user = {"role": "user", "content": words(rngs["words"], length)}
        drafts.append(_Draft((*prefix, user), config.output_tokens.sample(rngs["outputs"]), i, 0))
    return drafts


def _conversations(config: WorkloadConfig, prefixes: list[tuple[Message, ...]], rngs: Randoms) -> list[_Draft]:
    """Turn-major order (every conversation's turn 0, then every turn 1, ...), cut at `requests`.
    The generated answers are `max_tokens` words long, so the estimates assume full-length answers."""
    count = math.ceil(config.requests / config.turns)
    histories = []
    for conversation in range(count):
        messages, turns = prefixes[conversation % len(prefixes)], []
        for turn in range(config.turns):
            question = words(rngs["words"], config.prompt_tokens.sample(rngs["prompts"]))
            messages = (*messages, {"role": "user", "content": question})
            max_tokens = config.output_tokens.sample(rngs["outputs"])
            turns.append(_Draft(messages, max_tokens, conversation, turn))
            messages = (*messages, {"role": "assistant", "content": words(rngs["words"], max_tokens)})
        histories.append(turns)
    return [histories[c][t] for t in range(config.turns) for c in range(count)][: config.requests]


def with_answers(messages: tuple[Message, ...], answers: list[str]) -> list[Message]:
    """The messages with the i-th assistant message's content replaced by answers[i]; there must be
    exactly one answer per assistant message."""
    positions = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if len(positions) != len(answers):
        raise ValueError(f"{len(answers)} answers for {len(positions)} assistant messages")
    out = [dict(m) for m in messages]
    for position, answer in zip(positions, answers):
        out[position]["content"] = answer
    return out
