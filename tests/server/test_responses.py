"""POST /v1/responses (OpenAI's Responses API): the Response object and its event stream field
for field (and as the `openai` client's own types parse them), instructions and the input
items as the chat route would see them, tool calls and their round trip, reasoning, errors;
on tiny random llamas."""

import json

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from tests.engine.tiny_llama import CONTEXT
from tests.server.family_server import family_server

RESPONSE_FIELDS = {
    "id", "object", "created_at", "status", "completed_at", "background", "error",
    "incomplete_details", "instructions", "max_output_tokens", "max_tool_calls", "model",
    "output", "parallel_tool_calls", "previous_response_id", "reasoning", "service_tier",
    "store", "temperature", "text", "tool_choice", "tools", "top_logprobs", "top_p",
    "truncation", "usage", "user", "metadata"}
# each stream event's fields besides type and sequence_number
EVENT_FIELDS = {
    "response.created": {"response"}, "response.in_progress": {"response"},
    "response.completed": {"response"}, "response.incomplete": {"response"},
    "response.failed": {"response"},
    "response.output_item.added": {"output_index", "item"},
    "response.output_item.done": {"output_index", "item"},
    "response.content_part.added": {"item_id", "output_index", "content_index", "part"},
    "response.content_part.done": {"item_id", "output_index", "content_index", "part"},
    "response.output_text.delta": {"item_id", "output_index", "content_index", "delta",
                                   "logprobs"},
    "response.output_text.done": {"item_id", "output_index", "content_index", "text",
                                  "logprobs"},
    "response.reasoning_summary_part.added": {"item_id", "output_index", "summary_index",
                                              "part"},
    "response.reasoning_summary_part.done": {"item_id", "output_index", "summary_index",
                                             "part"},
    "response.reasoning_summary_text.delta": {"item_id", "output_index", "summary_index",
                                              "delta"},
    "response.reasoning_summary_text.done": {"item_id", "output_index", "summary_index",
                                             "text"},
    "response.function_call_arguments.delta": {"item_id", "output_index", "delta"},
    "response.function_call_arguments.done": {"item_id", "output_index", "arguments"}}
STREAM_EVENT = TypeAdapter(ResponseStreamEvent)
ASK = "Tell me about paged attention."
FAULT = "<<fail here>>"
SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "forecast", "description": "Forecast",
          "parameters": SCHEMA, "strict": True},
         {"type": "function", "name": "clock", "parameters": {"type": "object"}}]
FORCED = {"input": "Forecast for Paris?", "tools": TOOLS, "temperature": 0,
          "tool_choice": {"type": "function", "name": "forecast"},
          "reasoning": {"effort": "none"}, "max_output_tokens": 80}


@pytest.fixture
def faulty(tiny_loaded, monkeypatch):
    """A server whose engine fails every request with FAULT in its prompt."""
    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import Engine
    from freetoken.server.app import create_app
    from freetoken.server.launch import ServerThread

    monkeypatch.setenv("FREETOKEN_FAULT_MARKER", FAULT)
    engine = Engine.from_loaded(tiny_loaded, EngineConfig(
        num_tokens=4 * CONTEXT, block_size=16, max_num_seqs=2, device="cpu")).start()
    thread = ServerThread(create_app(engine, tiny_loaded.tokenizer, tiny_loaded.name)).start()
    yield thread.url
    thread.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    with family_server(tmp_path_factory, "qwen3") as served:
        yield served


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    with family_server(tmp_path_factory, "qwen3-thinking") as served:
        yield served


def post(url: str, body: dict, path: str = "/v1/responses") -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=300)


def create(url: str, body: dict) -> dict:
    r = post(url, body)
    assert r.status_code == 200, r.text
    reply = r.json()
    assert set(reply) == RESPONSE_FIELDS and "output_text" not in reply
    Response.model_validate(reply)          # as the openai client's types read it
    return reply


def stream(url: str, body: dict) -> list[dict]:
    """The events of a streamed request, each checked for its framing, its fields and
    against the openai client's event types."""
    with httpx.stream("POST", url + "/v1/responses", json={**body, "stream": True},
                      timeout=300) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith(
            "text/event-stream")
        blocks = r.read().decode().strip().split("\n\n")
    events = []
    for block in blocks:
        name, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        assert set(event) == {"type", "sequence_number"} | EVENT_FIELDS[event["type"]], event
        STREAM_EVENT.validate_python(event)
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def of(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e["type"] == f"response.{kind}"]


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def test_response_object_field_for_field(server):
    # a prompt no other test sends: the server's prefix cache holds nothing of it, so
    # cached_tokens is 0 whatever ran before
    fresh = [{"role": "user", "content": "Field by field, once: name a prime below ten."}]
    body = {"model": server.loaded.name, "input": fresh, "max_output_tokens": 8,
            "temperature": 0, "ignore_eos": True, "metadata": {"k": "v"}, "user": "u1",
            "store": True, "include": ["reasoning.encrypted_content"]}
    reply = create(server.url, body)
    assert reply["id"].startswith("resp_") and reply["object"] == "response"
    assert isinstance(reply["created_at"], int) and reply["completed_at"] >= reply["created_at"]
    assert (reply["status"], reply["incomplete_details"], reply["error"]) == (
        "incomplete", {"reason": "max_output_tokens"}, None)
    (message,) = reply["output"]
    assert set(message) == {"id", "type", "status", "role", "content"}
    assert message["id"].startswith("msg_")
    assert (message["type"], message["status"], message["role"]) == (
        "message", "incomplete", "assistant")
    (part,) = message["content"]
    assert part == text_part(part["text"]) and part["text"]
    usage = reply["usage"]
    assert usage == {"input_tokens": usage["input_tokens"],
                     "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                     "output_tokens": 8,
                     "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": usage["input_tokens"] + 8}
    echoed = {k: reply[k] for k in ("model", "instructions", "max_output_tokens", "temperature",
                                    "top_p", "tools", "tool_choice", "parallel_tool_calls",
                                    "text", "reasoning", "store", "truncation", "user",
                                    "metadata", "previous_response_id", "background")}
    assert echoed == {
        "model": server.loaded.name, "instructions": None, "max_output_tokens": 8,
        "temperature": 0, "top_p": None, "tools": [], "tool_choice": "auto",
        "parallel_tool_calls": True, "text": {"format": {"type": "text"}, "verbosity": "medium"},
        "reasoning": {"effort": None, "summary": None}, "store": False,
        "truncation": "disabled", "user": "u1", "metadata": {"k": "v"},
        "previous_response_id": None, "background": False}
    # the chat route, given the same conversation, says the same
    chat = post(server.url, {"messages": fresh, "max_tokens": 8,
                             "temperature": 0, "ignore_eos": True}, "/v1/chat/completions").json()
    assert chat["choices"][0]["message"]["content"] == part["text"]
    assert chat["usage"]["prompt_tokens"] == usage["input_tokens"]


def test_stream_events_field_for_field(server):
    body = {"input": ASK, "max_output_tokens": 8, "temperature": 0, "ignore_eos": True}
    events = stream(server.url, body)
    kinds = [e["type"].removeprefix("response.") for e in events]
    assert kinds == ["created", "in_progress", "output_item.added", "content_part.added",
                     *["output_text.delta"] * (len(kinds) - 8), "output_text.done",
                     "content_part.done", "output_item.done", "incomplete"]
    for start in events[:2]:
        response = start["response"]
        assert set(response) == RESPONSE_FIELDS
        assert (response["status"], response["output"], response["usage"]) == (
            "in_progress", [], None)
    added = events[2]
    item_id = added["item"]["id"]
    assert added["output_index"] == 0 and added["item"] == {
        "id": item_id, "type": "message", "status": "in_progress", "role": "assistant",
        "content": []}
    assert events[3]["part"] == text_part("")
    where = {"item_id": item_id, "output_index": 0, "content_index": 0}
    deltas = of(events, "output_text.delta")
    assert all({k: d[k] for k in where} == where and d["logprobs"] == [] for d in deltas)
    text = "".join(d["delta"] for d in deltas)
    assert of(events, "output_text.done")[0]["text"] == text
    assert of(events, "content_part.done")[0]["part"] == text_part(text)
    final = events[-1]["response"]
    assert of(events, "output_item.done")[0]["item"] == final["output"][0]
    reply = create(server.url, body)
    assert final["output"][0]["content"] == reply["output"][0]["content"]
    assert final["status"] == "incomplete"
    # the same request again counts the same tokens; its prompt may now come from the cache

    def counts(usage: dict) -> dict:
        return {**usage, "input_tokens_details": {**usage["input_tokens_details"],
                                                  "cached_tokens": None}}

    assert counts(final["usage"]) == counts(reply["usage"])
    cached = [u["input_tokens_details"]["cached_tokens"] for u in (final["usage"], reply["usage"])]
    assert 0 <= cached[0] <= cached[1] < reply["usage"]["input_tokens"]


def test_instructions_and_leading_developer_messages_are_the_system_message(server):
    body = {"instructions": "Be terse.", "max_output_tokens": 6, "temperature": 0,
            "ignore_eos": True, "input": [
                {"role": "developer", "content": "Answer in French."},
                {"type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": "Hello"},
                             {"type": "input_text", "text": "there"}]}]}
    reply = create(server.url, body)
    assert reply["instructions"] == "Be terse."
    chat = post(server.url, {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "messages": [
        {"role": "system", "content": "Be terse.\n\nAnswer in French."},
        {"role": "user", "content": "Hello\nthere"}]}, "/v1/chat/completions").json()
    assert reply["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert reply["output"][0]["content"][0]["text"] == chat["choices"][0]["message"]["content"]


def test_max_output_tokens_beyond_the_context_is_400(server):
    r = post(server.url, {"input": "x", "max_output_tokens": CONTEXT})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens"


def test_openapi_lists_the_route_with_its_request_body(server):
    doc = httpx.get(server.url + "/openapi.json", timeout=30).json()
    body = doc["paths"]["/v1/responses"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"]["$ref"] == "#/components/schemas/ResponsesRequest"
    listed = doc["components"]["schemas"]["ResponsesRequest"]["properties"]
    assert {"input", "instructions", "tools", "tool_choice", "reasoning", "text"} <= set(listed)


@pytest.mark.parametrize("body, status, param", [
    ({"input": 5}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": "x", "temperature": "1"}, 400, "temperature"),
    ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "x", "stream": 1}, 400, "stream"),
    ({"input": "x", "bogus": 1}, 400, "bogus"),
    ({"input": "x", "model": "gpt-9"}, 404, "model"),
    ({"input": "x", "previous_response_id": "resp_1"}, 400, "previous_response_id"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools.0.type"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "colour": 1}]}, 400,
     "tools.0.colour"),
    ({"input": "x", "tool_choice": "required"}, 400, "tool_choice"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]}, 400,
     "input.0.content.0.text"),
    ({"input": [{"type": "function_call_output", "call_id": "call_9", "output": "x"}]}, 400,
     "input.0.call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
     400, "input.0.arguments"),
    ({"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]}, 400,
     "input.0.content.0.image_url"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a",
                                        "schema": {"type": "wat"}}}}, 400,
     "text.format.schema.type"),
])
def test_bad_requests_are_openai_errors_naming_the_field(server, body, status, param):
    r = post(server.url, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    if param in ("previous_response_id", "tools.0.type"):
        assert ("stores no" if param == "previous_response_id" else "web_search") \
            in error["message"]


def test_a_request_the_engine_fails_is_a_500_or_response_failed(faulty):
    body = {"input": f"Say hello {FAULT}", "max_output_tokens": 4}
    r = post(faulty, body)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert "injected fault" in r.json()["error"]["message"]
    events = stream(faulty, body)
    assert [e["type"] for e in events] == ["response.created", "response.in_progress",
                                           "response.failed"]
    failed = events[-1]["response"]
    assert (failed["status"], failed["usage"], failed["output"]) == ("failed", None, [])
    assert failed["error"]["code"] == "server_error"
    assert "injected fault" in failed["error"]["message"]


def test_forced_function_call_and_its_stream(qwen3):
    url, loaded = qwen3
    reply = create(url, FORCED)
    assert reply["status"] == "completed" and reply["tool_choice"] == FORCED["tool_choice"]
    assert reply["tools"] == [{**TOOLS[0]}, {**TOOLS[1], "description": None, "strict": None}]
    (call,) = reply["output"]
    assert set(call) == {"id", "type", "status", "arguments", "call_id", "name"}
    assert call["id"].startswith("fc_") and call["call_id"].startswith("call_")
    assert (call["type"], call["name"], call["status"]) == ("function_call", "forecast",
                                                            "completed")
    jsonschema.validate(json.loads(call["arguments"]), SCHEMA)
    events = stream(url, FORCED)
    kinds = [e["type"].removeprefix("response.") for e in events]
    assert kinds == ["created", "in_progress", "output_item.added",
                     "function_call_arguments.delta", "function_call_arguments.done",
                     "output_item.done", "completed"]
    added, delta, done, item_done = events[2:6]
    assert added["item"]["arguments"] == "" and added["item"]["status"] == "in_progress"
    assert delta["delta"] == done["arguments"] == call["arguments"]
    assert delta["item_id"] == added["item"]["id"] == item_done["item"]["id"]
    assert item_done["item"] == events[-1]["response"]["output"][0]


def test_function_call_round_trip_matches_the_chat_route(qwen3):
    url, loaded = qwen3
    arguments = '{"city": "Paris", "days": 2}'
    body = {"tools": TOOLS, "max_output_tokens": 6, "temperature": 0, "ignore_eos": True,
            "reasoning": {"effort": "none"}, "input": [
                {"role": "user", "content": "Forecast for Paris?"},
                {"type": "function_call", "call_id": "call_1", "name": "forecast",
                 "arguments": arguments, "id": "fc_1", "status": "completed"},
                {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]}
    reply = create(url, body)
    chat_tools = [{"type": "function", "function": {
        k: t[k] for k in ("name", "description", "parameters") if k in t}} for t in TOOLS]
    chat = post(url, {"tools": chat_tools, "max_tokens": 6, "temperature": 0,
                      "ignore_eos": True,
                      "chat_template_kwargs": {"enable_thinking": False}, "messages": [
                          {"role": "user", "content": "Forecast for Paris?"},
                          {"role": "assistant", "content": None, "tool_calls": [
                              {"id": "call_1", "type": "function", "function": {
                                  "name": "forecast", "arguments": arguments}}]},
                          {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]},
                "/v1/chat/completions").json()
    assert reply["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]


def test_reasoning_items_reach_the_template_with_the_next_assistant_turn(qwen3):
    url, loaded = qwen3
    said = {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
            "content": [{"type": "output_text", "text": "Hello!", "annotations": []}]}
    thought = {"type": "reasoning", "id": "rs_1", "encrypted_content": None,
               "summary": [{"type": "summary_text", "text": "Greet back."}]}
    hello = {"role": "user", "content": "Hi"}
    settings = {"max_output_tokens": 1, "reasoning": {"effort": "none"}}
    tokens = [create(url, {"input": items, **settings})["usage"]["input_tokens"]
              for items in ([hello, thought, said], [hello, said])]
    chat = post(url, {"max_tokens": 1, "chat_template_kwargs": {"enable_thinking": False},
                      "messages": [hello, {"role": "assistant", "content": "Hello!",
                                           "reasoning_content": "Greet back."}]},
                "/v1/chat/completions").json()
    assert tokens[0] == chat["usage"]["prompt_tokens"] > tokens[1]


def test_the_openai_client_round_trip_and_stream(qwen3):
    url, loaded = qwen3
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)
    kw = {k: v for k, v in FORCED.items() if k != "input"}
    first = client.responses.create(model=loaded.name, input=FORCED["input"], **kw)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "forecast"
    with client.responses.stream(model=loaded.name, input=FORCED["input"], **kw) as events:
        kinds = [event.type for event in events]
        final = events.get_final_response()
    assert kinds[-1] == "response.completed" and final.output[0].arguments == call.arguments
    history = [{"role": "user", "content": FORCED["input"]}, *first.output,
               {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    answer = client.responses.create(model=loaded.name, input=history, tools=TOOLS,
                                     max_output_tokens=6, temperature=0,
                                     reasoning={"effort": "none"})
    assert answer.status in ("completed", "incomplete")
    assert answer.output_text == "".join(
        part.text for item in answer.output if item.type == "message" for part in item.content)


def test_reasoning_item_and_its_summary_events(thinker):
    url, loaded = thinker
    body = {"input": "Forecast for Paris?", "max_output_tokens": 24, "temperature": 0,
            "ignore_eos": True}
    reply = create(url, body)
    reasoning, message = reply["output"]
    assert set(reasoning) == {"id", "type", "summary"} and reasoning["id"].startswith("rs_")
    (summary,) = reasoning["summary"]
    assert summary["type"] == "summary_text" and summary["text"]
    chat = post(url, {"messages": [{"role": "user", "content": body["input"]}],
                      "max_tokens": 24, "temperature": 0, "ignore_eos": True},
                "/v1/chat/completions").json()["choices"][0]["message"]
    assert summary["text"] == chat["reasoning_content"]
    assert message["content"][0]["text"] == chat["content"]
    details = reply["usage"]["output_tokens_details"]
    assert 0 < details["reasoning_tokens"] <= reply["usage"]["output_tokens"]
    events = stream(url, body)
    kinds = [e["type"].removeprefix("response.") for e in events]
    assert kinds[2:4] == ["output_item.added", "reasoning_summary_part.added"]
    done_at = kinds.index("reasoning_summary_text.done")
    assert kinds[4:done_at] == ["reasoning_summary_text.delta"] * (done_at - 4)
    assert kinds[done_at:done_at + 4] == ["reasoning_summary_text.done",
                                          "reasoning_summary_part.done", "output_item.done",
                                          "output_item.added"]
    deltas = "".join(e["delta"] for e in of(events, "reasoning_summary_text.delta"))
    assert deltas == summary["text"] == of(events, "reasoning_summary_part.done")[0]["part"][
        "text"]
    assert [e["item"]["type"] for e in of(events, "output_item.done")] == ["reasoning",
                                                                          "message"]
