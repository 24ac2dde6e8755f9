"""A server over a tiny random llama given one model family's chat template
(tests/agent/templates.py), for tests of tool calls and thinking through the routes."""

from __future__ import annotations

import contextlib

from tests.agent.templates import write_family


def serve(tmp_path_factory, family: str):
    """(server thread, engine, loaded model) on a free loopback port; the caller stops both."""
    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import Engine
    from freetoken.models.loader import load_model
    from freetoken.server.app import create_app
    from freetoken.server.launch import ServerThread

    directory = tmp_path_factory.mktemp(family)
    write_family(directory, family)
    loaded = load_model(str(directory), device="cpu")
    engine = Engine.from_loaded(loaded, EngineConfig(num_tokens=4096, block_size=16,
                                                     max_num_seqs=4, device="cpu")).start()
    thread = ServerThread(create_app(engine, loaded.tokenizer, loaded.name)).start()
    return thread, engine, loaded


@contextlib.contextmanager
def family_server(tmp_path_factory, family: str):
    """Yields (url, loaded model) of serve()'s server; both stop after."""
    thread, engine, loaded = serve(tmp_path_factory, family)
    try:
        yield thread.url, loaded
    finally:
        thread.stop()
        engine.shutdown()
