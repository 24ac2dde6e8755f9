"""Run the app with uvicorn: in the foreground (ft serve) or in a thread (tests, ft shell)."""

from __future__ import annotations

import threading
from typing import Any, Callable


def create_server(app: Any, host: str, port: int, log_level: str = "info",
                  on_ready: Callable[[str], None] | None = None,
                  on_stop: Callable[[], None] | None = None):
    """A uvicorn server that calls on_ready(url) once it listens (port 0 = any free port) and
    on_stop() once it has shut down (before uvicorn re-raises a SIGTERM or SIGINT it caught,
    which ends the process)."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started and on_ready is not None:
                on_ready(self.url)

        async def shutdown(self, sockets=None) -> None:
            await super().shutdown(sockets)
            if on_stop is not None:
                on_stop()

        @property
        def url(self) -> str:
            bound = self.servers[0].sockets[0].getsockname()
            shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
            return f"http://{shown}:{bound[1]}"

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=5, access_log=log_level == "debug")
    return Server(config)


class ServerThread:
    """uvicorn in a daemon thread; `url` is valid after start() returns."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning"):
        self._ready = threading.Event()
        self.url = ""
        self.server = create_server(app, host, port, log_level, on_ready=self._on_ready)
        self._thread = threading.Thread(target=self.server.run, name="freetoken-http",
                                        daemon=True)

    def _on_ready(self, url: str) -> None:
        self.url = url
        self._ready.set()

    def start(self, timeout: float = 60.0) -> ServerThread:
        self._thread.start()
        if not self._ready.wait(timeout) or not self._thread.is_alive():
            raise RuntimeError("the HTTP server did not start; see the log above")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=30)
