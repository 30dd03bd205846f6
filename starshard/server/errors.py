"""Every HTTP error as OpenAI's error object: ApiError for the routes to raise, the backend's
exceptions mapped to statuses, and the handlers that shape FastAPI's own errors (422 -> 400, 404,
405, an unhandled bug -> 500) alike."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from starshard.server import protocol as P
from starshard.server.backend import QueueFull, ServiceUnavailable

log = logging.getLogger("starshard.server")

ROUTES = "POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, GET /metrics"
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    info = P.ErrorInfo(message=message, type=_ERROR_TYPES.get(status, "internal_error"), param=param, code=code)
    return JSONResponse(P.ErrorResponse(error=info).model_dump(), status_code=status, headers=headers)


def backend_error(e: Exception, param: str | None = None) -> ApiError:
    """QueueFull, ServiceUnavailable or ValueError from the backend as an HTTP error."""
    if isinstance(e, QueueFull):
        detail = f" ({e})" if str(e) else ""
        return ApiError(429, f"the server is busy: its queue is full{detail}; retry later",
                        code="queue_full", headers={"Retry-After": "1"})
    if isinstance(e, ServiceUnavailable):
        return ApiError(503, f"the engine is unavailable: {e or 'no reason given'}", code="engine_unavailable")
    return ApiError(400, str(e), param=param)  # ValueError: the backend's message names the limit


# A failed generation's TokenEvent.error_code -> (status, OpenAI error code, Retry-After seconds or None). The
# request failed alone (the others and the server go on), so out of memory and a timeout are worth a retry.
GENERATION_ERRORS = {
    "insufficient_memory": (503, "insufficient_memory", "1"),
    "timeout": (503, "request_timeout", None),
    "rejected": (400, "invalid_request", None),
    "unavailable": (503, "engine_unavailable", None),
}


def generation_error(message: str, code: str | None) -> ApiError:
    """A generation that the engine ended with an error (before its first token) as an HTTP error:
    503 with Retry-After for out of memory, 503 request_timeout, 400 for a refusal, else 503 engine_error."""
    status, api_code, retry = GENERATION_ERRORS.get(code, (503, "engine_error", None))
    return ApiError(status, f"generation failed: {message}", code=api_code,
                    headers={"Retry-After": retry} if retry else None)


def error_info(e: ApiError) -> P.ErrorInfo:
    """The error object of `e`, for a stream that already answered 200."""
    return P.ErrorInfo(message=e.message, type=_ERROR_TYPES.get(e.status, "internal_error"), param=e.param,
                       code=e.code)


def _describe_validation(errors: list[dict]) -> tuple[str, str | None]:
    """A readable message naming the field, and the field, from FastAPI's (pydantic's) errors."""
    first = errors[0]
    if first["type"] == "json_invalid":
        where = first["loc"][1] if len(first["loc"]) > 1 else "?"
        why = first.get("ctx", {}).get("error", "not JSON")
        return f"malformed JSON in the request body ({why} at character {where}): send one JSON object", None
    if not [x for x in first["loc"] if x != "body"]:  # the body as a whole
        if first["type"] == "missing":
            return "the request body is empty: send a JSON object (Content-Type: application/json)", None
        return "the request body must be a JSON object sent with Content-Type: application/json", None

    def one(error: dict) -> str:
        field = ".".join(str(x) for x in error["loc"] if x != "body")
        why = "this field is required" if error["type"] == "missing" else error["msg"].removeprefix("Value error, ")
        return f"invalid field '{field}': {why}"

    shown = "; ".join(one(e) for e in errors[:3])
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return shown + more, str(next(x for x in first["loc"] if x != "body"))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return error_response(e.status, e.message, param=e.param, code=e.code, headers=e.headers)

    @app.exception_handler(RequestValidationError)  # FastAPI would answer 422; OpenAI clients expect 400
    async def _invalid(request: Request, e: RequestValidationError):
        message, param = _describe_validation(list(e.errors()))
        return error_response(400, message, param=param)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, e: HTTPException):
        if e.status_code == 404:
            message = f"no route {request.method} {request.url.path}: this server has {ROUTES}"
        elif e.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}: this server has {ROUTES}"
        else:
            message = str(e.detail)
        return error_response(e.status_code, message, headers=e.headers)

    @app.exception_handler(Exception)
    async def _bug(request: Request, e: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal server error ({type(e).__name__}): see the server log")
