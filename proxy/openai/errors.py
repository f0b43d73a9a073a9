"""OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``, and the
errors that the HTTP edge and the batch runner both give. FastAPI's exception
handlers that answer them are the edge's (:mod:`proxy.api.error_handlers`).

``code`` is a string naming the condition (``model_not_found``,
``engine_unavailable``, ...) or ``None``, as in OpenAI's own errors: never the HTTP
status, which a client already has, so that one check (``error.code == "..."``)
reads every error the proxy answers. An engine's own error answer is relayed as the
engine wrote it (vLLM's ``code`` is its HTTP status); that is the engine's, not the
proxy's."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

MODELS_LISTED = 50
"""The most model names a "does not exist" message lists; the rest are counted
(``GET /v1/models`` lists them all)."""


class APIError(Exception):
    """An error the proxy answers itself, with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        err_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
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


def model_not_found(model: str, served: list[str]) -> APIError:
    """404 for ``model``, naming the models that are ``served`` so that the client
    can correct the name without another request."""
    message = f"The model `{model}` does not exist. {models_served(served)}"
    return APIError(404, message, param="model", code="model_not_found")


def models_served(served: list[str]) -> str:
    """``served`` as a sentence for an error message: at most :data:`MODELS_LISTED`
    names, the rest counted."""
    if not served:
        return "No engine serves any model."
    names = ", ".join(served[:MODELS_LISTED])
    more = len(served) - MODELS_LISTED
    if more > 0:
        names += f" and {more} more (GET /v1/models lists them)"
    return f"Models served: {names}."


def engine_unavailable(
    message: str, retry_after_s: int | None = None, code: str = "engine_unavailable"
) -> APIError:
    """503: the proxy cannot reach an engine for the request now (``code`` says why
    when another reason than the engines': ``shutting_down``)."""
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return APIError(503, message, err_type="service_unavailable", code=code, headers=headers)


def engine_failed(message: str) -> APIError:
    """502: the engine failed in the middle of an answer the proxy was assembling."""
    return APIError(502, message, err_type="engine_error", code="engine_failed")
