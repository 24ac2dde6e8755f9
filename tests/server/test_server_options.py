"""/openapi.json and /docs, --max-output-tokens and --cors-origin, over the tiny llama engine."""

import httpx
import pytest
from click.testing import CliRunner

from tests.engine.tiny_llama import CONTEXT

BODIES = {"/v1/chat/completions": "ChatCompletionRequest",
          "/v1/completions": "CompletionRequest", "/v1/messages": "MessagesRequest",
          "/v1/messages/count_tokens": "CountTokensRequest"}


@pytest.fixture(scope="module")
def served(engine, tiny_loaded):
    """A front end with max_output_tokens=5 and one allowed browser origin."""
    from freetoken.server.app import create_app
    from freetoken.server.launch import ServerThread

    app = create_app(engine, tiny_loaded.tokenizer, tiny_loaded.name, max_output_tokens=5,
                     cors_origins=("http://app.example",))
    thread = ServerThread(app, "127.0.0.1", 0).start()
    yield thread.url
    thread.stop()


def test_openapi_lists_the_routes_with_their_request_bodies(server):
    doc = httpx.get(server.url + "/openapi.json", timeout=30).json()
    schemas = doc["components"]["schemas"]
    for path, model in BODIES.items():
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"]["$ref"] == f"#/components/schemas/{model}"
        assert schemas[model]["additionalProperties"] is False
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert {"messages", "tools", "tool_choice", "response_format"} <= set(chat)
    assert httpx.get(server.url + "/docs", timeout=30).status_code == 200


def test_what_the_schema_allows_is_what_the_server_accepts(server):
    """Every top-level chat field the schema lists is accepted; one it does not is a 400."""
    from freetoken.server.protocol import ChatCompletionRequest

    doc = httpx.get(server.url + "/openapi.json", timeout=30).json()
    listed = set(doc["components"]["schemas"]["ChatCompletionRequest"]["properties"])
    assert listed == {f.alias or name for name, f in ChatCompletionRequest.model_fields.items()}
    r = httpx.post(server.v1 + "/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "not_in_schema": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "not_in_schema"


def completion(url, **extra):
    return httpx.post(url + "/v1/completions", timeout=60, json={
        "prompt": "abc", "temperature": 0, "ignore_eos": True, **extra})


def test_max_output_tokens_is_default_and_cap(served, server):
    assert completion(served).json()["usage"]["completion_tokens"] == 5
    assert completion(served, max_tokens=50).json()["usage"]["completion_tokens"] == 5
    assert completion(served, max_tokens=3).json()["usage"]["completion_tokens"] == 3
    assert completion(server.url, max_tokens=50).json()["usage"]["completion_tokens"] == 50
    r = completion(served, max_tokens=CONTEXT * 2)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_cors_origin(served, server):
    preflight = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type"}
    r = httpx.options(served + "/v1/chat/completions", headers=preflight, timeout=30)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "http://app.example"
    other = httpx.options(served + "/v1/chat/completions", timeout=30,
                          headers={**preflight, "Origin": "http://evil.example"})
    assert other.headers.get("access-control-allow-origin") is None
    plain = httpx.get(server.url + "/health", headers={"Origin": "http://app.example"},
                      timeout=30)
    assert "access-control-allow-origin" not in plain.headers


def test_serve_options_exist():
    from freetoken.cli.main import main

    text = CliRunner().invoke(main, ["serve", "--help"]).output
    assert "--max-output-tokens" in text and "--cors-origin" in text


@pytest.mark.parametrize("flags, overlap", [([], True), (["--no-overlap"], False)])
def test_serve_overlap_flag_reaches_the_engine_config(monkeypatch, tmp_path, flags, overlap):
    import freetoken.cli.serve as serve
    from freetoken.cli.main import main

    seen = []
    monkeypatch.setattr(serve, "run_server", lambda path, dtype, config, *rest: seen.append(config))
    result = CliRunner().invoke(main, ["serve", "--model", str(tmp_path), *flags])
    assert result.exit_code == 0, result.output
    assert seen[0].overlap is overlap
