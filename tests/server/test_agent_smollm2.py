"""The agent API on the embedded SmolLM2-135M-Instruct through the real clients: its template
knows no tools (generic JSON dialect), so only constrained decoding makes the 135M model's
calls parse and match the schema."""

import json

import anthropic
import jsonschema
import openai
import pytest

pytestmark = [pytest.mark.needs_weights, pytest.mark.slow]

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 40},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                           "age": {"type": "integer", "minimum": 0}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(smollm2_server):
    url, _ = smollm2_server
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def claude(smollm2_server):
    url, _ = smollm2_server
    return anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=600)


def test_named_tool_choice_gives_a_schema_valid_call(client, smollm2_server):
    _, name = smollm2_server
    kw = dict(model=name, messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=0,
              max_tokens=60)
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)

    chunks = list(client.chat.completions.create(stream=True, **kw))
    calls = [d.tool_calls[0] for c in chunks if c.choices
             for d in [c.choices[0].delta] if d.tool_calls]
    assert calls[0].id and calls[0].function.name == "get_weather"
    streamed = "".join(c.function.arguments or "" for c in calls)
    jsonschema.validate(json.loads(streamed), WEATHER)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_full_tool_round_trip(client, smollm2_server):
    _, name = smollm2_server
    first = client.chat.completions.create(model=name, messages=ASK, tools=TOOLS,
                                           tool_choice="required", temperature=0,
                                           max_tokens=60).choices[0].message
    (call,) = first.tool_calls
    history = ASK + [first.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id,
                      "content": json.dumps({"temperature": 18, "sky": "sunny"})}]
    final = client.chat.completions.create(model=name, messages=history, tools=TOOLS,
                                           temperature=0, max_tokens=40).choices[0]
    assert final.finish_reason in ("stop", "length")
    assert final.message.content and not final.message.tool_calls


def test_response_format_json_schema(client, smollm2_server):
    _, name = smollm2_server
    reply = client.chat.completions.create(
        model=name, temperature=0, max_tokens=60,
        messages=[{"role": "user", "content": "Describe Bob, aged 30, as JSON."}],
        response_format={"type": "json_schema", "json_schema": {
            "name": "person", "strict": True, "schema": PERSON}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)


def test_anthropic_named_tool_streamed_and_not(claude, smollm2_server):
    _, name = smollm2_server
    tools = [{"name": "get_weather", "description": "Current weather in a city",
              "input_schema": WEATHER}]
    kw = dict(model=name, max_tokens=60, messages=ASK, tools=tools,
              tool_choice={"type": "tool", "name": "get_weather"},
              extra_body={"temperature": 0})
    reply = claude.messages.create(**kw)
    assert reply.stop_reason == "tool_use"
    (use,) = [b for b in reply.content if b.type == "tool_use"]
    jsonschema.validate(use.input, WEATHER)
    with claude.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    (streamed,) = [b for b in final.content if b.type == "tool_use"]
    assert streamed.input == use.input and final.stop_reason == "tool_use"

    history = ASK + [{"role": "assistant", "content": [b.model_dump() for b in reply.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                   "content": "18 C and sunny"}]}]
    answer = claude.messages.create(model=name, max_tokens=30, messages=history, tools=tools,
                                    extra_body={"temperature": 0})
    assert answer.content[0].type == "text" and answer.content[0].text


def test_count_tokens_equals_the_prompt_messages_uses(claude, smollm2_server):
    _, name = smollm2_server
    tools = [{"name": "get_weather", "input_schema": WEATHER}]
    kw = dict(model=name, messages=ASK, system="Be brief.", tools=tools)
    counted = claude.messages.count_tokens(**kw).input_tokens
    used = claude.messages.create(max_tokens=1, **kw).usage.input_tokens
    assert counted == used and counted > 20
    assert claude.messages.count_tokens(model=name, messages=ASK).input_tokens < counted
