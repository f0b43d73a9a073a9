"""OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``, and the
errors that the HTTP edge and the batch runner both give. FastAPI's exception
handlers that answer them are the edge's (:mod:`proxy.api.error_handlers`)."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse


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
