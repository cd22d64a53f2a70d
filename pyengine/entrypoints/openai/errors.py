"""Errors as clients see them: `APIError` in OpenAI's shape (or Anthropic's, on the
routes of its Messages API), the HTTP response it becomes, and the app's exception
handlers, which turn every other failure (a malformed body, an engine that died or whose
step failed, a bug) into one with the status that says why."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from pyengine.engine.async_engine import EngineDeadError, EngineStepError
from pyengine.executor import ExecutorDeadError

logger = logging.getLogger("pyengine")


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.headers = headers or {}  # (429's Retry-After)

    @property
    def type(self) -> str:
        return {
            400: "invalid_request_error",
            401: "authentication_error",
            403: "permission_error",
            404: "not_found_error",
            413: "request_too_large",
            429: "rate_limit_error",
            503: "service_unavailable",
        }.get(self.status, "internal_error")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.status,
            }
        }

    def anthropic_body(self) -> dict[str, Any]:
        """Anthropic's shape: {"type": "error", "error": {"type", "message"}}."""
        kind = {500: "api_error", 503: "overloaded_error"}.get(self.status, self.type)
        return {"type": "error", "error": {"type": kind, "message": self.message}}


# The routes of Anthropic's Messages API, whose clients read its error shape.
ANTHROPIC_PATHS = ("/v1/messages",)


def speaks_anthropic(path: str) -> bool:
    return path.startswith(ANTHROPIC_PATHS)


def error_response(error: APIError, path: str = "") -> Response:
    """The error as the HTTP response a client of the route at `path` gets."""
    body = error.anthropic_body() if speaks_anthropic(path) else error.body()
    # ASCII JSON: a message that quotes the request's text may hold what UTF-8 cannot
    # encode (an unpaired surrogate).
    return Response(
        json.dumps(body), status_code=error.status, media_type="application/json",
        headers=error.headers,
    )  # fmt: skip


def validation_error(error: RequestValidationError) -> APIError:
    """A body that does not parse as the route's model, as a 400 naming each problem and
    the first field at fault."""
    problems = []
    param = None
    for e in error.errors():
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        if e.get("type") == "json_invalid":
            problems.append(f"malformed JSON body ({e.get('msg', '')})")
            continue
        param = param or (loc[0] if loc else None)
        problems.append(f"{'.'.join(loc) or 'body'}: {e.get('msg', 'invalid')}")
    return APIError("; ".join(problems) or "invalid request", status=400, param=param)


def add_exception_handlers(app: FastAPI) -> None:
    """Answers every failure a route raises in OpenAI's error shape: Starlette's own HTTP
    errors (404, 405) with their status, a malformed body 400, an engine that is dead or
    hung 503, a failed engine step 500, and anything else a logged 500."""

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> Response:
        return error_response(APIError(str(error.detail), status=error.status_code), _path(request))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception) -> Response:
        logger.exception("a request failed")
        failure = APIError(f"internal error: {type(error).__name__}", status=500)
        return error_response(failure, _path(request))

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> Response:
        return error_response(error, _path(request))

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, error: RequestValidationError) -> Response:
        return error_response(validation_error(error), _path(request))

    @app.exception_handler(EngineDeadError)
    @app.exception_handler(ExecutorDeadError)
    async def engine_dead(request: Request, error: Exception) -> Response:
        return error_response(APIError(str(error), status=503), _path(request))

    @app.exception_handler(EngineStepError)
    async def step_failed(request: Request, error: Exception) -> Response:
        return error_response(APIError(str(error), status=500), _path(request))


def _path(request: Request) -> str:
    return request.url.path
