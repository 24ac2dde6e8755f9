"""The one content check: the embedded default SmolLM2-135M-Instruct answers a fact."""

import openai
import pytest

pytestmark = [pytest.mark.needs_weights, pytest.mark.slow]


def test_smollm2_knows_the_capital_of_france(smollm2_server):
    url, name = smollm2_server
    assert name == "SmolLM2-135M-Instruct"
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
    reply = client.chat.completions.create(
        model=name, temperature=0, max_tokens=48,
        messages=[{"role": "user",
                   "content": "What is the capital of France? Answer in one sentence."}])
    text = reply.choices[0].message.content
    assert "Paris" in text, text
    assert reply.choices[0].finish_reason in ("stop", "length")
