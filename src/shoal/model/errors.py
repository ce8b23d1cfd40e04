"""Errors raised while loading a model checkpoint or using its tokenizer."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A checkpoint could not be found, read or converted; the message says which file and why."""


class ChatTemplateError(ValueError):
    """The model's chat template rejected the conversation (its `raise_exception`) or failed while rendering."""
