"""Texts that tokenizers disagree on: whitespace runs, unicode, emoji, digits, code and special
tokens written in text; plus seeded random mixtures of the same ingredients."""

from __future__ import annotations

import random

# Special token spellings of common vocabularies, written into text.
SPECIAL_SPELLINGS = (
    "<s>",
    "</s>",
    "<unk>",
    "<pad>",
    "<bos>",
    "<eos>",
    "<mask>",
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<|user|>",
    "<|assistant|>",
    "<|system|>",
    "<|end|>",
    "<|eot_id|>",
    "<unused0>",
    "[INST]",
    "[/INST]",
)

PYTHON = '''import os


class Greeter:
    """Says hello."""

    def __init__(self, name: str) -> None:
        self.name = name

    def greet(self, times: int = 3) -> list[str]:
        out = []
        for i in range(times):
\t\t    out.append(f"Hello, {self.name}! #{i:03d}")  # mixed tabs
        return out


if __name__ == "__main__":
    print(Greeter("wörld").greet())
'''

FIXED = (
    "",
    " ",
    "  ",
    "   ",
    "\t",
    "\n",
    "\n\n",
    "\n\n\n",
    "\t\n",
    " \n ",
    "Hello world",
    " Hello world",
    "Hello World",
    "  Hello  World  ",
    "Hello, world!",
    "   leading and trailing   ",
    "a\tb\t\tc\t\t\td",
    "tabs\t\t\tand    spaces     end",
    "line1\nline2\r\nline3\n\n\n",
    "\n\nstarts with newlines",
    "ends with newlines\n\n",
    "               fifteen spaces",
    " " * 40 + "forty",
    "\t" * 12 + "tabs",
    "words\u00a0with\u2009odd\u3000spaces\u200b",
    "don't I'M we'll they've she'd y'all",
    "numbers: 0 7 42 1234567890 3.14159 -273.15 1e-9 1,000,000",
    "1" * 40,
    "31415926535897932384626433832795028841971693993751",
    "2024-06-01T12:34:56Z 192.168.0.1 0xDEADBEEF",
    "café naïve résumé Ångström ß ŝ Æsir œuvre",
    "e\u0301 combining a\u0308 o\u0302\u0323",
    "Äpfel über Straße",
    "Cửa Việt unreachable Greeter",
    "日本語のテキストと中文，还有한국어도 있어요。",
    "这是一个测试。它有很多中文字符，没有空格。",
    "Здравствуй, мир! Привет",
    "مرحبا بالعالم، كيف حالك؟",
    "שלום עולם",
    "नमस्ते दुनिया",
    "ภาษาไทยไม่มีช่องว่าง",
    "Ελληνικά γράμματα",
    "emoji 😀🚀👍🏽 👨‍👩‍👧‍👦 🇯🇵 🏳️‍🌈 ❤️",
    "🤖" * 5,
    "🦙.cpp and 🤗 transformers",
    "http://example.com/path?q=1&r=two#frag",
    "MiXeD CaSe WORDS lowercase UPPERCASE",
    "\x00\x01 control chars \x7f\x1b[0m",
    "x" * 300,
    "ab" * 100,
    "<s>",
    "<s>Hello</s>",
    " <s> Hello </s> ",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nHi!<end_of_turn>\n<start_of_turn>model\n",
    "<|user|>\nQuestion<|end|>\n<|assistant|>\n  Answer  <|end|>",
    "[INST] Hello [/INST] Hi</s>[INST]   again   [/INST]",
    "<|im_start|<|im_end|>|><<s>>",
    "text<unk>text<pad>text<mask>",
    "<|endoftext|>after",
    "<unused0><unused0> x",
    PYTHON,
    PYTHON.replace("    ", "\t"),
    "def f(x):\n    return {'k': [x ** 2 for _ in range(10)]}  # comment\n",
    '```json\n{"a": [1, 2, 3], "b": {"c": null}}\n```',
)

_POOL = (
    " ",
    "  ",
    "    ",
    "\t",
    "\n",
    "\r\n",
    "\n\n",
    "a",
    "e",
    "the",
    "Hello",
    "world",
    "ing",
    ".",
    ",",
    "!",
    "'s",
    "0",
    "7",
    "42",
    "2024",
    "é",
    "ñ",
    "ß",
    "Ω",
    "Ж",
    "中",
    "文",
    "日本",
    "한",
    "ع",
    "ש",
    "ก",
    "😀",
    "👍🏽",
    "👨‍👩‍👧",
    "🇯🇵",
    "\u200d",
    "\u0301",
    "\x00",
    "\u00a0",
    "{",
    "}",
    "(",
    ")",
    ":",
    "def",
    "return",
    "_",
    "=",
    "#",
)


def random_texts(count: int, seed: int = 0, specials: tuple[str, ...] = SPECIAL_SPELLINGS) -> list[str]:
    """`count` texts of 1-40 ingredients each (pool pieces, special spellings, random code points)."""
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(1, 40)):
            roll = rng.random()
            if roll < 0.08 and specials:
                parts.append(rng.choice(specials))
            elif roll < 0.15:
                parts.append(
                    chr(rng.choice((rng.randint(0x20, 0x7E), rng.randint(0xA0, 0x2FFF), rng.randint(0x1F300, 0x1FAFF))))
                )
            else:
                parts.append(rng.choice(_POOL))
        texts.append("".join(parts))
    return texts


def corpus(random_count: int = 300, seed: int = 0) -> list[str]:
    """The fixed texts, then `random_count` random ones."""
    return [*FIXED, *random_texts(random_count, seed)]
