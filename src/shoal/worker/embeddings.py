"""`POST /v1/embeddings` (OpenAI's): each input tokenized, run through the model without sampling
(shoal.engine.embedding_run: the final hidden states pooled as the engine is configured), and
returned as floats or base64 (little-endian float32, as the openai client decodes it), truncated to
`dimensions` where asked and then scaled to unit length again when the engine normalises."""

from __future__ import annotations

import base64
from typing import Literal

import numpy
import torch
from pydantic import Field, field_validator

from shoal.errors import InvalidRequestError
from shoal.model.tokenizer import Tokenizer
from shoal.worker.protocol import Strict

MAX_INPUTS = 2048  # OpenAI's limit on inputs a request


class EmbeddingRequest(Strict):
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    # Read by routers (the end user); a worker has no use for it.
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _inputs_are_not_empty(cls, value: str | list) -> str | list:
        items = [value] if isinstance(value, str) else value
        if not items or len(items) > MAX_INPUTS or any(len(item) == 0 for item in items if not isinstance(item, int)):
            raise ValueError(f"input must be 1 to {MAX_INPUTS} non-empty texts or token lists")
        return value

    def token_ids(self, tokenizer: Tokenizer) -> list[list[int]]:
        """Each input as token ids (texts tokenized as completions' prompts are)."""
        value = self.input
        if isinstance(value, str):
            return [tokenizer.encode(value)]
        if all(isinstance(item, int) for item in value):
            return [list(value)]
        return [tokenizer.encode(item) if isinstance(item, str) else list(item) for item in value]


def embedding_response(
    request: EmbeddingRequest, vectors: list[torch.Tensor], prompt_tokens: int, model_name: str, normalize: bool
) -> dict:
    """OpenAI's list of embeddings, in input order, with the prompt tokens counted."""
    data = []
    for index, vector in enumerate(vectors):
        if request.dimensions is not None:
            if request.dimensions > vector.numel():
                raise InvalidRequestError(
                    f"dimensions {request.dimensions} exceeds the model's {vector.numel()}", param="dimensions"
                )
            vector = vector[: request.dimensions]
            vector = torch.nn.functional.normalize(vector, dim=0) if normalize else vector
        values = vector.float().cpu().numpy()
        embedding = (
            base64.b64encode(values.astype(numpy.dtype("<f4")).tobytes()).decode()
            if request.encoding_format == "base64"
            else values.tolist()
        )
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    return {
        "object": "list",
        "data": data,
        "model": model_name,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
