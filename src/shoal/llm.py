"""Offline API in vLLM's style: `LLM(model).generate(prompts, params)` and `.chat(messages, params)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from typing import Any

from shoal.config.engine import EngineConfig
from shoal.engine.engine import LLMEngine
from shoal.engine.outputs import RequestOutput
from shoal.engine.sampling_params import SamplingParams
from shoal.model.tokenizer import Tokenizer

Prompt = str | list[int] | dict[str, Any]
Message = dict[str, Any]


class LLM:
    """Runs a batch of prompts to completion with continuous batching. Keyword arguments are
    EngineConfig fields (dtype, device, kv_cache_bytes, max_num_seqs, tensor_parallel_size,
    pipeline_parallel_size, ...), as in vLLM."""

    def __init__(self, model: str = "smollm2-135m-instruct", **engine_options: Any):
        self.engine = LLMEngine(EngineConfig.from_dict({"model": model, **engine_options}))
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stops the processes of a tensor-parallel replica (nothing to do for one process)."""
        self.engine.shutdown()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self, prompts: Prompt | Seq[Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Returns one finished RequestOutput per prompt, in prompt order. A prompt is text, a list of
        token ids, or {"prompt_token_ids": [...]} / {"prompt": "..."}."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = [_unwrap(p) for p in prompts]
        params = _per_prompt(sampling_params, len(prompts))
        request_ids = [f"offline-{next(self._ids)}" for _ in prompts]
        try:
            for request_id, prompt, p in zip(request_ids, prompts, params):
                self.engine.add_request(request_id, prompt, p)
        except Exception:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise
        finished: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    finished[output.request_id] = output
        return [finished[r] for r in request_ids]

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Applies the model's chat template to each conversation (with `chat_template_kwargs` as
        more template variables, such as {"enable_thinking": False}), then generates."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.engine.tokenizer
        prompts = [
            tokenizer.encode(
                tokenizer.apply_chat_template(
                    c, add_generation_prompt=add_generation_prompt, template_kwargs=chat_template_kwargs
                ),
                add_special_tokens=False,
            )
            for c in conversations
        ]
        return self.generate(prompts, sampling_params)


def _unwrap(prompt: Prompt) -> str | list[int]:
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        return prompt["prompt"]
    return prompt


def _per_prompt(params: SamplingParams | Seq[SamplingParams] | None, count: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * count
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling params for {count} prompts")
    return list(params)
