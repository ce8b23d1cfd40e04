"""shoal: distributed LLM inference.

`from shoal import LLM, SamplingParams` gives the offline API. Imports are lazy so that light
processes (the router) can import shoal's subpackages without loading torch.
"""

from typing import Any

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from shoal.llm import LLM

        return LLM
    if name == "SamplingParams":
        from shoal.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'shoal' has no attribute {name!r}")
