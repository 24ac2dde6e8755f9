"""Request bodies of every route, validated strictly: unknown fields, bad values and values of
the wrong JSON type (a boolean for a number, a number for a boolean or a string) are 400s."""

from __future__ import annotations

import json
from typing import Annotated, Literal, Union

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from freetoken.engine.request import InvalidSamplingParams, SamplingParams
from freetoken.server.errors import APIError
from freetoken.server.image_protocol import ImageURLPart

MAX_STOP = 16


class Strict(BaseModel):
    # strict: no coercion between JSON types, as OpenAI answers (`seed: true`, `stream: 0`,
    # `prompt: [[false]]` and `temperature: "1"` are 400s); an integer still passes as a float.
    model_config = ConfigDict(extra="forbid", strict=True)


# ---- OpenAI -----------------------------------------------------------------------------------

class TextPart(Strict):
    type: Literal["text"]
    text: str


ContentPart = Annotated[Union[TextPart, ImageURLPart], Field(discriminator="type")]


class FunctionCall(Strict):
    name: str
    arguments: str = Field(description="the arguments object as a JSON string")


class ToolCallItem(Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = Field(None, description="an earlier reply's reasoning; "
                                          "reaches the template (preserve_thinking)")


class FunctionDef(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    description: str | None = None
    parameters: dict | None = Field(None, description="JSON Schema of the arguments object")
    strict: bool | None = None


class ToolDef(Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


class JSONSchemaFormat(Strict):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StreamOptions(Strict):
    include_usage: bool = False


class OpenAISampling(Strict):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="extension; 0 or -1 = off")
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=10, description="extension; 1 = off")
    user: str | None = None
    ignore_eos: bool = False

    def check_supported(self) -> None:
        if self.n != 1:
            raise APIError(400, f"n={self.n} is not supported: this server returns one choice "
                                "per request (n=1)", "n")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true",
                           "stream_options")

    def logprobs_wanted(self) -> int | None:
        """Alternatives per token to report (None: no logprobs)."""
        return None

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return build_sampling_params(
            temperature=self.temperature, top_p=self.top_p,
            top_k=None if self.top_k is None else max(self.top_k, 0), max_tokens=max_tokens,
            seed=self.seed, stop=stop, ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logprobs=self.logprobs_wanted())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict | None = Field(None, description="extra chat template variables, "
                                              "e.g. enable_thinking, preserve_thinking")

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")

    def logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(OpenAISampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    best_of: int | None = None
    logprobs: int | None = Field(None, ge=0, le=5)
    suffix: str | None = None

    def logprobs_wanted(self) -> int | None:
        return self.logprobs

    def check_supported(self) -> None:
        super().check_supported()
        for name, ok in (("echo", not self.echo), ("best_of", self.best_of in (None, 1)),
                         ("suffix", not self.suffix)):
            if not ok:
                raise APIError(400, f"{name} is not supported by this server", name)


# ---- helpers ----------------------------------------------------------------------------------

def build_sampling_params(stop: list[str], **fields) -> SamplingParams:
    if len(stop) > MAX_STOP:
        raise APIError(400, f"at most {MAX_STOP} stop sequences are supported; got {len(stop)}",
                       "stop")
    try:
        return SamplingParams(stop=tuple(stop), **fields)
    except InvalidSamplingParams as exc:
        raise APIError(400, str(exc)) from None


async def parse_body(request: Request, model: type[BaseModel]) -> BaseModel:
    """The JSON body validated against `model`; any problem is an APIError(400) naming it."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None


def validation_error(exc: ValidationError) -> APIError:
    """The first problem pydantic found, as a 400 that names the field."""
    errors = exc.errors(include_url=False)
    extra = [e for e in errors if e["type"] == "extra_forbidden"]
    # A field that may be a string or a list of parts fails both ways; a list was meant to be
    # the list, so its own error says what is wrong.
    inner = [e for e in errors if not _is_union_member(e["loc"][-1:])]
    first = extra[0] if extra else _closest(inner) if inner else errors[0]
    path = _field_path(first["loc"])
    if first["type"] == "extra_forbidden":
        return APIError(400, f"Unknown field '{path}': this server does not accept it; remove it "
                             "from the request", path, "unknown_field")
    if first["type"] == "missing":
        return APIError(400, f"Missing required field '{path}'", path)
    if first["type"] in _EXPECTED:
        return APIError(400, f"Invalid type for '{path}': expected {_EXPECTED[first['type']]}, "
                             f"but got {_json_type(first['input'])} instead", path)
    return APIError(400, f"Invalid value for '{path}': {first['msg']}", path)


def _closest(errors: list[dict]) -> dict:
    """One of the first field's errors: where every member of a union fails, an error of the
    member that came closest (fewest errors, then deepest in the value), so `prompt: [[false]]`
    names prompt.0.0 (a token id) rather than prompt.0 (not a string)."""
    field = errors[0]["loc"][:1]
    mine = [e for e in errors if e["loc"][:1] == field]
    members = [next((p for p in e["loc"] if _is_union_member((p,))), None) for e in mine]

    def distance(i: int) -> tuple[int, int]:
        return members.count(members[i]), -len(mine[i]["loc"])

    return mine[min(range(len(mine)), key=distance)]


# pydantic's type errors, as OpenAI words what it expected
_EXPECTED = {"int_type": "an integer", "float_type": "a number", "bool_type": "a boolean",
             "string_type": "a string", "list_type": "an array", "dict_type": "an object",
             "model_type": "an object"}


def _json_type(value) -> str:
    if value is None:
        return "null"
    for kind, name in ((bool, "a boolean"), (int, "an integer"), (float, "a decimal number"),
                       (str, "a string"), (list, "an array"), (dict, "an object")):
        if isinstance(value, kind):
            return name
    return type(value).__name__


def _field_path(loc: tuple) -> str:
    # NOTE: pydantic adds the union member it tried (e.g. 'str', 'list[TextPart]') to loc, and
    # in a list of tagged parts the part's tag after its index (content.0.image_url.image_url).
    parts, tag_at = [], -1
    for i, p in enumerate(loc):
        if isinstance(p, str) and "tagged-union[" in p and p.startswith("list["):
            tag_at = i + 2
        if i == tag_at or (not isinstance(p, int) and _is_union_member((p,))):
            continue
        parts.append(str(p))
    return ".".join(parts)


def _is_union_member(loc: tuple) -> bool:
    return bool(loc) and isinstance(loc[0], str) and (
        "[" in loc[0] or loc[0] in _TYPE_TAGS or loc[0][:1].isupper())


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal"}
