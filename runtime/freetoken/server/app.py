"""The FastAPI application: routes of every protocol, API-key check, errors, request metrics."""

from __future__ import annotations

import logging
import secrets
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from freetoken.server.context import ServerContext
from freetoken.server.errors import APIError, error_body, error_response, is_anthropic_path
from freetoken.server.metrics import Metrics

logger = logging.getLogger("freetoken.server")

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/messages",
          "/v1/responses", "/v1/stats", "/health", "/metrics", "/openapi.json", "/docs")


def create_app(engine: Any, tokenizer: Any, model_name: str, api_key: str | None = None,
               max_output_tokens: int | None = None,
               cors_origins: tuple[str, ...] = (), allow_image_urls: bool = False,
               max_image_pixels: int | None = None) -> FastAPI:
    """An app serving `engine` as `model_name`; with api_key, /v1/* needs that key;
    max_output_tokens is the default and cap of max_tokens; cors_origins may call it from a
    browser; allow_image_urls lets image parts name http(s) URLs the server fetches;
    max_image_pixels caps the resized area of an image (None: the model's max_pixels).
    /openapi.json and /docs describe it."""
    from freetoken import __version__
    from freetoken.server import anthropic, openai, responses
    from freetoken.server.anthropic_protocol import CountTokensRequest, MessagesRequest
    from freetoken.server.cache_route import create_cache_router
    from freetoken.server.metrics import create_admin_router
    from freetoken.server.openapi import install_openapi
    from freetoken.server.protocol import ChatCompletionRequest, CompletionRequest
    from freetoken.server.responses_protocol import ResponsesRequest

    app = FastAPI(title="FreeToken", version=__version__, docs_url="/docs", redoc_url=None,
                  openapi_url="/openapi.json")
    metrics = Metrics(engine.stats)
    app.state.ctx = ServerContext(engine=engine, tokenizer=tokenizer, model_name=model_name,
                                  metrics=metrics, api_key=api_key or None,
                                  max_output_tokens=max_output_tokens,
                                  allow_image_urls=allow_image_urls,
                                  max_image_pixels=max_image_pixels)
    app.include_router(openai.router)
    app.include_router(anthropic.router)
    app.include_router(responses.router)
    app.include_router(create_admin_router())
    app.include_router(create_cache_router())
    install_openapi(app, {"/v1/chat/completions": ChatCompletionRequest,
                          "/v1/completions": CompletionRequest,
                          "/v1/responses": ResponsesRequest,
                          "/v1/messages": MessagesRequest,
                          "/v1/messages/count_tokens": CountTokensRequest})
    install_error_handlers(app)
    app.add_middleware(GatewayMiddleware, api_key=api_key or None, metrics=metrics)
    if cors_origins:   # outermost, so preflight requests never meet the API-key check
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins),
                           allow_methods=["*"], allow_headers=["*"])
    return app


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {"msg": str(exc), "loc": ()}
        where = ".".join(str(p) for p in first.get("loc", ()))
        return error_response(APIError(400, f"Invalid value for '{where}': {first['msg']}",
                                       where), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(APIError(exc.status_code, message), request.url.path)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(APIError(500, f"internal error: {exc}"), request.url.path)


def is_authorized(headers: dict[bytes, bytes], api_key: str, anthropic: bool) -> bool:
    bearer = headers.get(b"authorization", b"").decode("latin-1")
    offered = bearer[7:].strip() if bearer.lower().startswith("bearer ") else None
    if offered is None and anthropic:
        offered = headers.get(b"x-api-key", b"").decode("latin-1") or None
    return offered is not None and secrets.compare_digest(offered, api_key)


class GatewayMiddleware:
    """Plain ASGI (so streaming and disconnects pass straight through): checks the API key on
    /v1/* and counts every response by route and status."""

    def __init__(self, app, api_key: str | None, metrics: Metrics):
        self.app = app
        self.api_key = api_key
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = next((r for r in ROUTES if path == r or path.startswith(r + "/")), "other")
        status = 500

        async def send_and_record(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if self.api_key and path.startswith("/v1/") and not is_authorized(
                    dict(scope["headers"]), self.api_key, is_anthropic_path(path)):
                await self._unauthorized(path, scope, receive, send_and_record)
            else:
                await self.app(scope, receive, send_and_record)
        finally:
            self.metrics.requests.labels(route, str(status)).inc()

    @staticmethod
    async def _unauthorized(path, scope, receive, send) -> None:
        how = "`Authorization: Bearer <key>`" + (" or `x-api-key: <key>`"
                                                 if is_anthropic_path(path) else "")
        error = APIError(401, f"a valid API key is required: send {how}", None, "invalid_api_key")
        from fastapi.responses import JSONResponse

        response = JSONResponse(error_body(error, is_anthropic_path(path)), status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
