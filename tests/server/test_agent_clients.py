"""The requests coding agents send, replayed against the server (docs/agents.md sets the agents
up): Codex's streamed Responses request, OpenCode's chat completion (the AI SDK's
openai-compatible provider) and Claude Code's messages request, each with tools, thinking and
a tool round trip in the history; every answer is parsed with the `openai` / `anthropic`
clients' own types, as those agents read them."""

import json

import anthropic
import httpx
import pytest
from openai.types.chat import ChatCompletionChunk
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from tests.server.family_server import family_server

# JSON Schema as zod-to-json-schema writes it (OpenCode, Claude Code), with $schema.
COMMAND = {"type": "object", "properties": {"command": {"type": "string"}},
           "required": ["command"], "additionalProperties": False,
           "$schema": "http://json-schema.org/draft-07/schema#"}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    with family_server(tmp_path_factory, "qwen3") as served:
        yield served


def sse(url: str, body: dict, **kw) -> list[tuple[str | None, dict]]:
    """(event name, data) of each SSE event, [DONE] left out."""
    with httpx.stream("POST", url, json=body, timeout=300, **kw) as r:
        assert r.status_code == 200, r.read()
        blocks = r.read().decode().strip().split("\n\n")
    out = []
    for block in blocks:
        fields = dict(line.split(": ", 1) for line in block.split("\n"))
        if fields["data"] != "[DONE]":
            out.append((fields.get("event"), json.loads(fields["data"])))
    return out


def test_codex_responses_request(qwen3):
    """As Codex (wire_api = "responses") sends it: instructions, a developer message, the
    environment as a user message, the last turn's reasoning, shell call and its output,
    store false, include encrypted reasoning, prompt_cache_key, always streamed."""
    url, loaded = qwen3
    shell = {"type": "function", "name": "shell", "strict": False,
             "description": "Runs a shell command and returns its output.",
             "parameters": {"type": "object", "properties": {
                 "command": {"type": "array", "items": {"type": "string"}},
                 "workdir": {"type": "string"}, "timeout_ms": {"type": "number"}},
                 "required": ["command"], "additionalProperties": False}}
    plan = {"type": "function", "name": "update_plan", "strict": False,
            "description": "Updates the task plan.",
            "parameters": {"type": "object", "properties": {"plan": {"type": "array", "items": {
                "type": "object", "properties": {"step": {"type": "string"},
                                                 "status": {"type": "string"}},
                "required": ["step", "status"], "additionalProperties": False}}},
                "required": ["plan"], "additionalProperties": False}}
    body = {
        "model": loaded.name, "instructions": "You are a coding agent running in a terminal.",
        "input": [
            {"type": "message", "role": "developer", "content": [
                {"type": "input_text", "text": "<permissions>sandbox: read-only</permissions>"}]},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "<environment_context>cwd: /repo"
                                               "</environment_context>"}]},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "What files are here?"}]},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Run ls."}],
             "encrypted_content": None},
            {"type": "function_call", "name": "shell", "call_id": "call_1",
             "arguments": json.dumps({"command": ["ls"], "workdir": "/repo"})},
            {"type": "function_call_output", "call_id": "call_1", "output": "README.md\nsrc"}],
        "tools": [shell, plan], "tool_choice": "auto", "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"}, "store": False, "stream": True,
        "include": ["reasoning.encrypted_content"], "text": {"verbosity": "medium"},
        "prompt_cache_key": "0f6e2c1e-5b7a-4d0e-9c41-3f1f2b8a6d10", "max_output_tokens": 24}
    events = sse(url + "/v1/responses", body)
    adapter = TypeAdapter(ResponseStreamEvent)
    for name, data in events:
        assert name == data["type"]
        adapter.validate_python(data)
    kinds = [data["type"] for _, data in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed",
                                                             "response.incomplete")
    final = events[-1][1]["response"]
    assert final["usage"]["input_tokens"] > 0 and final["reasoning"]["effort"] == "medium"
    # Codex keeps the items of output_item.done events as the turn's history
    done = [data["item"] for _, data in events if data["type"] == "response.output_item.done"]
    assert done == final["output"] and done
    for item in done:
        if item["type"] == "function_call":
            assert {"name", "arguments", "call_id"} <= set(item)
        elif item["type"] == "message":
            assert item["role"] == "assistant" and item["content"][0]["type"] == "output_text"
        else:
            assert item["type"] == "reasoning" and item["summary"][0]["type"] == "summary_text"


def test_opencode_chat_request(qwen3):
    """As OpenCode's @ai-sdk/openai-compatible provider sends it: tools with zod's JSON
    Schema, the assistant's tool call (content "") and its tool result, streamed with usage."""
    url, loaded = qwen3
    body = {
        "model": loaded.name, "temperature": 0, "max_tokens": 16, "stream": True,
        "stream_options": {"include_usage": True}, "tool_choice": "auto",
        "tools": [{"type": "function", "function": {
            "name": "bash", "description": "Run a shell command", "parameters": COMMAND}}],
        "messages": [
            {"role": "system", "content": "You are opencode, a coding agent."},
            {"role": "user", "content": "What files are here?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "bash", "arguments": '{"command":"ls"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "README.md\nsrc"}]}
    chunks = [ChatCompletionChunk.model_validate(data)
              for _, data in sse(url + "/v1/chat/completions", body)]
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens > 0
    assert chunks[-2].choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_claude_code_messages_request(qwen3):
    """As Claude Code sends it: system blocks with cache_control, metadata.user_id, thinking
    with a budget, its earlier thinking and tool_use blocks and the tool_result, streamed,
    to /v1/messages?beta=true with Anthropic's headers."""
    url, loaded = qwen3
    body = {
        "model": loaded.name, "max_tokens": 32, "stream": True, "temperature": 1,
        "metadata": {"user_id": "user_0123_account__session_4567"},
        "thinking": {"type": "enabled", "budget_tokens": 16},
        "system": [{"type": "text", "text": "You are Claude Code.",
                    "cache_control": {"type": "ephemeral"}}],
        "tools": [{"name": "Bash", "description": "Run a command", "input_schema": COMMAND}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "What files are here?"}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "I will run ls.", "signature": "c2ln"},
                {"type": "tool_use", "id": "toolu_1", "name": "Bash",
                 "input": {"command": "ls"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "README.md\nsrc",
                 "cache_control": {"type": "ephemeral"}}]}]}
    headers = {"x-api-key": "local-key", "anthropic-version": "2023-06-01",
               "anthropic-beta": "interleaved-thinking-2025-05-14"}
    events = sse(url + "/v1/messages?beta=true", body, headers=headers)
    adapter = TypeAdapter(anthropic.types.RawMessageStreamEvent)
    for name, data in events:
        if name != "ping":
            assert name == data["type"]
            adapter.validate_python(data)
    kinds = [data["type"] for _, data in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
