"""Random-weight tiny models given real chat templates (Qwen3, Llama 3.1, Mistral): the dialect
is found from the template, prompts with tools and tool turns render as transformers renders
them, and a forced tool call in each family's own format comes back as a schema-valid call."""

import asyncio
import json

import jsonschema
import pytest

from freetoken.agent.dialect import HERMES, LLAMA3, MISTRAL
from freetoken.agent.request import AgentRequest, Constraint, make_tool
from freetoken.engine.request import SamplingParams
from tests.agent.templates import write_family

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
    "metric": {"type": "boolean"},
    "note": {"type": "string", "maxLength": 6}}, "required": ["city", "metric", "note"],
    "additionalProperties": False}
TOOLS = (make_tool("get_weather", "Weather in a city", SCHEMA, "tools.0"),
         make_tool("get_time", "The time now", None, "tools.1"))
HISTORY = [
    {"role": "system", "content": "You help."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call12345", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris", "metric": True,
                                                           "note": "x"}}}]},
    {"role": "tool", "tool_call_id": "call12345", "content": "18 C, sunny"},
    {"role": "user", "content": "And now?"}]


@pytest.fixture(scope="module", params=["qwen3", "llama3.1", "mistral"])
def family(request, tmp_path_factory):
    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import Engine
    from freetoken.models.loader import load_model
    from freetoken.server.agent import AgentSupport

    directory = tmp_path_factory.mktemp(request.param)
    write_family(directory, request.param)
    loaded = load_model(str(directory), device="cpu")
    engine = Engine.from_loaded(loaded, EngineConfig(num_tokens=4096, block_size=16,
                                                     max_num_seqs=4, device="cpu")).start()
    yield request.param, directory, loaded, engine, AgentSupport(
        loaded.tokenizer, loaded.config.vocab_size)
    engine.shutdown()


EXPECTED = {"qwen3": (HERMES, "<think>"), "llama3.1": (LLAMA3, None), "mistral": (MISTRAL, None)}


def test_dialect_found_from_the_template(family):
    name, _, _, _, support = family
    assert (support.dialect.name, support.dialect.think_open) == EXPECTED[name]
    assert support.dialect.template_tools


def test_prompt_with_tools_and_results_matches_transformers(family):
    from transformers import PreTrainedTokenizerFast

    name, directory, _, _, support = family
    hf = PreTrainedTokenizerFast.from_pretrained(directory)
    request = AgentRequest(messages=HISTORY, tools=TOOLS)
    text, ids = support.render(request)
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                               "parameters": t.parameters}} for t in TOOLS]
    reference = hf.apply_chat_template(HISTORY, tools=tools, add_generation_prompt=True,
                                       tokenize=False)
    assert text == reference
    assert "get_weather" in text and "18 C, sunny" in text
    assert ids == hf(reference, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("thinking", [False, None])
def test_forced_call_comes_back_in_the_family_format(family, thinking):
    """thinking None on Qwen3: the model may open <think> first (the grammar allows it), reason
    up to the budget, then the call follows."""
    _, _, loaded, engine, support = family
    request = AgentRequest(messages=HISTORY[:2], tools=TOOLS, tool_choice="get_weather",
                           constraint=Constraint("tool", tools=TOOLS[:1]),
                           thinking=thinking)
    prepared = support.prepare(request, 160)
    params = SamplingParams(temperature=0.0, max_tokens=160)

    async def run():
        stream = engine.submit(prepared.prompt_ids, params, guide=prepared.guide)
        return [out async for out in stream]

    outputs = asyncio.run(run())
    text = "".join(o.text for o in outputs)
    assert outputs[-1].finish_reason == "stop", text     # the grammar ended in EOS
    events = prepared.parser.feed(text) + prepared.parser.finish()
    calls = prepared.parser.calls
    assert len(calls) == 1 and calls[0].name == "get_weather", (text, events)
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMA)


def test_bad_schema_for_the_grammar_library_is_named(family):
    from freetoken.agent.request import AgentRequestError

    *_, support = family
    bad = make_tool("f", "", {"type": "object", "properties": {"a": {"type": "string",
                                                                     "pattern": "(("}}},
                    "tools.0.function.parameters")
    with pytest.raises(AgentRequestError) as info:
        support.prepare(AgentRequest(messages=HISTORY[:2], tools=(bad,)), 10)
    assert info.value.param == "tools.0"
