"""OpenAI's error JSON, produced in one place for every failure a client can cause.

Every 4xx answer has the body ``{"error": {"message", "type", "param", "code"}}`` that OpenAI
clients parse into their typed exceptions (``openai.BadRequestError`` for 400, ...). Bad input
is always a 4xx: pydantic validation errors, bad JSON, and radixkv's own
:class:`~radixkv.errors.InvalidRequestError` (raised before the engine changes anything) are
caught by the handlers installed with :func:`install_handlers`; a 500 means a bug.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixkv.errors import InvalidRequestError

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "invalid_request_error", 422: "invalid_request_error",
          429: "rate_limit_exceeded", 503: "service_unavailable"}


class APIError(Exception):
    """An error answer with OpenAI's JSON body. ``param`` names the offending request field."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type_: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or _TYPES.get(status, "invalid_request_error" if status < 500
                                        else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def validation_error(exc: RequestValidationError) -> APIError:
    """The 400 for a request body that failed validation, naming the first bad field."""
    errs = exc.errors()
    first = errs[0] if errs else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return APIError(400, "the request body is not valid JSON: "
                        f"{first.get('ctx', {}).get('error', first.get('msg', ''))}",
                        code="invalid_json")
    err = (first.get("ctx") or {}).get("error")
    from radixkv.server.protocol import FieldError

    if isinstance(err, FieldError):   # a request-level check that names its field
        return APIError(400, str(err), param=err.name, code=err.code)
    param = ".".join(loc) or None
    if first.get("type") == "missing":
        msg = f"missing required field {param!r}"
    else:
        msg = f"invalid value for {param!r}: {first.get('msg', 'invalid')}" if param else \
            str(first.get("msg", "invalid request body"))
    if len(errs) > 1:
        msg += f" (and {len(errs) - 1} more error(s))"
    return APIError(400, msg, param=loc[0] if loc else None, code="invalid_value")


def install_handlers(app: FastAPI) -> None:
    """Route every client-caused failure to OpenAI's error JSON."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(InvalidRequestError)
    async def _engine_refused(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return APIError(400, str(exc), code="invalid_request").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response()


__all__ = ["APIError", "install_handlers", "validation_error"]
