"""What the proxy reads from a client's HTTP request, once: its JSON body (strictly,
:mod:`proxy.openai.bodies`), its API key and its class; :func:`read_request` gives
the :class:`~proxy.openai.request.ChatRequest` the rest of the request path works
from."""

from __future__ import annotations

from fastapi import Request

from proxy.api.auth import bearer_token, find_key, may_override, unauthorized
from proxy.config import ApiKey, Settings
from proxy.openai.bodies import BodyError, check_completion, parse_json
from proxy.openai.errors import APIError, bad_request
from proxy.openai.request import ChatRequest, Json, describe
from proxy.scheduler import TrafficClass

CLASS_HEADER = "x-whoseturn-class"


async def read_json(request: Request) -> Json:
    """The body as a JSON object: 415 unless it is declared JSON, 400 for what
    :func:`proxy.openai.bodies.parse_json` refuses."""
    media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media != "application/json":
        raise APIError(
            415,
            "The request body must be JSON (Content-Type: application/json).",
            code="unsupported_media_type",
        )
    try:
        body = parse_json(await request.body())
    except BodyError as exc:
        raise bad_request(exc.message, param=exc.param) from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    return body


def read_completion(body: Json, path: str) -> Json:
    """``body`` checked as a request to the completion route ``path`` (400 if not)."""
    try:
        return check_completion(body, chat=path.endswith("/chat/completions"))
    except BodyError as exc:
        raise bad_request(exc.message, param=exc.param) from None


def api_key(request: Request) -> str | None:
    """The request's bearer token, if it has one."""
    return bearer_token(request.headers.raw)


def check_api_key(request: Request, settings: Settings) -> ApiKey | None:
    """The caller's key (401 if keys are set and it has none of them)."""
    if not settings.api_keys:
        return None
    key = find_key(settings, api_key(request))
    if key is None:
        raise unauthorized()
    return key


def traffic_class(request: Request, default: TrafficClass, settings: Settings) -> TrafficClass:
    """The route's class, or the one ``X-Whoseturn-Class`` asks for where allowed;
    403 for a class the caller's key may not use."""
    key = check_api_key(request, settings)
    cls = default
    wanted = request.headers.get(CLASS_HEADER)
    if wanted is not None:
        cls = _wanted_class(wanted)
        if not may_override(settings, api_key(request), key):
            raise APIError(
                403, "This API key may not set X-Whoseturn-Class.", err_type="permission_error"
            )
    if key is not None and cls.value not in key.classes:
        raise APIError(
            403, f"This API key may not use the {cls.value} class.", err_type="permission_error"
        )
    return cls


def _wanted_class(wanted: str) -> TrafficClass:
    try:
        return TrafficClass(wanted.strip().lower())
    except ValueError:
        names = [c.value for c in TrafficClass]
        raise bad_request(f"X-Whoseturn-Class must be one of {names}.") from None


async def read_request(
    request: Request, path: str, default: TrafficClass, settings: Settings
) -> ChatRequest:
    """Read and check the client's request (400/403 on what is wrong with it)."""
    body = read_completion(await read_json(request), path)
    return describe(body, path, traffic_class(request, default, settings))
