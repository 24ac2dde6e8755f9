"""Prefix-cache reporting through the real `openai` and `anthropic` clients: a repeated
conversation reports its cached prompt tokens, answers exactly as the first time, and the totals
reach /v1/stats and /metrics."""

import re

import anthropic
import httpx
import openai

BLOCK = 16  # the test engine's page size (tests/server/conftest.py)
SYSTEM = "You are an agent with tools: search(query), open(path), edit(path, text). " * 3
HISTORY = [{"role": "system", "content": SYSTEM},
           {"role": "user", "content": "Find the failing test and fix it."}]


def full_pages_before_last(prompt_tokens: int) -> int:
    """What a repeat of a prompt reuses: every full page but never its last token."""
    return (prompt_tokens - 1) // BLOCK * BLOCK


def test_openai_chat_and_completions_report_cached_tokens(server):
    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=300)
    history = HISTORY + [{"role": "user", "content": "openai variant"}]
    first, second = (client.chat.completions.create(
        model=server.loaded.name, messages=history, max_tokens=8, temperature=0)
        for _ in range(2))
    assert second.choices[0].message.content == first.choices[0].message.content
    prompt = second.usage.prompt_tokens
    assert prompt > 2 * BLOCK
    assert second.usage.prompt_tokens_details.cached_tokens == full_pages_before_last(prompt)
    text = SYSTEM + " completions variant"
    completions = [client.completions.create(model=server.loaded.name, prompt=text, max_tokens=4,
                                             temperature=0) for _ in range(2)]
    assert completions[0].usage.prompt_tokens_details.cached_tokens == 0
    assert (completions[1].usage.prompt_tokens_details.cached_tokens
            == full_pages_before_last(completions[1].usage.prompt_tokens))
    assert completions[1].choices[0].text == completions[0].choices[0].text


def test_anthropic_reports_cache_reads_apart_from_input_tokens(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0,
                                 timeout=300)
    kw = dict(model=server.loaded.name, max_tokens=8, system="Anthropic route. " + SYSTEM,
              messages=[{"role": "user", "content": "anthropic variant"}],
              extra_body={"temperature": 0})
    first = client.messages.create(**kw)
    second = client.messages.create(**kw)
    assert first.usage.cache_read_input_tokens == 0 and first.usage.cache_creation_input_tokens == 0
    prompt = first.usage.input_tokens
    assert second.usage.cache_read_input_tokens == full_pages_before_last(prompt)
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == prompt
    assert second.content[0].text == first.content[0].text
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert final.usage.cache_read_input_tokens == full_pages_before_last(prompt)
    assert final.content[0].text == first.content[0].text


def test_stats_and_metrics_count_hits_and_queries(server):
    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=300)
    for _ in range(2):
        client.chat.completions.create(model=server.loaded.name, messages=HISTORY, max_tokens=2,
                                       temperature=0)
    stats = httpx.get(server.v1 + "/stats", timeout=60).json()
    assert stats["prefix_cache"] is True
    assert 0 < stats["prefix_cache_hit_tokens"] < stats["prefix_cache_queried_tokens"]
    assert stats["prefix_cache_evictions"] >= 0 and stats["kv_pages_cached"] > 0
    text = httpx.get(server.url + "/metrics", timeout=60).text
    for name, key in (("hit_tokens", "prefix_cache_hit_tokens"),
                      ("queried_tokens", "prefix_cache_queried_tokens"),
                      ("evictions", "prefix_cache_evictions")):
        match = re.search(rf"^freetoken_prefix_cache_{name}_total ([0-9.e+]+)$", text, re.M)
        assert match, f"freetoken_prefix_cache_{name}_total missing from /metrics"
        assert float(match.group(1)) >= stats[key]
