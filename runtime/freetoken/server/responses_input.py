"""A Responses API request as the one AgentRequest: instructions and leading system/developer
messages become one system message, function_call items the assistant's tool_calls,
function_call_output items `tool` messages, reasoning items the next assistant turn's
reasoning_content."""

from __future__ import annotations

from freetoken.agent.request import (AgentRequest, AgentRequestError, Constraint, ImageRef,
                                     Tool, check_tool_choice, make_tool, parse_arguments)
from freetoken.server.errors import APIError
from freetoken.server.image_parts import LOW_DETAIL_PIXELS, check_role, check_url, parse_data_url
from freetoken.server.responses_protocol import (FunctionCallItem, FunctionCallOutputItem,
                                                 FunctionTool, MessageItem, OtherItem,
                                                 OtherTool, ReasoningItem, ResponsesRequest)

SUPPORTED_ITEMS = "message, function_call, function_call_output and reasoning"


def check_supported(body: ResponsesRequest) -> None:
    """What this server cannot do, as a 400 naming the field: stored responses, built-in
    tools, items that only stored state or built-in tools produce."""
    if body.previous_response_id is not None:
        raise APIError(400, "previous_response_id is not supported: this server stores no "
                            "responses; send the whole conversation in input (with store: "
                            "false, as stateless clients do)", "previous_response_id")
    for i, tool in enumerate(body.tools or ()):
        if isinstance(tool, OtherTool):
            raise APIError(400, f"tools.{i} is a {tool.type!r} tool, which this server does not "
                                "run; only function tools ({\"type\": \"function\", \"name\", "
                                "\"parameters\"}) are supported", f"tools.{i}.type")
    for i, item in enumerate(body.input if isinstance(body.input, list) else ()):
        if isinstance(item, OtherItem):
            why = ("it refers to a stored item, and this server stores none"
                   if item.type == "item_reference" else f"this server takes {SUPPORTED_ITEMS} "
                   "items")
            raise APIError(400, f"input.{i} is an item of type {item.type!r}: {why}",
                           f"input.{i}.type")


def responses_agent_request(body: ResponsesRequest) -> AgentRequest:
    tools = tuple(make_tool(t.name, t.description, t.parameters, f"tools.{i}.parameters")
                  for i, t in enumerate(body.tools or ()) if isinstance(t, FunctionTool))
    choice = body.tool_choice or "auto"
    if not isinstance(choice, str):
        choice = choice.name
    check_tool_choice(choice, tools)
    images: list = []
    messages = conversation(body, images)
    effort = body.reasoning.effort if body.reasoning else None
    return AgentRequest(messages=messages, tools=tools, tool_choice=choice,
                        parallel_calls=body.parallel_tool_calls,
                        constraint=constraint(body, tools, choice),
                        thinking=None if effort is None else effort != "none",
                        images=tuple(images))


def conversation(body: ResponsesRequest, images: list) -> list[dict]:
    """OpenAI chat-shaped messages of the instructions and input."""
    system = [body.instructions] if body.instructions else []
    items = [MessageItem(role="user", content=body.input)] if isinstance(body.input, str) \
        else body.input
    messages: list[dict] = []
    called: set[str] = set()
    reasoning: list[str] = []
    for i, item in enumerate(items):
        where = f"input.{i}"
        if isinstance(item, MessageItem):
            content = parts_content(item.content, item.role, f"{where}.content", images)
            if item.role in ("system", "developer") and not messages:
                system.append(content)   # text: images are refused outside user turns
                continue
            # NOTE: chat templates know no developer role (some drop its turns unseen);
            # OpenAI gives it the system role's weight.
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": content})
        elif isinstance(item, FunctionCallItem):
            called.add(item.call_id)
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": ""})
            messages[-1].setdefault("tool_calls", []).append({
                "id": item.call_id, "type": "function", "function": {
                    "name": item.name,
                    "arguments": parse_arguments(item.arguments, f"{where}.arguments")}})
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in called:
                raise AgentRequestError(f"{where} is the output of call_id {item.call_id!r}, but "
                                        "no earlier function_call item has that call_id",
                                        f"{where}.call_id")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content":
                             parts_content(item.output, "tool", f"{where}.output", images)})
        elif isinstance(item, ReasoningItem):
            # the full reasoning when the item carries it, else its summary
            reasoning += [p.text for p in item.content or item.summary if p.text]
            continue
        if reasoning and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"] = "\n".join(reasoning)
            reasoning = []
    head = [{"role": "system", "content": "\n\n".join(s for s in system if s)}] if any(system) \
        else []
    return head + messages


def parts_content(content, role: str, where: str, images: list) -> str | list[dict]:
    """A message's (or a tool output's) text, parts joined by newlines; with images, its parts
    in order as text and image items (images collects their refs)."""
    if isinstance(content, str):
        return content
    if not any(p.type == "input_image" for p in content):
        return "\n".join(p.refusal if p.type == "refusal" else p.text for p in content)
    items: list[dict] = []
    for j, part in enumerate(content):
        if part.type == "input_image":
            if role != "tool":
                check_role(role, f"{where}.{j}")
            images.append(image_ref(part, f"{where}.{j}"))
            items.append({"type": "image"})
        else:
            items.append({"type": "text",
                          "text": part.refusal if part.type == "refusal" else part.text})
    return items


def image_ref(part, where: str) -> ImageRef:
    at = f"{where}.image_url"
    if part.image_url is None:
        raise AgentRequestError(f"{where}: an input_image needs image_url (a data URL, or an "
                                "http(s) URL); file_id is not supported: this server stores no "
                                "files", at)
    cap = LOW_DETAIL_PIXELS if part.detail == "low" else None
    if part.image_url[:5].lower() == "data:":
        media_type, data = parse_data_url(part.image_url, at)
        return ImageRef(at, data=data, media_type=media_type, max_pixels=cap)
    return ImageRef(at, url=check_url(part.image_url, at), max_pixels=cap)


def constraint(body: ResponsesRequest, tools: tuple[Tool, ...], choice: str) -> Constraint:
    """A forced call (required, a named function) or text.format's JSON."""
    if choice == "required":
        return Constraint("tool", tools=tools)
    if choice not in ("auto", "none"):
        return Constraint("tool", tools=tuple(t for t in tools if t.name == choice))
    fmt = body.text.format if body.text else None
    if fmt is None or fmt.type == "text":
        return Constraint()
    if fmt.type == "json_object":
        return Constraint("json")
    schema = fmt.schema_ or {"type": "object"}
    make_tool("text.format", None, schema, "text.format.schema")
    return Constraint("json", schema=schema)
