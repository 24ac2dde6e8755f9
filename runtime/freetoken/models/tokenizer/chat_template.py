"""Chat templates rendered in jinja2's immutable sandbox: templates are untrusted input."""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

from freetoken.models.errors import ChatTemplateError


def _raise_exception(message: str):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Templates expect the text verbatim (no HTML escaping, unicode kept).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _generation_extension():
    """`{% generation %}...{% endgeneration %}` marks assistant text; here it renders as-is."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationBlock(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    return GenerationBlock


@functools.lru_cache(maxsize=16)
def compile_template(source: str):
    """A compiled template (cached by its text); syntax errors raise ChatTemplateError."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols", _generation_extension()])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from None


def render_chat(source: str, messages: list[dict], add_generation_prompt: bool,
                special_tokens: dict[str, str | None], **kwargs: Any) -> str:
    """Render `messages`; template variables: messages, add_generation_prompt, tools,
    documents, the special token strings (bos_token, eos_token, ...) and `kwargs`."""
    template = compile_template(source)
    context = {**special_tokens, "tools": None, "documents": None, **kwargs}
    try:
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               **context)
    except Exception as exc:   # any failure inside an untrusted template is the template's
        raise ChatTemplateError(f"chat template failed to render: {exc}") from None
