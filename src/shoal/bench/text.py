"""Prompt text of a roughly known token count: random common English words, each about one token
for the usual BPE tokenizers (a character-level tokenizer counts several per word)."""

from __future__ import annotations

import random
from collections.abc import Sequence

WORDS = tuple(
    """
the of and to in is it you that he was for on are as with his they at be this have from or one had by
word but not what all were we when your can said there use an each which she do how their if will up
other about out many then them these so some her would make like him into time has look two more write
go see number no way could people my than first water been call who its now find long down day did get
come made may part over new sound take only little work know place year live me back give most very
after thing our just name good sentence man think say great where help through much before line right
too mean old any same tell boy follow came want show also around form three small set put end does
another well large must big even such because turn here why ask went men read need land different home
us move try kind hand picture again change off play spell air away animal house point page letter
mother answer found study still learn should world high every near add food between own below country
plant last school father keep tree never start city earth eye light thought head under story saw left
few while along might close something seem next hard open example begin life always those both paper
together got group often run important until children side feet car mile night walk white sea began
grow took river four carry state once book hear stop without second later miss idea enough eat face
""".split()
)

MESSAGE_OVERHEAD_TOKENS = 4  # role and delimiters that a chat template adds around each message


def words(rng: random.Random, count: int) -> str:
    """`count` words drawn with replacement from WORDS, space-separated (count ≥ 0)."""
    return " ".join(rng.choice(WORDS) for _ in range(count))


def estimate_tokens(text: str) -> int:
    """About one token per word."""
    return len(text.split())


def estimate_prompt_tokens(messages: Sequence[dict[str, str]]) -> int:
    """The estimated prompt of a chat: its words plus the template's few tokens per message."""
    return sum(estimate_tokens(m["content"]) + MESSAGE_OVERHEAD_TOKENS for m in messages)
