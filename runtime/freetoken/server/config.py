"""HTTP front-end settings (a leaf module: the CLI reads defaults here without loading torch)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 1919


@dataclass(frozen=True)
class ServerConfig:
    """host/port to bind (port 0 = any free port), an optional API key required on /v1/*,
    the model id clients see (None = the loaded model's name), the default and cap of a
    request's max_tokens (None = up to the context), the origins browsers may call from,
    whether image parts may name http(s) URLs to fetch, the resized area an image may
    take (None = the model's max_pixels), and the seconds a shutdown (SIGTERM, Ctrl-C) lets
    running requests finish after it stops admitting new ones."""

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    api_key: str | None = None
    served_model_name: str | None = None
    log_level: str = "info"
    max_output_tokens: int | None = None
    cors_origins: tuple[str, ...] = ()
    allow_image_urls: bool = False
    max_image_pixels: int | None = None
    shutdown_timeout_s: float = 5.0

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"
