"""FastAPI's exception handlers, answering in OpenAI's error shape
(:class:`~proxy.openai.errors.APIError`): the proxy's own errors, Starlette's (no
route, wrong method) and FastAPI's 422 for a bad query parameter."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from proxy.api.methods import allowed_methods
from proxy.openai.errors import APIError

_HTTP_TYPES = {404: "not_found_error", 405: "invalid_request_error"}
_HTTP_CODES = {404: "route_not_found", 405: "method_not_allowed"}


def from_http_exception(request: Request, exc: HTTPException) -> APIError:
    """Starlette's own errors (no route, wrong method, ...) in OpenAI's shape, with a
    ``code`` that names the condition (a string, never the status)."""
    path = request.url.path.encode("ascii", "backslashreplace").decode()
    if exc.status_code == 404:
        message = f"No route {request.method} {path}."
    elif exc.status_code == 405:
        message = f"Method {request.method} is not allowed on {path}."
    else:
        message = str(exc.detail)
    err_type = _HTTP_TYPES.get(exc.status_code, "invalid_request_error")
    code = _HTTP_CODES.get(exc.status_code)
    return APIError(exc.status_code, message, err_type=err_type, code=code)


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
