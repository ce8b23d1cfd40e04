"""Errors raised while locating, reading or converting a model checkpoint."""
from __future__ import annotations


class ModelLoadError(ValueError):
    """A checkpoint could not be found, read or converted; the message says which file and why."""
