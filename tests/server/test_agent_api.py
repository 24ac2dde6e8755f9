"""Tool calls and thinking through the real `openai` and `anthropic` clients, on tiny random
Qwen3 models given Qwen3's chat template (one that thinks when asked, one whose generation
prompt opens the think block)."""

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.server.family_server import serve

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "forecast", "description": "Forecast",
                                           "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "clock", "parameters": {"type": "object"}}}]
ASK = [{"role": "user", "content": "Forecast for Paris?"}]
NAMED = {"type": "function", "function": {"name": "forecast"}}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    thread, engine, loaded = serve(tmp_path_factory, "qwen3")
    yield thread.url, loaded
    thread.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    thread, engine, loaded = serve(tmp_path_factory, "qwen3-thinking")
    yield thread.url, loaded
    thread.stop()
    engine.shutdown()


def oai(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)


def test_named_tool_call_streamed_as_openai_streams_it(qwen3):
    url, loaded = qwen3
    kw = dict(model=loaded.name, messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=0,
              max_tokens=80, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    reply = oai(url).chat.completions.create(**kw)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "forecast" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)

    chunks = list(oai(url).chat.completions.create(stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    head = deltas[0].tool_calls[0]
    assert (head.index, head.type, head.function.name) == (0, "function", "forecast")
    assert head.id.startswith("call_") and head.function.arguments == ""
    assert all(d.tool_calls[0].id is None and d.tool_calls[0].index == 0 for d in deltas[1:])
    streamed = "".join(d.tool_calls[0].function.arguments for d in deltas)
    assert streamed == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_round_trip_and_history_checks(qwen3):
    url, loaded = qwen3
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "forecast", "arguments": '{"city": "Paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    reply = oai(url).chat.completions.create(model=loaded.name, messages=history, tools=TOOLS,
                                             temperature=0, max_tokens=8)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    history[-1] = {"role": "tool", "tool_call_id": "call_9", "content": "sunny"}
    r = httpx.post(url + "/v1/chat/completions", json={"messages": history, "tools": TOOLS},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.2.tool_call_id"


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "wat"}}}}}]},
     "tools.0.function.parameters.properties.a.type"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}}}]},
     "tools.0"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "[z-a]"}}}}}},
     "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "bogus": 1}}]},
     "tools.0.function.bogus"),
])
def test_bad_agent_input_is_a_400_naming_the_field(qwen3, body, param):
    url, _ = qwen3
    r = httpx.post(url + "/v1/chat/completions", json={"messages": ASK, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_thinking_split_and_budget(thinker):
    url, loaded = thinker
    kw = dict(model=loaded.name, messages=ASK, temperature=0, max_tokens=24,
              extra_body={"ignore_eos": True})
    choice = oai(url).chat.completions.create(logprobs=True, **kw).choices[0]
    message = choice.message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and message.content
    # the budget (half of max_tokens: 12) closed the block ("\n" then "</think>" forced when
    # reached) and the answer followed
    tokens = [t.token for t in choice.logprobs.content]
    assert len(tokens) == 24 and tokens.count("</think>") == 1
    close = tokens.index("</think>")
    assert close < 12 or (close == 13 and tokens[12] == "\n")
    chunks = list(oai(url).chat.completions.create(stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    assert streamed == reasoning
    assert "".join(d.content or "" for d in deltas) == message.content


def test_enable_thinking_reaches_the_template(qwen3):
    url, loaded = qwen3

    def prompt_tokens(kwargs):
        return oai(url).chat.completions.create(
            model=loaded.name, messages=ASK, max_tokens=1,
            extra_body={"chat_template_kwargs": kwargs}).usage.prompt_tokens

    empty_block = loaded.tokenizer.encode("<think>\n\n</think>\n\n")
    assert prompt_tokens({"enable_thinking": False}) - prompt_tokens({}) == len(empty_block)


def test_anthropic_thinking_blocks_and_events(thinker):
    url, loaded = thinker
    client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=300)
    kw = dict(model=loaded.name, max_tokens=16, messages=ASK,
              thinking={"type": "enabled", "budget_tokens": 6},
              extra_body={"temperature": 0})
    reply = client.messages.create(**kw)
    # the random model may end its turn while still reasoning: then there is no text block
    assert reply.content[0].type == "thinking" and reply.content[0].thinking
    assert [b.type for b in reply.content[1:]] in ([], ["text"])
    events = list(client.messages.create(stream=True, **kw))
    thinking = "".join(e.delta.thinking for e in events if e.type == "content_block_delta"
                       and e.delta.type == "thinking_delta")
    assert thinking == reply.content[0].thinking
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == [b.type for b in reply.content]
    assert final.content[0].thinking == reply.content[0].thinking


def test_anthropic_named_tool_streams_input_json(qwen3):
    url, loaded = qwen3
    client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=300)
    tools = [{"name": "forecast", "description": "Forecast", "input_schema": SCHEMA}]
    kw = dict(model=loaded.name, max_tokens=80, messages=ASK, tools=tools,
              tool_choice={"type": "tool", "name": "forecast"},
              thinking={"type": "disabled"}, extra_body={"temperature": 0})
    reply = client.messages.create(**kw)
    assert reply.stop_reason == "tool_use"
    (use,) = [b for b in reply.content if b.type == "tool_use"]
    jsonschema.validate(use.input, SCHEMA)
    events = list(client.messages.create(stream=True, **kw))
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta"
                      and e.delta.type == "input_json_delta")
    assert json.loads(partial) == use.input
    assert events[-2].delta.stop_reason == "tool_use"
    r = httpx.post(url + "/v1/messages", timeout=60, json={
        "max_tokens": 5, "tools": tools, "tool_choice": {"type": "tool", "name": "nope"},
        "messages": ASK})
    assert r.status_code == 400 and "nope" in r.json()["error"]["message"]
    orphan = ASK + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_x", "content": "18 C", "is_error": True}]}]
    r = httpx.post(url + "/v1/messages", timeout=60,
                   json={"max_tokens": 5, "tools": tools, "messages": orphan})
    assert r.status_code == 400 and "toolu_x" in r.json()["error"]["message"]
