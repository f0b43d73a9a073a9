"""Errors of the simulated engine's HTTP API, in vLLM's shape.

Every error body is ``{"error": {"message", "type", "param", "code"}}`` with ``code``
the HTTP status, as vLLM's OpenAI server returns it, so the official ``openai``
client raises the matching class (400 -> ``BadRequestError``, 404 ->
``NotFoundError``). A body that is not JSON or fails validation is a 400, not
FastAPI's 422.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse


class APIError(Exception):
    """An error the API answers with; raised anywhere below a route."""

    def __init__(
        self,
        message: str,
        *,
        status: HTTPStatus = HTTPStatus.BAD_REQUEST,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param

    @property
    def type(self) -> str:
        """vLLM's error type: the status phrase in CamelCase plus ``Error``."""
        return self.status.phrase.replace(" ", "") + "Error"


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(message, param=param)


def model_not_found(name: str) -> APIError:
    return APIError(
        f"The model `{name}` does not exist.", status=HTTPStatus.NOT_FOUND, param="model"
    )


def error_body(error: APIError) -> dict[str, Any]:
    return {
        "error": {
            "message": error.message,
            "type": error.type,
            "param": error.param,
            "code": int(error.status),
        }
    }


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error_body(error), status_code=int(error.status))


def _validation_error(exc: RequestValidationError) -> APIError:
    """The first problem of a failed validation, with the field it is about."""
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return bad_request(f"invalid JSON body: {first.get('msg', '')}")
    param = ".".join(loc) or None
    message = str(first.get("msg", "invalid value"))
    return bad_request(f"{param}: {message}" if param else message, param=param)


async def _api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return error_response(exc)


async def _validation_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return error_response(_validation_error(exc))


def install_error_handlers(app: FastAPI) -> None:
    """Answer :class:`APIError` and validation failures with vLLM's error bodies."""
    app.add_exception_handler(APIError, _api_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_error_handler)
