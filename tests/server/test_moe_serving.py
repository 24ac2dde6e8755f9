"""A tiny MoE served through every endpoint, from an HF folder and from a Q8_0 GGUF.

The greedy completion of the HF model must be transformers' own greedy continuation; /v1/stats
and /metrics must show the expert count, the experts per token and the active parameters.
"""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from tests.models.helpers import tiny_hf_model
from tests.models.tiny_gguf import write_gguf

Q8_0 = 8


@pytest.fixture(scope="module")
def moe_sources(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve-qwen3_moe")
    hf = tiny_hf_model("qwen3_moe", folder, seed=11, num_hidden_layers=2)
    gguf_dir = tmp_path_factory.mktemp("serve-qwen2_moe")
    hf2 = tiny_hf_model("qwen2_moe", gguf_dir, seed=12)
    gguf = gguf_dir / "tiny-qwen2_moe.gguf"
    write_gguf(hf2, gguf_dir, gguf, "qwen2_moe", Q8_0)
    return {"hf": (folder, hf), "gguf": (gguf, None)}


def _serve(path: str):
    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import Engine
    from freetoken.models.loader import load_model
    from freetoken.server.app import create_app
    from freetoken.server.launch import ServerThread

    loaded = load_model(path, device="cpu")
    config = EngineConfig(num_tokens=1024, block_size=16, max_num_seqs=8,
                          max_prefill_tokens=128, device="cpu")
    engine = Engine.from_loaded(loaded, config).start()
    engine.warm_up()
    app = create_app(engine, loaded.tokenizer, loaded.name)
    return loaded, engine, ServerThread(app, "127.0.0.1", 0).start()


def _hf_greedy(hf, ids: list[int], count: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=count, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_moe_model_serves_every_endpoint(source, moe_sources, moe_ops):
    path, hf = moe_sources[source]
    loaded, engine, thread = _serve(str(path))
    try:
        v1 = thread.url + "/v1"
        client = openai.OpenAI(base_url=v1, api_key="x", max_retries=0, timeout=300)
        name = loaded.name
        assert [m.id for m in client.models.list().data] == [name]
        messages = [{"role": "user", "content": "Which expert answers?"}]
        chat = client.chat.completions.create(model=name, messages=messages, max_tokens=8,
                                              temperature=0)
        streamed = "".join(c.choices[0].delta.content or "" for c in
                           client.chat.completions.create(model=name, messages=messages,
                                                          max_tokens=8, temperature=0,
                                                          stream=True))
        assert chat.usage.completion_tokens == 8 and streamed == chat.choices[0].message.content
        ids = loaded.tokenizer.encode("The quick brown fox")
        completion = client.completions.create(model=name, prompt=ids, max_tokens=6,
                                               temperature=0, extra_body={"ignore_eos": True})
        if hf is not None:
            expected = loaded.tokenizer.decode(_hf_greedy(hf, ids, 6))
            assert completion.choices[0].text == expected
        reply = httpx.post(v1 + "/messages", timeout=300, json={
            "model": name, "max_tokens": 5, "messages": messages, "temperature": 0}).json()
        assert reply["type"] == "message" and reply["usage"]["output_tokens"] == 5
        assert httpx.get(thread.url + "/health").json()["status"] == "ok"
        stats = httpx.get(v1 + "/stats").json()
        cfg = loaded.config
        assert (stats["num_experts"], stats["experts_per_token"]) == (8, 2)
        assert stats["active_params_per_token"] == cfg.active_params_per_token < cfg.num_params
        metrics = httpx.get(thread.url + "/metrics").text
        assert "freetoken_model_num_experts 8.0" in metrics
        assert "freetoken_model_experts_per_token 2.0" in metrics
        assert f"freetoken_model_active_params_per_token {float(cfg.active_params_per_token)}" \
            in metrics
    finally:
        thread.stop()
        engine.shutdown()
