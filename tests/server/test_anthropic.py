"""Anthropic /v1/messages through the real `anthropic` client and raw httpx."""

import anthropic
import httpx
import pytest

from tests.server.conftest import API_KEY

MESSAGES = [{"role": "user", "content": "Describe continuous batching."}]


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)


GREEDY = {"temperature": 0}  # this client version has no sampling arguments: send them as body


def create(client, name, **kw):
    kw.setdefault("messages", MESSAGES)
    return client.messages.create(model=name, max_tokens=12, extra_body=GREEDY, **kw)


def test_message_non_stream(client, server):
    reply = create(client, server.loaded.name, system="Be brief.")
    assert reply.type == "message" and reply.role == "assistant"
    assert reply.stop_reason == "max_tokens" and reply.stop_sequence is None
    assert reply.usage.output_tokens == 12 and reply.usage.input_tokens > 0
    assert [b.type for b in reply.content] == ["text"]


def test_system_and_content_blocks_equal_plain_strings(client, server):
    plain = create(client, server.loaded.name, system="Be brief.")
    blocks = create(client, server.loaded.name,
                    system=[{"type": "text", "text": "Be brief."}],
                    messages=[{"role": "user", "content": [
                        {"type": "text", "text": MESSAGES[0]["content"]}]}])
    assert blocks.content[0].text == plain.content[0].text
    assert (blocks.usage.input_tokens + blocks.usage.cache_read_input_tokens
            == plain.usage.input_tokens + plain.usage.cache_read_input_tokens)


def test_stream_events_in_order_and_text_matches(client, server):
    plain = create(client, server.loaded.name)
    events = list(client.messages.create(model=server.loaded.name, max_tokens=12,
                                         extra_body=GREEDY, messages=MESSAGES, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]  # the client hides ping
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == plain.content[0].text
    delta = events[-2]
    assert delta.delta.stop_reason == "max_tokens" and delta.usage.output_tokens == 12
    with client.messages.stream(model=server.loaded.name, max_tokens=12, extra_body=GREEDY,
                                messages=MESSAGES) as stream:
        assert stream.get_final_text() == plain.content[0].text


def test_stop_sequence(client, server):
    full = create(client, server.loaded.name).content[0].text
    stop = full[4:6]
    reply = create(client, server.loaded.name, stop_sequences=[stop])
    assert reply.content[0].text == full[:full.index(stop)]
    assert (reply.stop_reason, reply.stop_sequence) == ("stop_sequence", stop)


def assert_anthropic_error(response, status, kind, words=()):
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind
    for word in words:
        assert word in body["error"]["message"]


@pytest.mark.parametrize("body,words", [
    ({"messages": MESSAGES}, ["max_tokens"]),
    ({"messages": MESSAGES, "max_tokens": 5, "wat": 1}, ["wat"]),
    ({"messages": MESSAGES, "max_tokens": 5, "temperature": 1.5}, ["temperature"]),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
      "max_tokens": 5}, ["messages.0.content"]),
    ({"messages": [{"role": "robot", "content": "x"}], "max_tokens": 5}, ["role"]),
])
def test_bad_requests_get_anthropic_error_bodies(server, body, words):
    r = httpx.post(server.url + "/v1/messages", json=body, timeout=300)
    assert_anthropic_error(r, 400, "invalid_request_error", words)


def test_unknown_model_and_client_errors(server, client):
    r = httpx.post(server.url + "/v1/messages",
                   json={"model": "claude-x", "messages": MESSAGES, "max_tokens": 5})
    assert_anthropic_error(r, 404, "not_found_error", ["claude-x"])
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=server.loaded.name, max_tokens=5, messages=MESSAGES,
                               extra_body={"temperature": 7.0})


def test_api_key_header_forms(keyed_server):
    url = keyed_server.url + "/v1/messages"
    body = {"messages": MESSAGES, "max_tokens": 2}
    assert_anthropic_error(httpx.post(url, json=body), 401, "authentication_error")
    assert_anthropic_error(httpx.post(url, json=body, headers={"x-api-key": "bad"}), 401,
                           "authentication_error")
    assert httpx.post(url, json=body, headers={"x-api-key": API_KEY},
                      timeout=300).status_code == 200
    assert httpx.post(url, json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=300).status_code == 200
    good = anthropic.Anthropic(base_url=keyed_server.url, api_key=API_KEY, max_retries=0)
    assert good.messages.create(model=keyed_server.loaded.name, max_tokens=2,
                                messages=MESSAGES).usage.output_tokens == 2


def test_raw_event_stream_framing(server):
    body = {"messages": MESSAGES, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=300) as r:
        raw = r.read().decode()
    blocks = [b for b in raw.split("\n\n") if b]
    names = [b.split("\n")[0].removeprefix("event: ") for b in blocks]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert all(b.split("\n")[1].startswith("data: {") for b in blocks)
