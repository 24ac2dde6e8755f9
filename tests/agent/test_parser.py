"""The streaming output parser against recorded token streams of each dialect.

Each stream is a reply in a family's published output format, split into tokens as that
family's tokenizer splits it (markers are single tokens); fed token by token, character by
character and whole, the parser must give the same reasoning, content and calls, and never
leak a marker.
"""

import json

import pytest

from freetoken.agent.dialect import HERMES, JSON, LLAMA3, MISTRAL, detect_dialect
from freetoken.agent.parser import Content, OutputParser, Reasoning, ToolCall

TOOLS = {"get_weather", "get_time"}

QWEN_TEMPLATE = "...<tool_call>...</tool_call>...<think>..."
LLAMA_TEMPLATE = "{% if tools %}<|start_header_id|>...{% endif %}"
MISTRAL_TEMPLATE = "[AVAILABLE_TOOLS]{{ tools }}[TOOL_CALLS]"
CHATML = "<|im_start|>{{ m.content }}<|im_end|>"

# Qwen3 with thinking on: reasoning, then two calls in Hermes form.
QWEN3_TWO_CALLS = [
    "<think>", "\n", "The", " user", " wants", " weather", " and", " time", ".", "\n",
    "</think>", "\n\n", "<tool_call>", "\n", '{"', "name", '":', ' "', "get", "_weather", '",',
    ' "', "arguments", '":', ' {"', "city", '":', ' "', "Paris", '"}}', "\n", "</tool_call>",
    "\n", "<tool_call>", "\n", '{"', "name", '":', ' "', "get", "_time", '",', ' "',
    "arguments", '":', ' {"', "tz", '":', ' "', "CET", '"}}', "\n", "</tool_call>"]
# Qwen3 answering in text after reasoning (no call).
QWEN3_TEXT = ["<think>", "\n", "Simple", ".", "\n", "</think>", "\n\n", "Hello", "!", " How",
              " can", " I", " help", "?"]
# A "thinking" template that opened <think> in the prompt: the reply starts inside it.
OPENED_THINK = ["Let", " me", " think", ".", "\n", "</think>", "\n\n", "4"]
# Mistral v3: the special [TOOL_CALLS] token is dropped by decoding; its text form also seen.
MISTRAL_CALLS = ["[", '{"', "name", '":', ' "', "get", "_weather", '",', ' "', "arguments",
                 '":', ' {"', "city", '":', ' "', "Paris", '"}}', "]"]
MISTRAL_MARKED = ["I", "'ll", " check", ".", "[TOOL_CALLS]", "get_weather", "[ARGS]", '{"',
                  "city", '":', ' "', "Paris", '"}']
# Llama 3.1 JSON tool calling: a bare object with "parameters".
LLAMA3_CALL = ['{"', "name", '":', ' "', "get", "_weather", '",', ' "', "parameters", '":',
               ' {"', "city", '":', ' "', "Paris", '"}}']
# Generic fallback (SmolLM2's template knows no tools).
GENERIC_CALL = [" ", '{"', "name", '":', ' "', "get", "_time", '",', ' "', "arguments", '":',
                ' {}}']
GENERIC_TEXT = ["The", " weather", " is", " {", "nice", "}", "."]


def run(dialect, pieces, tools=TOOLS, in_thinking=False):
    parser = OutputParser(dialect, tools, in_thinking)
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    return events + parser.finish()


def summary(events):
    reasoning = "".join(e.text for e in events if isinstance(e, Reasoning))
    content = "".join(e.text for e in events if isinstance(e, Content))
    calls = [(e.index, e.name, json.loads(e.arguments)) for e in events
             if isinstance(e, ToolCall)]
    return reasoning, content, calls


def feeds(pieces):
    """The same stream token by token, character by character and in one piece."""
    text = "".join(pieces)
    return [pieces, list(text), [text]]


def dialect_of(template, vocab=()):
    return detect_dialect(template, vocab)


@pytest.mark.parametrize("template, name", [(QWEN_TEMPLATE, HERMES), (LLAMA_TEMPLATE, LLAMA3),
                                            (MISTRAL_TEMPLATE, MISTRAL), (CHATML, JSON),
                                            (None, JSON)])
def test_dialect_from_template(template, name):
    assert dialect_of(template).name == name


def test_think_markers_come_from_template_or_vocabulary():
    assert dialect_of(QWEN_TEMPLATE).think_open == "<think>"
    assert dialect_of(CHATML).think_open is None
    assert dialect_of(CHATML, ["<think>", "</think>"]).think_close == "</think>"


@pytest.mark.parametrize("pieces", feeds(QWEN3_TWO_CALLS))
def test_hermes_two_calls_after_reasoning(pieces):
    reasoning, content, calls = summary(run(dialect_of(QWEN_TEMPLATE), pieces))
    assert reasoning == "\nThe user wants weather and time.\n"
    assert content == ""
    assert calls == [(0, "get_weather", {"city": "Paris"}), (1, "get_time", {"tz": "CET"})]


def test_parallel_calls_off_keeps_the_first_call():
    parser = OutputParser(dialect_of(QWEN_TEMPLATE), TOOLS, max_calls=1)
    events = parser.feed("".join(QWEN3_TWO_CALLS)) + parser.finish()
    assert summary(events)[2] == [(0, "get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("pieces", feeds(QWEN3_TEXT))
def test_hermes_text_answer_after_reasoning(pieces):
    reasoning, content, calls = summary(run(dialect_of(QWEN_TEMPLATE), pieces))
    assert (reasoning, content, calls) == ("\nSimple.\n", "Hello! How can I help?", [])


@pytest.mark.parametrize("pieces", feeds(OPENED_THINK))
def test_reply_that_starts_inside_an_opened_think_block(pieces):
    reasoning, content, _ = summary(run(dialect_of(QWEN_TEMPLATE), pieces, None,
                                        in_thinking=True))
    assert (reasoning, content) == ("Let me think.\n", "4")


def test_reasoning_streams_before_the_block_closes():
    parser = OutputParser(dialect_of(QWEN_TEMPLATE), None)
    early = parser.feed("<think>\nStep one, step two</thi")
    assert summary(early)[0] == "\nStep one, step two"   # "</thi" is held back
    assert summary(parser.feed("nk>\n\nDone") + parser.finish())[:2] == ("", "Done")


@pytest.mark.parametrize("pieces", feeds(MISTRAL_CALLS))
def test_mistral_list_of_calls(pieces):
    _, content, calls = summary(run(dialect_of(MISTRAL_TEMPLATE), pieces))
    assert content == "" and calls == [(0, "get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("pieces", feeds(MISTRAL_MARKED))
def test_mistral_marker_with_args_form(pieces):
    _, content, calls = summary(run(dialect_of(MISTRAL_TEMPLATE), pieces))
    assert content == "I'll check." and calls == [(0, "get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("pieces", feeds(LLAMA3_CALL))
def test_llama3_json_call_with_parameters(pieces):
    _, content, calls = summary(run(dialect_of(LLAMA_TEMPLATE), pieces))
    assert content == "" and calls == [(0, "get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("pieces", feeds(GENERIC_CALL))
def test_generic_json_fallback(pieces):
    _, content, calls = summary(run(dialect_of(CHATML), pieces))
    assert content == "" and calls == [(0, "get_time", {})]


def test_generic_text_with_braces_stays_content():
    assert summary(run(dialect_of(CHATML), GENERIC_TEXT)) == ("", "The weather is {nice}.", [])


def test_unknown_tool_or_broken_json_is_content_not_a_call():
    hermes = dialect_of(QWEN_TEMPLATE)
    bad = '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'
    assert summary(run(hermes, [bad])) == ("", bad, [])
    broken = '<tool_call>\n{"name": "get_time", "argum'
    assert summary(run(hermes, [broken])) == ("", broken, [])
    assert summary(run(dialect_of(CHATML), ['{"a": 1}'])) == ("", '{"a": 1}', [])


def test_without_tools_markers_are_plain_text():
    text = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    assert summary(run(dialect_of(QWEN_TEMPLATE), [text], tools=None)) == ("", text, [])
