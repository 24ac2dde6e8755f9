"""API errors and their JSON bodies in OpenAI's and Anthropic's shapes."""

from __future__ import annotations

from fastapi.responses import JSONResponse

OPENAI_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
                404: "invalid_request_error", 405: "invalid_request_error",
                500: "server_error", 503: "server_error"}
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                   403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
                   413: "request_too_large", 500: "api_error", 529: "overloaded_error"}
# Anthropic answers "overloaded, retry later" with 529 where OpenAI (and HTTP) use 503.
ANTHROPIC_STATUS = {503: 529}


class APIError(Exception):
    """An error reply: HTTP status, a message saying what to fix, the offending parameter,
    and headers to send with it (Retry-After on a refusal to take the request now)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def status_for(error: APIError, anthropic: bool) -> int:
    return ANTHROPIC_STATUS.get(error.status, error.status) if anthropic else error.status


def error_body(error: APIError, anthropic: bool) -> dict:
    if anthropic:
        kind = ANTHROPIC_TYPES.get(status_for(error, True), "api_error")
        return {"type": "error", "error": {"type": kind, "message": error.message}}
    kind = OPENAI_TYPES.get(error.status, "invalid_request_error" if error.status < 500
                            else "server_error")
    return {"error": {"message": error.message, "type": kind, "param": error.param,
                      "code": error.code}}


def error_response(error: APIError, path: str) -> JSONResponse:
    anthropic = is_anthropic_path(path)
    return JSONResponse(error_body(error, anthropic), status_code=status_for(error, anthropic),
                        headers=error.headers)
