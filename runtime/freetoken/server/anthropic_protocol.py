"""Request bodies of /v1/messages and /v1/messages/count_tokens, validated strictly."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field

from freetoken.engine.request import SamplingParams
from freetoken.server.image_protocol import AnthropicImage
from freetoken.server.protocol import Strict, build_sampling_params


class AnthropicText(Strict):
    type: Literal["text"]
    text: str
    cache_control: dict | None = None   # accepted and ignored: there is no prompt cache
    citations: list | None = None


ResultBlock = Annotated[Union[AnthropicText, AnthropicImage], Field(discriminator="type")]


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[ResultBlock] | None = None
    is_error: bool = False
    cache_control: dict | None = None


class ToolUseBlock(Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict
    cache_control: dict | None = None
    caller: dict | None = None          # echoed back by clients that replay a reply's blocks
    toolset_name: str | None = None


class ThinkingBlock(Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


ContentBlock = Annotated[Union[AnthropicText, AnthropicImage, ToolResultBlock, ToolUseBlock,
                               ThinkingBlock],
                         Field(discriminator="type")]


class AnthropicMessage(Strict):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class AnthropicTool(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    description: str | None = None
    input_schema: dict = Field(description="JSON Schema of the tool's input object")
    type: Literal["custom"] | None = None
    cache_control: dict | None = None


class AnthropicToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingEnabled(Strict):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1)


class ThinkingDisabled(Strict):
    type: Literal["disabled"]


class CountTokensRequest(Strict):
    """The prompt part of a messages request: what /v1/messages/count_tokens counts."""

    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[AnthropicText] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: Annotated[Union[ThinkingEnabled, ThinkingDisabled],
                        Field(discriminator="type")] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    metadata: dict | None = None

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        return build_sampling_params(temperature=self.temperature, top_p=self.top_p,
                                     top_k=self.top_k, max_tokens=max_tokens,
                                     stop=self.stop_sequences or [])
