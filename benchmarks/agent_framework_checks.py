"""The agent frameworks people point at an OpenAI-compatible endpoint, run unchanged against one:
each check makes the framework's ordinary calls and says whether they got through. Runs in the
frameworks' own venv (benchmarks/agent_frameworks.py makes it), standard library and the frameworks
only. A check passes when every call got an answer; an answer the framework could not use (a small
model's wits: invalid output, too many turns) passes as `model`, a refusal of the request (an HTTP
4xx) fails as `refused`, anything else fails as `error`.

    python agent_framework_checks.py BASE_URL MODEL     # prints one JSON object
"""

from __future__ import annotations

import json
import sys
import traceback

import openai
import pydantic

BASE_URL, MODEL = sys.argv[1], sys.argv[2]
ASK = "What is the weather in Paris? Answer in one short sentence."


class Weather(pydantic.BaseModel):
    city: str
    temperature: int


def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny and 21 degrees in {city}"


def outcome(error: BaseException | None) -> dict:
    """passed / model / refused / error, with the exception that decided it."""
    if error is None:
        return {"result": "passed"}
    chain, seen = [], error
    while seen is not None and len(chain) < 10:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    for exc in chain:
        if isinstance(exc, openai.APIStatusError) and 400 <= exc.status_code < 500:
            return {"result": "refused", "status": exc.status_code, "detail": str(exc)[:400]}
        if isinstance(exc, openai.APIStatusError | openai.APIConnectionError):
            return {"result": "error", "detail": f"{type(exc).__name__}: {str(exc)[:400]}"}
    return {"result": "model", "detail": f"{type(error).__name__}: {str(error)[:300]}"}


def openai_agents(responses: bool, tools: bool) -> None:
    from agents import (
        Agent,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=BASE_URL, api_key="unused")
    model = (OpenAIResponsesModel if responses else OpenAIChatCompletionsModel)(model=MODEL, openai_client=client)
    agent = Agent(
        name="weather", instructions="Be brief.", model=model, tools=[function_tool(get_weather)] if tools else []
    )
    Runner.run_sync(agent, ASK, max_turns=3)


def pydantic_ai(output: bool, tools: bool) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=BASE_URL, api_key="unused"))
    agent = Agent(model, output_type=Weather if output else str, tools=[get_weather] if tools else [])
    agent.run_sync(ASK, model_settings={"max_tokens": 96})


def instructor_check(mode: str) -> None:
    import instructor

    client = instructor.from_openai(
        openai.OpenAI(base_url=BASE_URL, api_key="unused"), mode=getattr(instructor.Mode, mode)
    )
    client.chat.completions.create(
        model=MODEL, response_model=Weather, messages=[{"role": "user", "content": ASK}], max_retries=1, max_tokens=96
    )


def langchain(kind: str) -> None:
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(base_url=BASE_URL, api_key="unused", model=MODEL, max_tokens=96)
    if kind == "structured":
        chat.with_structured_output(Weather, method="json_schema").invoke(ASK)
    elif kind == "tools":
        chat.bind_tools([get_weather]).invoke(ASK)
    else:
        chat.invoke(ASK)


CHECKS = {
    "openai-agents chat": lambda: openai_agents(responses=False, tools=False),
    "openai-agents chat + tool": lambda: openai_agents(responses=False, tools=True),
    "openai-agents responses": lambda: openai_agents(responses=True, tools=False),
    "openai-agents responses + tool": lambda: openai_agents(responses=True, tools=True),
    "pydantic-ai text": lambda: pydantic_ai(output=False, tools=False),
    "pydantic-ai structured output": lambda: pydantic_ai(output=True, tools=False),
    "pydantic-ai tool": lambda: pydantic_ai(output=False, tools=True),
    "instructor TOOLS": lambda: instructor_check("TOOLS"),
    "instructor JSON_SCHEMA": lambda: instructor_check("JSON_SCHEMA"),
    "instructor JSON": lambda: instructor_check("JSON"),
    "langchain invoke": lambda: langchain("plain"),
    "langchain structured output": lambda: langchain("structured"),
    "langchain tools": lambda: langchain("tools"),
    "langchain stream": lambda: list(
        __import__("langchain_openai")
        .ChatOpenAI(base_url=BASE_URL, api_key="unused", model=MODEL, max_tokens=32)
        .stream(ASK)
    ),
}


def main() -> None:
    results = {}
    for name, check in CHECKS.items():
        try:
            check()
            results[name] = outcome(None)
        except Exception as error:  # noqa: BLE001 (every failure is classified and reported)
            results[name] = outcome(error)
            results[name]["trace"] = traceback.format_exc()[-600:]
    print(json.dumps(results))


if __name__ == "__main__":
    main()
