"""Bad image inputs are 400s in each API's error schema, naming the field; the server keeps
serving. Remote URLs only with --allow-image-urls. The image flags of `ft serve`."""

from __future__ import annotations

import http.server
import threading
import time

import httpx
import pytest
from click.testing import CliRunner

from tests.server.image_fixtures import (b64, data_url, serve_vl, vl_dir,  # noqa: F401
                                         vl_engine, vl_loaded, vl_url)
from tests.vision.images import encode, random_image, solid_png
from tests.vision.test_decode import png_header_only

RED = solid_png(256, 256, (255, 0, 0))
GIF = encode(random_image(16, 16, "RGB"), "GIF")
PART = "messages.0.content.1"


def openai_chat(url: str, part_url: str, role: str = "user", text: str = "Look:"):
    return httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "max_tokens": 2, "messages": [{"role": role, "content": [
            {"type": "text", "text": text},
            {"type": "image_url", "image_url": {"url": part_url}}]}]})


def anthropic_message(url: str, source: dict, role: str = "user"):
    return httpx.post(url + "/v1/messages", timeout=120, json={
        "max_tokens": 2, "messages": [{"role": role, "content": [
            {"type": "text", "text": "Look:"}, {"type": "image", "source": source}]}]})


def openai_error(reply, param: str, *fragments: str) -> None:
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert param in error["message"]
    for fragment in fragments:
        assert fragment in error["message"], error["message"]


def anthropic_error(reply, where: str, *fragments: str) -> None:
    assert reply.status_code == 400, reply.text
    body = reply.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    for fragment in (where, *fragments):
        assert fragment in body["error"]["message"], body["error"]["message"]


OPENAI_CASES = [
    ("data:image/png;base64,iVBORw0K!!!notbase64", "url", "not valid base64"),
    (data_url(RED[: len(RED) // 2]), "url", "truncated or damaged"),
    (data_url(b"\x89PNG\r\n\x1a\n" + bytes(40)), "url", "does not decode"),
    (data_url(RED, "image/gif"), "url", "'image/gif' is not supported"),
    (data_url(GIF, "image/png"), "url", "GIF"),
    (data_url(png_header_only(30_000, 30_000)), "url", "900000000 pixels"),
    (data_url(solid_png(4, 1000, (0, 0, 0))), "url", "aspect ratio"),
    ("data:image/png," + b64(RED), "url", "only base64 data URLs"),
    ("file:///etc/passwd", "url", "data URL"),
    ("https://example.com/cat.png", "url", "--allow-image-urls"),
]


@pytest.mark.parametrize("url,field,fragment", OPENAI_CASES,
                         ids=["base64", "truncated", "corrupt", "declared-gif", "actual-gif",
                              "pixel-bomb", "aspect", "not-base64-url", "file-url",
                              "remote-url-off"])
def test_openai_bad_images_are_400s_naming_the_field(vl_url, vl_engine, url, field, fragment):
    before = len(vl_engine.calls)
    openai_error(openai_chat(vl_url, url), f"{PART}.image_url.{field}", fragment)
    assert len(vl_engine.calls) == before          # nothing reached the engine


ANTHROPIC_CASES = [
    ({"type": "base64", "media_type": "image/png", "data": "@@@"}, "source.data", "base64"),
    ({"type": "base64", "media_type": "image/gif", "data": b64(GIF)}, "source.media_type",
     "not supported"),
    ({"type": "base64", "media_type": "image/png", "data": b64(RED[:100])}, "source.data",
     "truncated or damaged"),
    ({"type": "base64", "data": b64(RED)}, "source.media_type", "required"),
    ({"type": "base64", "media_type": "image/png", "data": b64(png_header_only(9000, 9000))},
     "source.data", "pixels"),
    ({"type": "url", "url": "https://example.com/cat.png"}, "source.url",
     "--allow-image-urls"),
    ({"type": "url", "url": "ftp://example.com/cat.png"}, "source.url", "http(s)"),
]


@pytest.mark.parametrize("source,field,fragment", ANTHROPIC_CASES,
                         ids=["base64", "gif", "truncated", "no-media-type", "pixel-bomb",
                              "remote-url-off", "ftp-url"])
def test_anthropic_bad_images_are_400s_naming_the_field(vl_url, source, field, fragment):
    anthropic_error(anthropic_message(vl_url, source), f"{PART}.{field}", fragment)


def test_images_only_in_user_messages(vl_url):
    openai_error(openai_chat(vl_url, data_url(RED), role="assistant"), "messages.0.content",
                 "user messages only")
    anthropic_error(anthropic_message(vl_url, {"type": "base64", "media_type": "image/png",
                                               "data": b64(RED)}, role="assistant"),
                    PART, "user messages only")


def test_placeholder_in_the_text_is_refused(vl_url):
    openai_error(openai_chat(vl_url, data_url(RED), text="<|image_pad|>"), "messages",
                 "placeholder")


def test_unknown_part_type_and_missing_url(vl_url):
    reply = httpx.post(vl_url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]})
    openai_error(reply, "messages.0.content.0", "'text', 'image_url'")
    reply = httpx.post(vl_url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})
    openai_error(reply, "messages.0.content.0.image_url.url", "Missing")


def test_the_server_keeps_serving_after_bad_images(vl_url, vl_engine):
    for url, _, _ in OPENAI_CASES:
        openai_chat(vl_url, url)
    reply = openai_chat(vl_url, data_url(RED))
    assert reply.status_code == 200, reply.text
    assert len(vl_engine.calls[-1][1]) == 1


def test_text_only_model_refuses_images(server):
    """The tiny llama has no vision tower (its engine has no `vision`)."""
    openai_error(openai_chat(server.url, data_url(RED)), f"{PART}.image_url.url", "text-only")
    anthropic_error(anthropic_message(server.url, {"type": "base64", "media_type": "image/png",
                                                   "data": b64(RED)}),
                    f"{PART}.source.data", "text-only")
    count = httpx.post(server.url + "/v1/messages/count_tokens", timeout=60, json={
        "messages": [{"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": b64(RED)}}]}]})
    anthropic_error(count, "messages.0.content.0.source.data", "text-only")


@pytest.fixture(scope="module")
def image_host():
    """A loopback HTTP server: /red.png (served as image/png), /to-file (a redirect to a
    file: URL), /trickle (slow bytes), anything else 404."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/red.png":
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(RED)))
                self.end_headers()
                self.wfile.write(RED)
            elif self.path == "/to-file":
                self.send_response(302)
                self.send_header("Location", "file:///etc/passwd")
                self.end_headers()
            elif self.path == "/trickle":   # a byte every 0.1 s, never too slow per read
                self.send_response(200)
                self.end_headers()
                for byte in RED[:40]:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    time.sleep(0.1)
            else:
                self.send_error(404)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_allow_image_urls_fetches(vl_engine, vl_loaded, image_host, vl_url):
    import hashlib

    openai_error(openai_chat(vl_url, image_host + "/red.png"), f"{PART}.image_url.url",
                 "--allow-image-urls")    # off by default
    thread = serve_vl(vl_engine, vl_loaded, allow_image_urls=True)
    try:
        reply = openai_chat(thread.url, image_host + "/red.png")
        assert reply.status_code == 200, reply.text
        image = vl_engine.calls[-1][1][0]
        assert image.digest == hashlib.sha256(RED).hexdigest()
        assert image.grid_thw == (1, 16, 16)
        anthropic = anthropic_message(thread.url, {"type": "url", "url": image_host + "/red.png"})
        assert anthropic.status_code == 200, anthropic.text
        openai_error(openai_chat(thread.url, image_host + "/missing.png"),
                     f"{PART}.image_url.url", "HTTP 404")
    finally:
        thread.stop()


def test_fetch_limits(image_host):
    from freetoken.server.image_fetch import ImageFetchError, fetch_image
    from freetoken.vision.decode import ImageTooLarge

    assert fetch_image(image_host + "/red.png", len(RED)) == (RED, "image/png")
    with pytest.raises(ImageTooLarge, match="limit is 100"):
        fetch_image(image_host + "/red.png", 100)           # by Content-Length
    with pytest.raises(ImageFetchError, match="file:"):
        fetch_image(image_host + "/to-file", len(RED))
    start = time.perf_counter()
    with pytest.raises(ImageFetchError, match="longer than 1 s"):
        fetch_image(image_host + "/trickle", len(RED), timeout_s=1.0)
    assert time.perf_counter() - start < 2.5


def test_image_flags_are_checked_against_the_model(vl_engine):
    from freetoken.server.config import ServerConfig
    from freetoken.server.images import image_flags_problem

    vision = vl_engine.vision
    assert image_flags_problem(vision, ServerConfig(), "m") is None
    assert image_flags_problem(vision, ServerConfig(max_image_pixels=vision.min_pixels,
                                                    allow_image_urls=True), "m") is None
    low = image_flags_problem(vision, ServerConfig(max_image_pixels=1000), "m")
    assert "--max-image-pixels 1000" in low and "min_pixels" in low
    text_only = image_flags_problem(None, ServerConfig(allow_image_urls=True), "m")
    assert "--allow-image-urls" in text_only and "text-only" in text_only
    assert image_flags_problem(None, ServerConfig(), "m") is None


def test_serve_image_flags_parse(monkeypatch, tmp_path):
    import freetoken.cli.serve as serve
    from freetoken.cli.main import main

    seen = []
    monkeypatch.setattr(serve, "run_server", lambda path, dtype, engine, server, *rest:
                        seen.append(server))
    result = CliRunner().invoke(main, ["serve", "--model", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert seen[-1].allow_image_urls is False and seen[-1].max_image_pixels is None
    result = CliRunner().invoke(main, ["serve", "--model", str(tmp_path), "--allow-image-urls",
                                       "--max-image-pixels", "1000000"])
    assert result.exit_code == 0, result.output
    assert seen[-1].allow_image_urls is True and seen[-1].max_image_pixels == 1_000_000
    bad = CliRunner().invoke(main, ["serve", "--max-image-pixels", "0"])
    assert bad.exit_code == 2 and "--max-image-pixels" in bad.output


def test_image_flags_on_a_text_only_folder_are_refused_before_loading(monkeypatch, tmp_path,
                                                                      vl_dir):
    import json

    import freetoken.cli.serve as serve
    from freetoken.cli.main import main
    from freetoken.models.checkpoint.vision_config import source_has_vision

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(serve, "load_engine", no_load)
    for flags in (["--allow-image-urls"], ["--max-image-pixels", "1000000"]):
        result = CliRunner().invoke(main, ["serve", "--model", str(vl_dir), *flags])
        assert result.exit_code == 1, result.output
        assert flags[0] in result.output and "text-only" in result.output
        assert vl_dir.name in result.output
    default = CliRunner().invoke(main, ["serve", "--allow-image-urls"])   # nothing fetched
    assert default.exit_code == 1 and "SmolLM2-135M-Instruct" in default.output
    vision = tmp_path / "vision"
    vision.mkdir()
    (vision / "config.json").write_text(json.dumps({"vision_config": {}}))
    assert source_has_vision(str(vl_dir)) is False and source_has_vision(None) is False
    assert source_has_vision(str(vision)) is True
    assert source_has_vision(str(tmp_path / "missing")) is None   # the load reports it
