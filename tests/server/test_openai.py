"""OpenAI routes through the real `openai` client and raw httpx, on a tiny random llama."""

import httpx
import openai
import pytest

from tests.engine.tiny_llama import CONTEXT
from tests.server.conftest import API_KEY
from tests.tolerances import EPS

EPS32 = EPS["float32"]

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Tell me about paged attention."}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=300)


def greedy_chat(client, name, **kw):
    return client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=12,
                                          temperature=0, **kw)


def test_models_lists_the_served_model(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == [server.loaded.name]
    assert client.models.retrieve(server.loaded.name).id == server.loaded.name


def test_chat_non_stream_and_stream_agree(client, server):
    reply = greedy_chat(client, server.loaded.name)
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 12
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 12

    chunks = list(greedy_chat(client, server.loaded.name, stream=True))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert all(c.usage is None for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == choice.message.content


def test_chat_message_has_every_field_openai_requires(server):
    """OpenAI's schema requires role, content and refusal (null when none) on the message."""
    body = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    reply = httpx.post(server.v1 + "/chat/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    message = reply.json()["choices"][0]["message"]
    assert set(message) >= {"role", "content", "refusal"} and message["refusal"] is None


def test_chat_matches_completion_of_the_rendered_prompt(client, server):
    rendered = server.loaded.tokenizer.apply_chat_template(MESSAGES)
    chat = greedy_chat(client, server.loaded.name)
    plain = client.completions.create(model=server.loaded.name, prompt=rendered, max_tokens=12,
                                      temperature=0)
    assert plain.object == "text_completion"
    assert plain.choices[0].text == chat.choices[0].message.content
    assert plain.usage.prompt_tokens == chat.usage.prompt_tokens


def test_stream_include_usage_adds_a_final_usage_chunk(client, server):
    chunks = list(greedy_chat(client, server.loaded.name, stream=True,
                              stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 12
    assert chunks[-2].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks[:-1])


def test_raw_sse_framing(server):
    body = {"messages": MESSAGES, "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.v1 + "/chat/completions", json=body, timeout=300) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2])


def test_completions_stream_and_token_prompt(client, server):
    prompt = "Once upon a time"
    reply = client.completions.create(model=server.loaded.name, prompt=prompt, max_tokens=10,
                                      temperature=0)
    chunks = list(client.completions.create(model=server.loaded.name, prompt=prompt,
                                            max_tokens=10, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == reply.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    ids = server.loaded.tokenizer.encode(prompt, add_special_tokens=True)
    by_ids = client.completions.create(model=server.loaded.name, prompt=ids, max_tokens=10,
                                       temperature=0)
    assert by_ids.choices[0].text == reply.choices[0].text


def test_model_field_is_optional(server):
    r = httpx.post(server.v1 + "/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=300)
    assert r.status_code == 200 and r.json()["model"] == server.loaded.name


def test_stop_string_cuts_the_output(client, server):
    full = greedy_chat(client, server.loaded.name).choices[0].message.content
    stop = full[3:5]
    assert stop and full.index(stop) >= 1
    cut = greedy_chat(client, server.loaded.name, stop=[stop])
    assert cut.choices[0].message.content == full[:full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(client, server):
    runs = [client.completions.create(model=server.loaded.name, prompt="abc", max_tokens=8,
                                      temperature=1.0, seed=1234).choices[0].text
            for _ in range(2)]
    assert runs[0] == runs[1]


def test_penalties_reach_the_sampler(client, server):
    """The OpenAI client sends presence/frequency penalties; strong ones change a greedy reply
    that repeats itself (the tiny model loops), and the extension repetition_penalty too."""
    def text(**kw):
        return client.completions.create(model=server.loaded.name, prompt="ab ab ab",
                                         max_tokens=40, temperature=0, **kw).choices[0].text

    plain = text()
    assert text(presence_penalty=0.0, frequency_penalty=0.0) == plain
    assert text(presence_penalty=2.0, frequency_penalty=2.0) != plain
    assert text(extra_body={"repetition_penalty": 5.0}) != plain


def test_chat_logprobs_stream_and_not(client, server):
    reply = greedy_chat(client, server.loaded.name, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 3 and item.logprob <= 0
        assert item.top_logprobs[0].token == item.token           # greedy took the top one
        # one float32 value reported twice
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob, rel=2 * EPS32, abs=0)
        assert [t.logprob for t in item.top_logprobs] == sorted(
            (t.logprob for t in item.top_logprobs), reverse=True)
        assert bytes(item.bytes).decode("utf-8") == item.token
    streamed = [item for chunk in greedy_chat(client, server.loaded.name, logprobs=True,
                                              top_logprobs=3, stream=True)
                if chunk.choices and chunk.choices[0].logprobs
                for item in chunk.choices[0].logprobs.content]
    assert [(i.token, round(i.logprob, 5)) for i in streamed] == [
        (i.token, round(i.logprob, 5)) for i in content]
    assert greedy_chat(client, server.loaded.name).choices[0].logprobs is None


def test_completion_logprobs(client, server):
    reply = client.completions.create(model=server.loaded.name, prompt="abc", max_tokens=6,
                                      temperature=0, logprobs=2)
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    distinct = [(logprob, top) for logprob, top in zip(lp.token_logprobs, lp.top_logprobs)
                if len(top) == 2]   # two tokens of one text (partial UTF-8) share a dict key
    assert distinct
    for logprob, top in distinct:
        assert max(top.values()) == pytest.approx(logprob, rel=2 * EPS32, abs=0)


# ---- bad input: every error is a 400/401/404 with an OpenAI error body; serving goes on ----

def post(server, path, body, **kw):
    return httpx.post(server.v1 + path, json=body, timeout=300, **kw)


def assert_error(response, status, param=None, words=()):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param
    for word in words:
        assert word in error["message"]
    return error


def test_unknown_field_is_400_naming_it(server, client):
    r = post(server, "/chat/completions", {"messages": MESSAGES, "bogus_knob": 1})
    assert_error(r, 400, "bogus_knob", ["bogus_knob"])
    r = post(server, "/chat/completions",
             {"messages": [{"role": "user", "content": "x", "colour": "red"}]})
    assert_error(r, 400, "messages.0.colour", ["colour"])
    with pytest.raises(openai.BadRequestError) as info:
        greedy_chat(client, server.loaded.name, extra_body={"mystery": True})
    assert "mystery" in str(info.value)


@pytest.mark.parametrize("body,param", [
    ({"temperature": 3.5}, "temperature"), ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
    ({"n": 2}, "n"), ({"stop": ["x"] * 17}, "stop"), ({"messages": []}, "messages"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -2.1},
                                                       "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs")])
def test_bad_values_are_400(server, body, param):
    error = assert_error(post(server, "/chat/completions", {"messages": MESSAGES, **body}), 400)
    assert error["param"] == param


def test_n_2_says_unsupported(server):
    error = assert_error(post(server, "/completions", {"prompt": "x", "n": 2}), 400, "n")
    assert "not supported" in error["message"]


def test_unknown_model_is_404(server, client):
    assert_error(post(server, "/completions", {"model": "gpt-9", "prompt": "x"}), 404, "model",
                 ["gpt-9"])
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MESSAGES)


def test_over_long_prompt_is_400(server):
    r = post(server, "/completions", {"prompt": "z" * (CONTEXT + 10), "max_tokens": 1})
    assert assert_error(r, 400, words=["tokens"])["code"] == "context_length_exceeded"
    r = post(server, "/completions", {"prompt": "short", "max_tokens": CONTEXT})
    assert_error(r, 400, words=["max_tokens"])


def test_malformed_json_is_400(server):
    r = httpx.post(server.v1 + "/completions", content=b"{not json", timeout=60,
                   headers={"content-type": "application/json"})
    assert_error(r, 400, words=["JSON"])


def test_api_key_is_required_when_configured(keyed_server):
    body = {"prompt": "hi", "max_tokens": 2}
    assert_error(post(keyed_server, "/completions", body), 401)
    assert_error(post(keyed_server, "/completions", body,
                      headers={"Authorization": "Bearer wrong"}), 401)
    assert_error(post(keyed_server, "/completions", body, headers={"x-api-key": API_KEY}), 401)
    ok = post(keyed_server, "/completions", body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert ok.status_code == 200
    good = openai.OpenAI(base_url=keyed_server.v1, api_key=API_KEY, max_retries=0, timeout=300)
    assert good.models.list().data[0].id == keyed_server.loaded.name
    bad = openai.OpenAI(base_url=keyed_server.v1, api_key="nope", max_retries=0, timeout=300)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(keyed_server.url + "/health").status_code == 200  # outside /v1


def test_server_still_serves_after_errors(server, client):
    for _ in range(3):
        post(server, "/chat/completions", {"messages": MESSAGES, "unknown": 1})
    assert greedy_chat(client, server.loaded.name).choices[0].finish_reason == "length"
