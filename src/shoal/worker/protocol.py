"""Request bodies of the OpenAI-compatible endpoints, validated with pydantic, and their mapping to
SamplingParams. Every field is either served or refused: an unknown field is a 400 that names it,
never silently ignored; wrong types and values are 400s too."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shoal.engine.sampling_params import SamplingParams
from shoal.engine.structured_outputs import StructuredOutputs
from shoal.errors import InvalidRequestError
from shoal.model.chat_template import RENDER_VARIABLES


class Strict(BaseModel):
    """A request object whose unknown fields are refused."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: Literal[False] = False


class StructuredOutputsField(Strict):
    """vLLM's `structured_outputs`: exactly one of a JSON schema, any JSON object, a regular
    expression, a list of choices, or a grammar (Lark, or GBNF/EBNF)."""

    json_: dict | bool | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def spec(self) -> StructuredOutputs:
        param = "structured_outputs"
        if isinstance(self.json_, str):
            return StructuredOutputs(json=self.json_, param=param)
        if self.json_ is not None:
            return StructuredOutputs.from_schema(self.json_, param)
        return StructuredOutputs(
            json_object=bool(self.json_object), regex=self.regex, choice=self.choice, grammar=self.grammar, param=param
        )


class SamplingFields(Strict):
    """Fields shared by completions and chat completions (OpenAI names, vLLM extensions)."""

    model: str
    n: int = Field(1, ge=1, le=16)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    # shoal extension, for failover: continue after these output tokens (n must be 1), of whose
    # text the client already has resume_text_offset characters (default: all).
    resume_token_ids: list[int] | None = None
    resume_text_offset: int | None = Field(None, ge=0)
    # shoal extension, set by routers: the KV peer (ZeroMQ address) of a worker that holds the KV of
    # the prompt and resumed tokens; this worker imports it instead of computing it.
    kv_source: str | None = Field(None, min_length=1, max_length=512)
    structured_outputs: StructuredOutputsField | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # SGLang's name for include_stop_str_in_output (its routers send it on every request).
    no_stop_trim: bool = False
    # Hidden states are never returned; SGLang's routers send the default, false, on every request.
    return_hidden_states: Literal[False] = False
    # Read by routers (session affinity, admission class); a worker has no use for them.
    user: str | None = None
    priority: Literal["critical", "standard", "sheddable"] | None = None
    # OpenAI's service tier: a router admits "priority" as critical, "flex" as sheddable, "auto" and
    # "default" as standard (shoal.router.placement.route_request); the response reports the tier served.
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None
    # OpenAI's cache key and end-user key: a router places a request by prompt_cache_key, ahead of
    # guessing from its prefix, and takes safety_identifier (else user) as the request's end user.
    prompt_cache_key: str | None = Field(None, min_length=1, max_length=1024)
    safety_identifier: str | None = Field(None, min_length=1, max_length=1024)
    # OpenAI's logit_bias: token id (as a string) -> a value in [-100, 100] added to its logit.
    logit_bias: dict[str, float] | None = Field(None, max_length=1024)

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys_are_token_ids(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        if bias and not all(key.isdigit() for key in bias):
            raise ValueError("logit_bias keys must be token ids")
        return bias

    def served_tier(self) -> str | None:
        """The tier the response reports: "auto" is served as "default" (None: none was asked)."""
        return "default" if self.service_tier == "auto" else self.service_tier

    def output_constraint(self) -> StructuredOutputs | None:
        """What the output must match, from the request's fields (None: free text)."""
        return self.structured_outputs.spec() if self.structured_outputs else None

    def sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        seed: int | None,
        constraint: StructuredOutputs | None = None,
        skip_special_tokens: bool = True,
        predicted_token_ids: tuple[int, ...] = (),
    ) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            seed=seed,
            logprobs=logprobs,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            structured_outputs=constraint,
            skip_special_tokens=skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output or self.no_stop_trim,
            logit_bias=tuple(sorted((int(token), value) for token, value in (self.logit_bias or {}).items())),
            predicted_token_ids=predicted_token_ids,
        )


class CompletionRequest(SamplingFields):
    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False


class ContentPart(Strict):
    type: Literal["text", "input_text", "output_text"]
    text: str


class ToolCallFunction(Strict):
    name: str
    arguments: str


class ToolCall(Strict):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(Strict):
    """One message of the history. The fields OpenAI's clients echo back with an assistant message
    (refusal, annotations, audio) are accepted when empty; the legacy `function_call` of an
    assistant message and `function` messages (its result, by `name`) become a tool call and its
    tool message (ChatCompletionRequest's legacy functions)."""

    role: Literal["system", "user", "assistant", "tool", "developer", "function"]
    content: str | list[ContentPart] | None = None
    # An assistant message's reasoning, as a reply gave it: passed to the chat template (Qwen3's
    # keeps it for the turns after the last user message, and drops it before).
    reasoning_content: str | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: None = None
    annotations: list[Any] | None = Field(None, max_length=0)
    audio: None = None
    function_call: ToolCallFunction | None = None

    @model_validator(mode="after")
    def _tool_fields_fit_the_role(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.reasoning_content is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry reasoning_content")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        if self.function_call is not None and (self.role != "assistant" or self.tool_calls):
            raise ValueError("function_call belongs to an assistant message without tool_calls")
        if self.role == "function" and not self.name:
            raise ValueError("a function message needs the name of the function it answers")
        return self

    def text(self) -> str:
        """Content as plain text; list content keeps its text parts."""
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionDefinition(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


class JsonSchemaFormat(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class Prediction(Strict):
    """OpenAI's predicted output: text the answer is expected to repeat, drafted for speculative
    decoding (a draft is kept only where it is the token the request samples itself, so a
    prediction changes the speed, never the tokens)."""

    type: Literal["content"]
    content: str | list[ContentPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('`json_schema` is required with type "json_schema", and only then')
        return self


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    # The last message (the assistant's) is left open and the output continues it.
    continue_final_message: bool = False
    # The reasoning parser's switches (SGLang's and vLLM's names), for a model whose family writes a
    # reasoning section (Qwen3, SmolLM3: worker/reasoning_use.py): separate_reasoning false leaves
    # the section in content as written; include_reasoning false drops it; stream_reasoning false
    # sends a stream's reasoning in one delta once the section closes. A model of another family
    # has no reasoning to split, whatever their values.
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    include_reasoning: bool = True
    # Variables for the chat template (vLLM's field), such as {"enable_thinking": false} for Qwen3.
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's reasoning effort: the template variable `reasoning_effort` of a template that reads it
    # (gpt-oss's harmony system message says `Reasoning: low|medium|high`, medium by default); a
    # model whose template does not read it leaves it unused, and the worker logs that.
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    # OpenAI's verbosity: the template variable `verbosity` of a template that reads it (logged as
    # unused elsewhere, as reasoning_effort is); output modalities: text only (audio is refused).
    verbosity: Literal["low", "medium", "high"] | None = None
    modalities: list[Literal["text"]] | None = None
    prediction: Prediction | None = None
    # The Responses API's truncation, on chat requests: "auto" drops messages from the middle of a
    # conversation over the context (worker/conversation_truncation); "disabled" refuses it.
    truncation: Literal["auto", "disabled"] = "disabled"
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # OpenAI's legacy functions: served as tools (one call at most), the answer in the legacy shape
    # (message.function_call, finish_reason "function_call"; chat_choice).
    functions: list[FunctionDefinition] | None = Field(None, min_length=1)
    function_call: Literal["none", "auto"] | FunctionName | None = None
    # OpenAI's stored-completion fields: metadata (up to 16 string pairs) labels a stored completion.
    # A router stores completions (shoal.router.stored_completions) and never forwards `store`; a
    # worker has no store, so `store: true` sent to it directly is refused.
    metadata: dict[str, str] | None = Field(None, max_length=16)
    store: Literal[False] | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata_fits(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        if metadata and any(len(key) > 64 or len(value) > 512 for key, value in metadata.items()):
            raise ValueError("metadata keys are at most 64 characters and values at most 512")
        return metadata

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables_are_free(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(set(kwargs or {}) & set(RENDER_VARIABLES))
        if taken:
            raise ValueError(f"{taken[0]!r} is set by the request itself, not by chat_template_kwargs")
        return kwargs

    @model_validator(mode="after")
    def _legacy_functions_are_tools(self) -> ChatCompletionRequest:
        """functions and function_call as tools, tool_choice and one call at most; the history's
        function calls and results as tool calls and tool messages (ids by their order)."""
        if self.functions is None:
            if self.function_call is not None:
                raise ValueError("function_call needs functions")
        else:
            if self.tools is not None or self.tool_choice is not None:
                raise ValueError("give functions and function_call, or tools and tool_choice, not both")
            self.tools = [Tool(type="function", function=function) for function in self.functions]
            choice = self.function_call
            named = isinstance(choice, FunctionName)
            self.tool_choice = NamedToolChoice(type="function", function=choice) if named else choice
            self.parallel_tool_calls = False
        self.messages = _legacy_calls_as_tool_calls(self.messages)
        return self

    @property
    def legacy_functions(self) -> bool:
        """Whether the answer takes the legacy function_call shape."""
        return self.functions is not None

    @model_validator(mode="after")
    def _final_message_can_be_continued(self) -> ChatCompletionRequest:
        if self.continue_final_message:
            if self.messages[-1].role != "assistant":
                raise ValueError("continue_final_message needs the last message to be the assistant's")
            if self.add_generation_prompt:
                raise ValueError("continue_final_message needs add_generation_prompt false")
        return self

    def output_constraint(self) -> StructuredOutputs | None:
        """From `response_format` or `structured_outputs` (one of them at most); tool calls add
        their own constraint (see tool_calling)."""
        format_ = self.response_format
        if format_ is None or format_.type == "text":
            return super().output_constraint()
        if self.structured_outputs is not None:
            raise InvalidRequestError(
                "give either response_format or structured_outputs, not both", param="response_format"
            )
        if format_.type == "json_object":
            return StructuredOutputs(json_object=True, param="response_format")
        schema = format_.json_schema.schema_
        return StructuredOutputs.from_schema({} if schema is None else schema, "response_format.json_schema.schema")


def _legacy_calls_as_tool_calls(messages: list[ChatMessage]) -> list[ChatMessage]:
    """An assistant message's function_call as a tool call ("call_legacy_N", N its order), and a
    function message as the tool message answering the latest call of that name."""
    converted, latest, calls = [], {}, 0
    for message in messages:
        if message.function_call is not None:
            call_id, calls = f"call_legacy_{calls}", calls + 1
            latest[message.function_call.name] = call_id
            call = ToolCall(id=call_id, function=message.function_call)
            message = message.model_copy(update={"function_call": None, "tool_calls": [call]})
        elif message.role == "function":
            if message.name not in latest:
                raise ValueError(f"function message for {message.name!r} answers no function_call before it")
            message = message.model_copy(update={"role": "tool", "tool_call_id": latest[message.name]})
        converted.append(message)
    return converted
