"""Protocol adapters: OpenAI chat and Anthropic messages bodies -> the one AgentRequest."""

from __future__ import annotations

from freetoken.agent.request import (AgentRequest, AgentRequestError, Constraint, Tool,
                                     check_tool_choice, check_tool_history, make_tool,
                                     parse_arguments)
from freetoken.server.anthropic_protocol import AnthropicText, CountTokensRequest
from freetoken.server.image_parts import (anthropic_image_ref, anthropic_tool_content,
                                         check_role, openai_content)
from freetoken.server.protocol import ChatCompletionRequest, TextPart


def text_of(content: str | list | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(part.text for part in content if isinstance(part, (TextPart, AnthropicText)))


# ---- OpenAI chat ------------------------------------------------------------------------------

def openai_agent_request(body: ChatCompletionRequest) -> AgentRequest:
    tools = tuple(make_tool(t.function.name, t.function.description, t.function.parameters,
                            f"tools.{i}.function.parameters")
                  for i, t in enumerate(body.tools or ()))
    choice = body.tool_choice or "auto"
    if not isinstance(choice, str):
        choice = choice.function.name
    check_tool_choice(choice, tools)
    images: list = []
    messages = [openai_message(m, i, images) for i, m in enumerate(body.messages)]
    check_tool_history(messages)
    kwargs = dict(body.chat_template_kwargs or {})
    thinking = kwargs.pop("enable_thinking", None)
    return AgentRequest(messages=messages, tools=tools, tool_choice=choice,
                        parallel_calls=body.parallel_tool_calls,
                        constraint=openai_constraint(body, tools, choice),
                        thinking=None if thinking is None else bool(thinking),
                        template_kwargs=kwargs, images=tuple(images))


def openai_message(message, index: int, images: list) -> dict:
    out: dict = {"role": message.role, "content": openai_content(
        message.content, message.role, f"messages.{index}.content", images)}
    if message.name:
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {
                "name": c.function.name,
                "arguments": parse_arguments(c.function.arguments,
                                             f"messages.{index}.tool_calls.{j}.function."
                                             "arguments")}}
            for j, c in enumerate(message.tool_calls)]
    if message.role == "tool":
        if not message.tool_call_id:
            raise AgentRequestError(f"messages.{index}: a tool message needs tool_call_id",
                                    f"messages.{index}.tool_call_id")
        out["tool_call_id"] = message.tool_call_id
    if message.reasoning_content:
        out["reasoning_content"] = message.reasoning_content
    return out


def openai_constraint(body: ChatCompletionRequest, tools: tuple[Tool, ...],
                      choice: str) -> Constraint:
    if choice == "required":
        return Constraint("tool", tools=tools)
    if choice not in ("auto", "none"):
        return Constraint("tool", tools=tuple(t for t in tools if t.name == choice))
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return Constraint()
    if fmt.type == "json_object":
        return Constraint("json")
    if fmt.json_schema is None:
        raise AgentRequestError("response_format of type json_schema needs json_schema",
                                "response_format.json_schema")
    schema = fmt.json_schema.schema_ or {"type": "object"}
    make_tool("response_format", None, schema, "response_format.json_schema.schema")
    return Constraint("json", schema=schema)


# ---- Anthropic messages -----------------------------------------------------------------------

def anthropic_agent_request(body: CountTokensRequest, max_tokens: int | None) -> AgentRequest:
    tools = tuple(make_tool(t.name, t.description, t.input_schema, f"tools.{i}.input_schema")
                  for i, t in enumerate(body.tools or ()))
    picked = body.tool_choice
    choice = {"auto": "auto", "any": "required", "none": "none"}.get(
        picked.type if picked else "auto", None)
    if choice is None:   # {"type": "tool", "name": ...}
        if not picked.name:
            raise AgentRequestError("tool_choice of type tool needs name", "tool_choice.name")
        choice = picked.name
    check_tool_choice(choice, tools, "tool_choice.name" if picked and picked.type == "tool"
                      else "tool_choice")
    system = text_of(body.system)
    messages = [{"role": "system", "content": system}] if system else []
    images: list = []
    for i, message in enumerate(body.messages):
        messages.extend(anthropic_messages(message, i, images))
    check_tool_history(messages)
    thinking, budget = None, None
    if body.thinking is not None:
        thinking = body.thinking.type == "enabled"
        budget = getattr(body.thinking, "budget_tokens", None)
        if budget is not None and max_tokens is not None and budget >= max_tokens:
            raise AgentRequestError(f"thinking.budget_tokens ({budget}) must be less than "
                                    f"max_tokens ({max_tokens})", "thinking.budget_tokens")
    constraint = Constraint()
    if choice == "required":
        constraint = Constraint("tool", tools=tools)
    elif choice not in ("auto", "none"):
        constraint = Constraint("tool", tools=tuple(t for t in tools if t.name == choice))
    return AgentRequest(messages=messages, tools=tools, tool_choice=choice,
                        parallel_calls=not (picked and picked.disable_parallel_tool_use),
                        constraint=constraint, thinking=thinking, thinking_budget=budget,
                        images=tuple(images))


def anthropic_messages(message, index: int, images: list) -> list[dict]:
    """One Anthropic message as OpenAI-shaped messages: tool results become `tool` messages,
    tool_use blocks the assistant's tool_calls, thinking blocks its reasoning_content; with
    image blocks the content is the list of text and image items. `images` gets the refs in
    the order the messages render them: tool results' first."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts, calls, results, reasoning, items = [], [], [], [], []
    own_images: list = []
    for j, block in enumerate(message.content):
        where = f"messages.{index}.content.{j}"
        if block.type == "text":
            texts.append(block.text)
            items.append({"type": "text", "text": block.text})
        elif block.type == "image":
            check_role(message.role, where)
            own_images.append(anthropic_image_ref(block, where))
            items.append({"type": "image"})
        elif block.type == "thinking":
            reasoning.append(block.thinking)
        elif block.type == "tool_use":
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": block.input}})
        else:
            results.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": anthropic_tool_content(block, where, images)})
    images.extend(own_images)
    out: list[dict] = list(results)
    has_image = len(items) > len(texts)
    if texts or calls or not results or has_image:
        main: dict = {"role": message.role, "content": items if has_image else "\n".join(texts)}
        if calls:
            main["tool_calls"] = calls
        if reasoning:
            main["reasoning_content"] = "\n".join(reasoning)
        out.append(main)
    return out
