"""The request body of POST /v1/responses (OpenAI's Responses API), validated strictly like the
other routes' bodies. Items and tools this server cannot serve (built-in tools, stored items)
parse as `OtherItem` / `OtherTool`, so the route refuses them with a 400 that names them."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import ConfigDict, Discriminator, Field, Tag, field_validator
from pydantic_core import PydanticCustomError

from freetoken.engine.request import SamplingParams
from freetoken.server.protocol import JSONSchemaFormat, Strict, build_sampling_params

Status = Literal["in_progress", "completed", "incomplete"]


def _by_type(tags: dict[str, str]):
    """A discriminator: the tag of a value's `type` (the tags are capitalized, so error paths
    leave them out), "Other" for a type not in `tags`."""
    def tag(value) -> str:
        kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
        return tags.get(kind, "Other") if isinstance(kind, str) else "Other"
    return Discriminator(tag)


# ---- content parts ----------------------------------------------------------------------------

class InputText(Strict):
    type: Literal["input_text"]
    text: str


class OutputText(Strict):
    """An earlier reply's text, as a client replays it."""

    type: Literal["output_text"]
    text: str
    annotations: list | None = None
    logprobs: list | None = None


class Refusal(Strict):
    type: Literal["refusal"]
    refusal: str


class InputImage(Strict):
    type: Literal["input_image"]
    image_url: str | None = Field(None, description="data:image/png;base64,... or an http(s) "
                                                    "URL (with --allow-image-urls)")
    detail: Literal["auto", "low", "high", "original"] = "auto"
    file_id: str | None = None


Part = Annotated[Union[InputText, OutputText, Refusal, InputImage],
                 Field(discriminator="type")]


# ---- input items ------------------------------------------------------------------------------

class MessageItem(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]
    id: str | None = None
    status: Status | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallItem(Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = Field(description="the arguments object as a JSON string")
    id: str | None = None
    status: Status | None = None


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[Part]
    id: str | None = None
    status: Status | None = None


class SummaryText(Strict):
    type: Literal["summary_text"]
    text: str


class ReasoningText(Strict):
    type: Literal["reasoning_text", "text"]
    text: str


class ReasoningItem(Strict):
    """An earlier reply's reasoning: its text reaches the template with the next assistant
    turn (as reasoning_content); encrypted_content is not read."""

    type: Literal["reasoning"]
    summary: list[SummaryText]
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    id: str | None = None
    status: Status | None = None


class OtherItem(Strict):
    """An item of a type this server does not take (refused with a 400 naming it)."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str


InputItem = Annotated[Union[
    Annotated[MessageItem, Tag("Message")], Annotated[FunctionCallItem, Tag("FunctionCall")],
    Annotated[FunctionCallOutputItem, Tag("FunctionCallOutput")],
    Annotated[ReasoningItem, Tag("Reasoning")], Annotated[OtherItem, Tag("Other")]],
    _by_type({"message": "Message", "function_call": "FunctionCall",
              "function_call_output": "FunctionCallOutput", "reasoning": "Reasoning"})]


# ---- tools, tool choice, text format, reasoning -----------------------------------------------

class FunctionTool(Strict):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    description: str | None = None
    parameters: dict | None = Field(None, description="JSON Schema of the arguments object")
    strict: bool | None = None


class OtherTool(Strict):
    """A built-in tool (web_search, file_search, custom, ...): refused with a 400 naming it."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str


ToolItem = Annotated[Union[Annotated[FunctionTool, Tag("Function")],
                           Annotated[OtherTool, Tag("Other")]],
                     _by_type({"function": "Function"})]


class NamedFunction(Strict):
    type: Literal["function"]
    name: str


class TextFormat(JSONSchemaFormat):
    """`text.format`: text, json_object, or json_schema with name and schema (flat, as the
    Responses API spells it)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None


class TextConfig(Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = Field(
        None, description="none: no thinking; any other effort: thinking on (for models that "
                          "think); unset: the chat template's default")
    summary: Literal["auto", "concise", "detailed", "none"] | None = None
    generate_summary: Literal["auto", "concise", "detailed", "none"] | None = None


# ---- the request ------------------------------------------------------------------------------

class ResponsesRequest(Strict):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[ToolItem] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    store: bool | None = Field(None, description="accepted; responses are never stored")
    previous_response_id: str | None = Field(None, description="refused: nothing is stored")
    include: list[str] | None = Field(None, description="accepted; nothing extra is included")
    truncation: Literal["auto", "disabled"] | None = Field(
        None, description="accepted; a prompt too long for the context is a 400 either way")
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = Field(None, description="accepted; the prefix cache needs "
                                                           "no key")
    ignore_eos: bool = Field(False, description="extension: generate past the end-of-sequence "
                                                "token, up to max_output_tokens")

    @field_validator("input", mode="before")
    @classmethod
    def _typed_messages(cls, value):
        # An "easy" message ({"role", "content"}) is a message item without its type.
        if not isinstance(value, list):
            return value
        bad = next((i for i, v in enumerate(value) if not isinstance(v, dict)), None)
        if not value or bad is not None:
            raise PydanticCustomError("input_items", "expected a string or a non-empty array of "
                                      "item objects" + ("" if bad is None else
                                                        f"; item {bad} is not an object"))
        return [{"type": "message", **v} if "type" not in v and "role" in v else v
                for v in value]

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        return build_sampling_params(temperature=self.temperature, top_p=self.top_p,
                                     max_tokens=max_tokens, stop=[], ignore_eos=self.ignore_eos)
