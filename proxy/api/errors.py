"""OpenAI-style error responses: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from proxy.api.methods import allowed_methods


class APIError(Exception):
    """An error the proxy answers itself, with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        err_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.headers = headers or {}
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        merged = {**self.headers, **(headers or {})}
        return JSONResponse(self.body(), status_code=self.status, headers=merged or None)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def model_not_found(model: str) -> APIError:
    return APIError(
        404, f"The model `{model}` does not exist.", param="model", code="model_not_found"
    )


def engine_unavailable(message: str, retry_after_s: int | None = None) -> APIError:
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return APIError(503, message, err_type="service_unavailable", code=503, headers=headers)


def engine_failed(message: str) -> APIError:
    return APIError(502, message, err_type="engine_error", code=502)


_HTTP_TYPES = {404: "not_found_error", 405: "invalid_request_error"}


def from_http_exception(request: Request, exc: HTTPException) -> APIError:
    """Starlette's own errors (no route, wrong method, ...) in OpenAI's shape."""
    path = request.url.path.encode("ascii", "backslashreplace").decode()
    if exc.status_code == 404:
        message = f"No route {request.method} {path}."
    elif exc.status_code == 405:
        message = f"Method {request.method} is not allowed on {path}."
    else:
        message = str(exc.detail)
    err_type = _HTTP_TYPES.get(exc.status_code, "invalid_request_error")
    return APIError(exc.status_code, message, err_type=err_type, code=exc.status_code)


def validation_error(exc: RequestValidationError) -> APIError:
    """FastAPI's 422 (a bad query parameter) in OpenAI's shape, naming the parameter
    and not repeating the input."""
    errors = exc.errors()
    if not errors:
        return APIError(422, "The request is not valid.")
    first = errors[0]
    param = str(first.get("loc", ("",))[-1])
    return APIError(422, f"`{param}`: {first.get('msg', 'not valid')}.", param=param)


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return exc.response()

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        headers = dict(exc.headers or {})
        if exc.status_code == 405:  # every method of the path, not only the route's
            headers["Allow"] = ", ".join(allowed_methods(app.router.routes, request.scope))
        return from_http_exception(request, exc).response(headers)

    async def on_validation(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return validation_error(exc).response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation)
