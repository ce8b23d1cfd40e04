"""A real worker process on loopback, driven with the official openai client."""

from __future__ import annotations

import httpx
import openai
import pytest

from shoal.protocol.keep_alive import REQUEST_HEADER as KEEP_ALIVE_HEADER
from tests.support.waiting import wait_for
from tests.support.workers import MODEL, scrape, start_worker, tiny_worker_args


@pytest.fixture
def client(worker_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=worker_url + "/v1", api_key="unused", max_retries=0)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_with_usage_and_token_ids(client):
    result = client.completions.create(
        model=MODEL, prompt="hello", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    choice = result.choices[0]
    assert choice.finish_reason == "length" and len(choice.model_extra["token_ids"]) == 6
    assert result.usage.completion_tokens == 6 and result.usage.prompt_tokens == 5


def test_streamed_text_equals_non_streamed_for_the_same_seed(client):
    args = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "tell me"}],
        max_tokens=12,
        seed=5,
        temperature=0.9,
        extra_body={"ignore_eos": True},
    )
    full = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    token_ids = [t for c in chunks if c.choices for t in (c.choices[0].model_extra or {}).get("token_ids", [])]
    assert text == full.choices[0].message.content
    assert token_ids == full.choices[0].model_extra["token_ids"]
    assert chunks[-1].usage.completion_tokens == 12


def test_n_choices_and_stop_sequences(client):
    result = client.completions.create(
        model=MODEL, prompt=[5, 6, 7], max_tokens=8, n=3, temperature=1.0, seed=1, extra_body={"ignore_eos": True}
    )
    assert sorted(c.index for c in result.choices) == [0, 1, 2]
    text = result.choices[0].text
    assert len(text) >= 2
    stopped = client.completions.create(
        model=MODEL,
        prompt=[5, 6, 7],
        max_tokens=8,
        temperature=1.0,
        seed=1,
        stop=[text[1:3]],
        extra_body={"ignore_eos": True},
    )
    assert stopped.choices[0].finish_reason == "stop" and text[1:3] not in stopped.choices[0].text


@pytest.mark.parametrize(
    "body,status",
    [
        ({"model": MODEL, "prompt": "x", "max_tokens": -3}, 400),
        ({"model": MODEL, "prompt": "x", "max_tokens": 10**12}, 400),
        ({"model": MODEL, "prompt": "x", "temperature": "hot"}, 400),
        ({"model": MODEL, "prompt": ""}, 400),
        ({"model": MODEL, "prompt": "x" * 2000}, 400),
        ({"model": "other", "prompt": "x"}, 404),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400),
    ],
)
def test_bad_input_gets_openai_errors_and_the_worker_keeps_serving(worker_url, client, body, status):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    response = httpx.post(worker_url + path, json=body, timeout=30)
    assert response.status_code == status
    assert set(response.json()["error"]) >= {"message", "type", "code"}
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=2).choices[0].text is not None


def test_malformed_json_is_a_400(worker_url):
    response = httpx.post(
        worker_url + "/v1/completions", content=b"{not json", timeout=30, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400


def test_client_disconnect_mid_stream_frees_the_request(worker_url):
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", worker_url + "/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        during = scrape(worker_url)
        assert during["shoal:num_requests_running"] == 1 and during["shoal:kv_cache_usage_perc"] > 0
    after = wait_for(
        lambda: (
            (m := scrape(worker_url))["shoal:num_requests_running"] == 0 and m["shoal:kv_cache_usage_perc"] == 0 and m
        )
    )
    assert after["shoal:num_requests_running"] == 0 and after["shoal:num_requests_waiting"] == 0
    assert after["shoal:kv_cache_usage_perc"] == 0
    load = httpx.get(worker_url + "/load").json()
    assert load["running"] == 0 and load["free_kv_blocks"] == load["num_kv_blocks"]


def test_metrics_have_vllm_names_and_count_what_was_served(worker_url, client):
    before = scrape(worker_url)
    for name in [
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "prompt_tokens_total",
        "generation_tokens_total",
        "num_preemptions_total",
        "time_to_first_token_seconds_count",
        "inter_token_latency_seconds_count",
        "e2e_request_latency_seconds_count",
        "process_resident_memory_bytes",
    ]:
        assert f"shoal:{name}" in before, name
    assert 0 <= before["shoal:device_utilization_perc[('device', 'cpu')]"] <= 1
    assert before["shoal:device_memory_total_bytes[('device', 'cpu')]"] > 0
    result = client.completions.create(
        model=MODEL, prompt="hello", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    after = scrape(worker_url)

    def delta(name: str) -> float:
        return after[f"shoal:{name}"] - before.get(f"shoal:{name}", 0)

    assert delta("prompt_tokens_total") == result.usage.prompt_tokens == 5
    assert delta("generation_tokens_total") == 6
    assert delta("prefix_cache_queries_total") == 5
    assert delta("time_to_first_token_seconds_count") == 1 and delta("e2e_request_latency_seconds_count") == 1
    assert delta("inter_token_latency_seconds_count") == 5
    assert delta("request_success_total[('finished_reason', 'length')]") == 1


def test_canary_generates_one_token_within_its_deadline(worker_url):
    response = httpx.get(worker_url + "/health/canary", params={"timeout_s": 30}, timeout=40)
    assert response.status_code == 200
    body = response.json()
    assert body["ok"] is True and len(body["token_ids"]) == 1 and body["latency_s"] < 30


def test_load_report_has_queue_memory_speed_and_capability(worker_url):
    load = httpx.get(worker_url + "/load").json()
    assert load["model"] == MODEL and load["max_model_len"] > 0 and load["block_size"] > 0
    for key in ("running", "waiting", "outstanding_prefill_tokens", "outstanding_decode_tokens", "free_kv_blocks"):
        assert isinstance(load[key], int) and load[key] >= 0, key
    for key in ("prefill_tokens_per_s", "decode_tokens_per_s", "capability"):
        assert load[key] > 0, key
    assert load["calibration"]["batch"] >= 1 and load["draining"] is False


def test_the_load_report_says_how_far_decode_steps_fall_from_the_reported_step(worker_url):
    body = {"model": MODEL, "prompt": "steady", "max_tokens": 16, "ignore_eos": True}
    assert httpx.post(worker_url + "/v1/completions", json=body, timeout=60).status_code == 200
    load = httpx.get(worker_url + "/load").json()
    assert load["decode_step_s"] > 0 and 0 <= load["decode_step_noise"] < 10, load


def test_outstanding_tokens_are_reported_while_a_request_runs(worker_url):
    body = {"model": MODEL, "prompt": "count", "max_tokens": 500, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", worker_url + "/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()  # kept: dropping the iterator would close the stream
        assert next(line for line in lines if line.startswith("data:"))
        load = httpx.get(worker_url + "/load").json()
    assert load["running"] == 1 and 0 < load["outstanding_decode_tokens"] < 500


def test_oversized_body_is_a_413(worker_url, client):
    body = {"model": MODEL, "prompt": "x" * (5 << 20)}
    response = httpx.post(worker_url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 413 and response.json()["error"]["code"] == 413
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=2).choices[0].text is not None


def test_logprobs_in_completions_and_chat(client):
    completion = client.completions.create(
        model=MODEL, prompt="hi", max_tokens=3, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    )
    lp = completion.choices[0].logprobs
    assert len(lp.token_logprobs) == 3 and all(v <= 0 for v in lp.token_logprobs)
    assert all(len(top) == 2 for top in lp.top_logprobs)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    # Greedy: the sampled token is the most likely one.
    assert all(c.logprob == max(t.logprob for t in c.top_logprobs) for c in content)


def test_resume_continues_a_stream_token_for_token(worker_url, client):
    args = dict(
        model=MODEL, prompt="resume me", max_tokens=14, temperature=0.9, seed=11, extra_body={"ignore_eos": True}
    )
    full = client.completions.create(**args).choices[0]
    head = full.model_extra["token_ids"][:5]
    head_text = client.completions.create(**{**args, "max_tokens": 5}).choices[0].text
    chunks = list(
        client.completions.create(
            **{**args, "extra_body": {"ignore_eos": True, "resume_token_ids": head}},
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    tail_ids = [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]]
    tail_text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert head + tail_ids == full.model_extra["token_ids"]
    assert head_text + tail_text == full.text
    assert chunks[-1].usage.completion_tokens == 14
    # Text the client did not get yet (offset short of the head's text) is handed out again.
    partial = list(
        client.completions.create(
            **{
                **args,
                "extra_body": {"ignore_eos": True, "resume_token_ids": head, "resume_text_offset": len(head_text) - 2},
            },
            stream=True,
        )
    )
    assert "".join(c.choices[0].text for c in partial) == full.text[len(head_text) - 2 :]


# What SGLang's Model Gateway (smg) and vllm-router add to every chat request they relay.
SGLANG_ROUTER_DEFAULTS = {
    "logprobs": False,
    "no_stop_trim": False,
    "continue_final_message": False,
    "skip_special_tokens": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
    "include_reasoning": True,
}


def test_a_request_with_the_fields_sglang_routers_add_is_served_as_without_them(client):
    args = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0)
    plain = client.chat.completions.create(**args, extra_body={"ignore_eos": True})
    relayed = client.chat.completions.create(**args, extra_body={"ignore_eos": True, **SGLANG_ROUTER_DEFAULTS})
    assert relayed.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize("field", ["include_stop_str_in_output", "no_stop_trim"])
def test_a_stop_string_stays_in_the_output_when_asked(client, field):
    args = dict(model=MODEL, prompt=[5, 6, 7], max_tokens=8, temperature=1.0, seed=1)
    text = client.completions.create(**args, extra_body={"ignore_eos": True}).choices[0].text
    stop = text[2:4]
    trimmed = client.completions.create(**args, stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    kept = client.completions.create(**args, stop=[stop], extra_body={"ignore_eos": True, field: True}).choices[0]
    assert trimmed.finish_reason == kept.finish_reason == "stop"
    assert kept.text == trimmed.text + stop


def test_the_openai_fields_sdks_send_are_served(client, worker_url):
    """service_tier is reported back (auto as default), in the response and every chunk; the cache
    and end-user keys (read by routers), verbosity and text modalities change no token."""
    args = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0)
    plain = client.chat.completions.create(**args)
    fields = dict(
        service_tier="auto",
        prompt_cache_key="agent-7",
        safety_identifier="end-user-1",
        verbosity="low",
        modalities=["text"],
        prediction={"type": "content", "content": "a draft"},
        metadata={"task": "greeting"},
        store=False,
    )
    served = client.chat.completions.create(**args, **fields)
    assert served.service_tier == "default" and served.choices[0].message.content == plain.choices[0].message.content
    chunks = list(client.chat.completions.create(**args, service_tier="flex", stream=True))
    assert {chunk.service_tier for chunk in chunks} == {"flex"}
    # A prediction that is the answer is drafted and kept; the answer is the same either way.
    answer = plain.choices[0].message.content
    before = scrape(worker_url)
    predicted = client.chat.completions.create(**args, prediction={"type": "content", "content": answer})
    assert predicted.choices[0].message.content == answer
    kept = predicted.usage.completion_tokens_details.accepted_prediction_tokens
    after = scrape(worker_url)
    assert kept > 0  # counted as vLLM counts speculative decoding, too
    assert (
        after["shoal:spec_decode_num_accepted_tokens_total"] - before["shoal:spec_decode_num_accepted_tokens_total"]
        == kept
    )
    assert after["shoal:spec_decode_num_drafts_total"] > before["shoal:spec_decode_num_drafts_total"]
    wrong = client.chat.completions.create(
        **args,
        prediction={"type": "content", "content": "zebra " * 8},
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(wrong)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
    counted = chunks[-1].usage.completion_tokens_details  # a prediction was given: its drafts are counted
    assert counted.accepted_prediction_tokens is not None and counted.rejected_prediction_tokens is not None
    assert plain.usage.completion_tokens_details is None  # no prediction: nothing to count


def test_logit_bias_forbids_and_forces_tokens(client):
    args = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0)
    plain = client.chat.completions.create(**args, extra_body={"ignore_eos": True}).choices[0]
    first = plain.model_extra["token_ids"][0]
    forbidden = client.chat.completions.create(
        **args, logit_bias={str(first): -100}, extra_body={"ignore_eos": True}
    ).choices[0]
    assert forbidden.model_extra["token_ids"][0] != first
    forced = client.chat.completions.create(**args, logit_bias={"42": 100}, extra_body={"ignore_eos": True}).choices[0]
    assert forced.model_extra["token_ids"] == [42] * 6


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"service_tier": "scale"}, "service_tier"),
        ({"logit_bias": {"a": 1}}, "logit_bias"),
        ({"logit_bias": {"3": 101}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"store": True}, "store"),
        ({"metadata": {"k": "v" * 513}}, "metadata"),
    ],
)
def test_audio_unknown_tiers_and_bad_biases_are_refused_by_name(worker_url, fields, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}
    response = httpx.post(worker_url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"].startswith(param)


def test_hidden_states_are_refused_by_name(worker_url):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "return_hidden_states": True}
    response = httpx.post(worker_url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "return_hidden_states"


def test_a_continued_final_message_is_the_prompt_the_output_follows(client):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ab"}]
    continued = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True, "continue_final_message": True, "add_generation_prompt": False},
    )
    as_text = client.completions.create(
        model=MODEL,
        prompt="<s>user\nhi</s>\n<s>assistant\nab",
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert continued.usage.prompt_tokens == as_text.usage.prompt_tokens
    assert continued.choices[0].model_extra["token_ids"] == as_text.choices[0].model_extra["token_ids"]


@pytest.mark.parametrize(
    "messages,extra",
    [
        ([{"role": "user", "content": "hi"}], {"continue_final_message": True, "add_generation_prompt": False}),
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}], {"continue_final_message": True}),
    ],
)
def test_a_final_message_that_cannot_be_continued_is_a_400(worker_url, messages, extra):
    body = {"model": MODEL, "messages": messages, **extra}
    response = httpx.post(worker_url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400 and "continue_final_message" in response.json()["error"]["message"]


def test_keep_alives_go_only_to_clients_that_ask_for_them(tiny_model_dir, shoal_cache_dir):
    """Steps of 0.7 s leave a stream silent past the worker's keep-alive interval: a router (asking
    with the header) hears what the engine is on; any other client gets the tokens alone."""
    process, url = start_worker(tiny_worker_args(tiny_model_dir, MODEL, step_delay_ms=700), shoal_cache_dir)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 3, "ignore_eos": True, "stream": True}
    try:
        lines = {}
        for asked in (False, True):
            headers = {KEEP_ALIVE_HEADER: "1"} if asked else {}
            with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers, timeout=60) as response:
                lines[asked] = list(response.iter_lines())
        assert not [line for line in lines[False] if line.startswith(":")]
        assert [line for line in lines[True] if line.startswith(": keep-alive {")]
        assert sum(line.startswith("data: {") for line in lines[False]) == sum(
            line.startswith("data: {") for line in lines[True]
        )
    finally:
        process.terminate()
        process.wait(timeout=30)
