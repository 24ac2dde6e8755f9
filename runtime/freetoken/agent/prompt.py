"""The prompt of an agent request: the chat template with tools, or, for templates that know no
tools, the tool list written into the system prompt and tool turns written as text."""

from __future__ import annotations

import json
from typing import Any

from freetoken.agent.dialect import Dialect
from freetoken.agent.request import AgentRequest, Tool

GENERIC_TOOL_PROMPT = (
    "You can call these tools. To call one, answer with only a JSON object of the form "
    '{{"name": <tool name>, "arguments": <arguments object>}} and nothing else.\n'
    "Tools:\n{tools}")


def tool_dicts(tools: tuple[Tool, ...]) -> list[dict]:
    """Tools as chat templates expect them (OpenAI's function form)."""
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": t.parameters}} for t in tools]


def template_inputs(request: AgentRequest, dialect: Dialect) -> tuple[list[dict], dict[str, Any]]:
    """(messages, extra template variables) for the model's chat template."""
    kwargs: dict[str, Any] = dict(request.template_kwargs)
    if request.thinking is not None:
        kwargs["enable_thinking"] = request.thinking
    if dialect.template_tools:
        if request.tools_active:
            kwargs["tools"] = tool_dicts(request.tools)
        return request.messages, kwargs
    return generic_messages(request), kwargs


def generic_messages(request: AgentRequest) -> list[dict]:
    """Tool calls and results as plain text, the tool list in the system prompt."""
    messages = []
    for message in request.messages:
        role, content = message["role"], message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                     for c in message["tool_calls"]]
            text = "\n".join(json.dumps(c, ensure_ascii=False) for c in calls)
            messages.append({"role": "assistant", "content": (content + "\n" + text).strip()})
        elif role == "tool":
            name = message.get("name") or "the tool"
            messages.append({"role": "user", "content": f"Result of {name} (call "
                                                        f"{message.get('tool_call_id')}):\n"
                                                        f"{content}"})
        else:
            messages.append({"role": role, "content": content})
    if request.tools_active:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tool_dicts(request.tools))
        note = GENERIC_TOOL_PROMPT.format(tools=listing)
        if messages and messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": messages[0]["content"] + "\n\n" + note}
        else:
            messages.insert(0, {"role": "system", "content": note})
    return messages


def opens_thinking(prompt: str, dialect: Dialect) -> bool:
    """The generation prompt ends inside an open think block (e.g. DeepSeek-R1, Qwen3
    variants that start the reply with `<think>`)."""
    if not dialect.think_open:
        return False
    tail = prompt.rstrip()
    return tail.endswith(dialect.think_open)
