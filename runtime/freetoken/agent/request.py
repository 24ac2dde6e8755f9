"""The one internal agent request every protocol adapter builds: the conversation with its tool
calls and results, the tools, a constraint on the output, the thinking mode and budget."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

JSON_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}


class AgentRequestError(ValueError):
    """A request the agent layer refuses; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict    # a JSON Schema for the arguments object


@dataclass(frozen=True)
class Constraint:
    """What the output must be: none, a JSON value (`schema`, None = any JSON object), or a
    call of one of `tools`."""

    kind: str = "none"          # none | json | tool
    schema: dict | None = None
    tools: tuple[Tool, ...] = ()


@dataclass(frozen=True)
class ImageRef:
    """An image part as a request carried it, not yet fetched or decoded: base64 `data` (with
    the declared media type, if any) or a remote `url`. `where` is its field path for errors;
    `max_pixels` a cap of its own (OpenAI's detail: low)."""

    where: str
    data: str | None = None
    url: str | None = None
    media_type: str | None = None
    max_pixels: int | None = None


@dataclass
class AgentRequest:
    """messages: OpenAI-shaped dicts (role, content, tool_calls with `arguments` as a dict,
    tool_call_id, name); a user message with images has content as a list of
    {"type": "text", "text"} and {"type": "image"} items, as HF chat templates take it.
    tool_choice: auto | none | required | a tool name."""

    messages: list[dict]
    tools: tuple[Tool, ...] = ()
    tool_choice: str = "auto"
    parallel_calls: bool = True
    constraint: Constraint = field(default_factory=Constraint)
    thinking: bool | None = None            # None: the template's default
    thinking_budget: int | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    images: tuple[ImageRef, ...] = ()       # in prompt order; their messages hold image items

    @property
    def tools_active(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


def make_tool(name: str, description: str | None, parameters: dict | None,
              where: str) -> Tool:
    """A Tool whose schema is checked as JSON Schema; errors name `where`."""
    schema = {"type": "object", "properties": {}} if parameters is None else parameters
    check_schema(schema, where)
    return Tool(name, description or "", schema)


def check_schema(schema: Any, where: str) -> None:
    """The structural rules of JSON Schema that a grammar relies on; AgentRequestError
    naming the first broken one."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise AgentRequestError(f"{where} is not a JSON Schema: expected an object, got "
                                f"{type(schema).__name__}", where)
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    bad = [k for k in kinds if k not in JSON_TYPES]
    if bad:
        raise AgentRequestError(f"{where}.type: {bad[0]!r} is not a JSON Schema type (one of "
                                f"{', '.join(sorted(JSON_TYPES))})", f"{where}.type")
    properties = schema.get("properties", {})
    if not isinstance(properties, dict):
        raise AgentRequestError(f"{where}.properties must be an object", f"{where}.properties")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise AgentRequestError(f"{where}.required must be a list of property names",
                                f"{where}.required")
    for key, sub in properties.items():
        check_schema(sub, f"{where}.properties.{key}")
    for key in ("items", "additionalProperties"):
        if key in schema:
            check_schema(schema[key], f"{where}.{key}")
    for key in ("anyOf", "oneOf", "allOf"):
        for i, sub in enumerate(schema.get(key, [])):
            check_schema(sub, f"{where}.{key}.{i}")


def check_tool_history(messages: list[dict], where: str = "messages") -> None:
    """Every tool result answers a call made earlier in the conversation."""
    called: set[str] = set()
    for i, message in enumerate(messages):
        for call in message.get("tool_calls") or ():
            called.add(call["id"])
        if message["role"] == "tool" and message.get("tool_call_id") not in called:
            raise AgentRequestError(
                f"{where}[{i}] is a tool result for call id {message.get('tool_call_id')!r}, "
                "but no earlier assistant message made a call with that id",
                f"{where}.{i}.tool_call_id")


def check_tool_choice(choice: str, tools: tuple[Tool, ...], where: str = "tool_choice") -> None:
    if choice in ("auto", "none"):
        return
    if not tools:
        raise AgentRequestError(f"{where} {choice!r} needs tools; the request has none", where)
    if choice != "required" and choice not in {t.name for t in tools}:
        raise AgentRequestError(f"{where} names the tool {choice!r}, which is not among the "
                                f"request's tools ({', '.join(t.name for t in tools)})", where)


def parse_arguments(text: str, where: str) -> dict:
    """A call's JSON-string arguments as a dict (templates render them themselves)."""
    try:
        value = json.loads(text) if text else {}
    except json.JSONDecodeError as exc:
        raise AgentRequestError(f"{where} is not valid JSON: {exc}", where) from None
    if not isinstance(value, dict):
        raise AgentRequestError(f"{where} must be a JSON object", where)
    return value
