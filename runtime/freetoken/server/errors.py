"""API errors and their JSON bodies in OpenAI's and Anthropic's shapes."""

from __future__ import annotations

from fastapi.responses import JSONResponse

OPENAI_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
                404: "invalid_request_error", 405: "invalid_request_error",
                500: "server_error", 503: "server_error"}
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                   403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
                   413: "request_too_large", 500: "api_error", 503: "overloaded_error"}


class APIError(Exception):
    """An error reply: HTTP status, a message saying what to fix, the offending parameter."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_body(error: APIError, anthropic: bool) -> dict:
    if anthropic:
        kind = ANTHROPIC_TYPES.get(error.status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": error.message}}
    kind = OPENAI_TYPES.get(error.status, "invalid_request_error" if error.status < 500
                            else "server_error")
    return {"error": {"message": error.message, "type": kind, "param": error.param,
                      "code": error.code}}


def error_response(error: APIError, path: str) -> JSONResponse:
    return JSONResponse(error_body(error, is_anthropic_path(path)), status_code=error.status)
