"""The one content check: the embedded default SmolLM2-135M-Instruct answers a fact."""

import openai
import pytest

pytestmark = [pytest.mark.needs_weights, pytest.mark.slow]


@pytest.fixture(scope="module")
def default_server():
    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import Engine
    from freetoken.models.loader import load_model
    from freetoken.server.app import create_app
    from freetoken.server.launch import ServerThread

    loaded = load_model(None, device="cpu")
    engine = Engine.from_loaded(loaded, EngineConfig(num_tokens=2048, max_num_seqs=4,
                                                     device="cpu")).start()
    thread = ServerThread(create_app(engine, loaded.tokenizer, loaded.name)).start()
    yield thread.url, loaded.name
    thread.stop()
    engine.shutdown()


def test_smollm2_knows_the_capital_of_france(default_server):
    url, name = default_server
    assert name == "SmolLM2-135M-Instruct"
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
    reply = client.chat.completions.create(
        model=name, temperature=0, max_tokens=48,
        messages=[{"role": "user",
                   "content": "What is the capital of France? Answer in one sentence."}])
    text = reply.choices[0].message.content
    assert "Paris" in text, text
    assert reply.choices[0].finish_reason in ("stop", "length")
