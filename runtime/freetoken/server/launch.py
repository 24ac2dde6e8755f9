"""Run the app with uvicorn: in the foreground (ft serve) or in a thread (tests, ft shell)."""

from __future__ import annotations

import threading
from typing import Any, Callable

from freetoken.server.shutdown import begin_shutdown

# Seconds uvicorn waits for open connections when the app's engine is not drained first.
UNDRAINED_TIMEOUT_S = 5.0
# After the grace period the aborted streams still write their error events and close.
CLOSE_SLACK_S = 2.0


def create_server(app: Any, host: str, port: int, log_level: str = "info",
                  on_ready: Callable[[str], None] | None = None,
                  on_stop: Callable[[], None] | None = None,
                  shutdown_timeout_s: float | None = None):
    """A uvicorn server that calls on_ready(url) once it listens (port 0 = any free port) and
    on_stop() once it has shut down (before uvicorn re-raises a SIGTERM or SIGINT it caught,
    which ends the process). With shutdown_timeout_s, shutting down drains the app's engine:
    admission stops at once, requests inside get that many seconds to finish and the rest end
    with an error event (server/shutdown.py). Without it the engine is left as it is (tests
    that share one engine among several servers) and connections still open after
    UNDRAINED_TIMEOUT_S are cut."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started and on_ready is not None:
                on_ready(self.url)

        async def shutdown(self, sockets=None) -> None:
            draining = None
            if shutdown_timeout_s is not None:
                draining = begin_shutdown(app.state.ctx.engine, shutdown_timeout_s)
            await super().shutdown(sockets)
            if draining is not None:
                draining.cancel()   # done, unless every connection closed before the deadline
            if on_stop is not None:
                on_stop()

        @property
        def url(self) -> str:
            bound = self.servers[0].sockets[0].getsockname()
            shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
            return f"http://{shown}:{bound[1]}"

    wait_s = (UNDRAINED_TIMEOUT_S if shutdown_timeout_s is None
              else shutdown_timeout_s + CLOSE_SLACK_S)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=wait_s, access_log=log_level == "debug")
    return Server(config)


class ServerThread:
    """uvicorn in a daemon thread; `url` is valid after start() returns."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning", shutdown_timeout_s: float | None = None):
        self._ready = threading.Event()
        self.url = ""
        self.server = create_server(app, host, port, log_level, on_ready=self._on_ready,
                                    shutdown_timeout_s=shutdown_timeout_s)
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
