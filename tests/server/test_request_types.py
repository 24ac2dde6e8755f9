"""Strict JSON types on every protocol, as OpenAI answers: a boolean where a number belongs, a
number where a boolean or a string belongs, and booleans inside token-id arrays are 400s naming
the field; values of the right type still pass (an integer where a float belongs too)."""

from __future__ import annotations

import httpx
import pytest

MESSAGES = [{"role": "user", "content": "Hi"}]
CHAT = ("/chat/completions", {"messages": MESSAGES, "max_tokens": 1})
COMPLETIONS = ("/completions", {"prompt": "Hi", "max_tokens": 1})
MESSAGES_API = ("/messages", {"messages": MESSAGES, "max_tokens": 1})
COUNT_TOKENS = ("/messages/count_tokens", {"messages": MESSAGES})


def tool_result(**fields) -> list:
    return [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "content": "ok", **fields}]}]


OPENAI_BAD = [
    (CHAT, {"seed": True}, "seed"),
    (CHAT, {"stream": 0}, "stream"),
    (CHAT, {"temperature": True}, "temperature"),
    (CHAT, {"temperature": "0.5"}, "temperature"),
    (CHAT, {"top_p": False}, "top_p"),
    (CHAT, {"max_tokens": True}, "max_tokens"),
    (CHAT, {"max_tokens": 2.0}, "max_tokens"),
    (CHAT, {"max_completion_tokens": False}, "max_completion_tokens"),
    (CHAT, {"n": True}, "n"),
    (CHAT, {"logprobs": 1}, "logprobs"),
    (CHAT, {"logprobs": True, "top_logprobs": True}, "top_logprobs"),
    (CHAT, {"presence_penalty": True}, "presence_penalty"),
    (CHAT, {"ignore_eos": 1}, "ignore_eos"),
    (CHAT, {"parallel_tool_calls": 0}, "parallel_tool_calls"),
    (CHAT, {"stream": True, "stream_options": {"include_usage": 1}},
     "stream_options.include_usage"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
     "messages.0.content.0.text"),
    (COMPLETIONS, {"prompt": [[False]]}, "prompt.0.0"),
    (COMPLETIONS, {"prompt": [1, True]}, "prompt.1"),
    (COMPLETIONS, {"prompt": [[1, 2], [3, True]]}, "prompt.1.1"),
    (COMPLETIONS, {"prompt": True}, "prompt"),
    (COMPLETIONS, {"seed": True}, "seed"),
    (COMPLETIONS, {"stream": 0}, "stream"),
    (COMPLETIONS, {"echo": 0}, "echo"),
    (COMPLETIONS, {"logprobs": True}, "logprobs"),
    (COMPLETIONS, {"max_tokens": False}, "max_tokens"),
    (COMPLETIONS, {"best_of": True}, "best_of"),
]

ANTHROPIC_BAD = [
    (MESSAGES_API, {"max_tokens": True}, "max_tokens"),
    (MESSAGES_API, {"stream": 0}, "stream"),
    (MESSAGES_API, {"temperature": True}, "temperature"),
    (MESSAGES_API, {"top_p": True}, "top_p"),
    (MESSAGES_API, {"top_k": False}, "top_k"),
    (MESSAGES_API, {"thinking": {"type": "enabled", "budget_tokens": True}}, "budget_tokens"),
    (MESSAGES_API, {"tool_choice": {"type": "auto", "disable_parallel_tool_use": 0}},
     "tool_choice.disable_parallel_tool_use"),
    (MESSAGES_API, {"messages": tool_result(is_error=0)}, "messages.0.content.0.is_error"),
    (COUNT_TOKENS, {"thinking": {"type": "enabled", "budget_tokens": True}}, "budget_tokens"),
    (COUNT_TOKENS, {"tool_choice": {"type": "any", "disable_parallel_tool_use": 1}},
     "tool_choice.disable_parallel_tool_use"),
    (COUNT_TOKENS, {"messages": tool_result(is_error=1)}, "messages.0.content.0.is_error"),
]


def post(server, route, extra: dict) -> httpx.Response:
    path, base = route
    return httpx.post(server.v1 + path, json={**base, **extra}, timeout=300)


@pytest.mark.parametrize("route, extra, field", OPENAI_BAD,
                         ids=[f"{r[0]}:{f}" for r, _, f in OPENAI_BAD])
def test_openai_wrong_types_are_400s_naming_the_field(server, route, extra, field):
    reply = post(server, route, extra)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == field and f"'{field}'" in error["message"]
    assert "Invalid type" in error["message"], error["message"]


@pytest.mark.parametrize("route, extra, field", ANTHROPIC_BAD,
                         ids=[f"{r[0]}:{f}" for r, _, f in ANTHROPIC_BAD])
def test_anthropic_wrong_types_are_400s_naming_the_field(server, route, extra, field):
    reply = post(server, route, extra)
    assert reply.status_code == 400, reply.text
    body = reply.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert field in body["error"]["message"] and "Invalid type" in body["error"]["message"]


GOOD = [
    (CHAT, {"seed": 7, "stream": False, "temperature": 1, "top_p": 1, "n": 1,
            "presence_penalty": 0, "frequency_penalty": 0.5, "repetition_penalty": 1,
            "logprobs": True, "top_logprobs": 0, "ignore_eos": False,
            "parallel_tool_calls": True, "max_completion_tokens": 1}),
    (COMPLETIONS, {"prompt": [[1, 2, 3]], "seed": 0, "echo": False, "logprobs": 0,
                   "best_of": 1, "temperature": 0}),
    (COMPLETIONS, {"prompt": [1, 2, 3]}),
    (COMPLETIONS, {"prompt": ["Hi"]}),
    (MESSAGES_API, {"temperature": 0, "top_p": 1, "top_k": 1, "stream": False,
                    "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}}),
    (COUNT_TOKENS, {"thinking": {"type": "enabled", "budget_tokens": 16}}),
]


@pytest.mark.parametrize("route, extra", GOOD, ids=[r[0] for r, _ in GOOD])
def test_values_of_the_right_type_still_pass(server, route, extra):
    reply = post(server, route, extra)
    assert reply.status_code == 200, reply.text


def test_streams_with_typed_options_still_pass(server):
    with httpx.stream("POST", server.v1 + "/chat/completions", timeout=300, json={
            **CHAT[1], "stream": True, "stream_options": {"include_usage": True}}) as reply:
        assert reply.status_code == 200
        assert any('"usage": {' in line for line in reply.iter_lines())
