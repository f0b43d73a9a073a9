"""What the proxy reads from a client's HTTP request, once: its JSON body (strictly,
:mod:`proxy.openai.bodies`) and its class (by the route, the class header and the
caller's key, as :mod:`proxy.api.auth` found it); :func:`read_request` gives the
:class:`~proxy.openai.request.ChatRequest` the rest of the request path works from,
for the caller's tenant."""

from __future__ import annotations

from fastapi import Request

from proxy.api.auth import Caller, no_class
from proxy.openai.bodies import BodyError, check_completion, parse_object
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
    return parse_object(await request.body())


def read_completion(body: Json, path: str) -> Json:
    """``body`` checked as a request to the completion route ``path`` (400 if not)."""
    try:
        return check_completion(body, chat=path.endswith("/chat/completions"))
    except BodyError as exc:
        raise bad_request(exc.message, param=exc.param) from None


def traffic_class(request: Request, default: TrafficClass, caller: Caller) -> TrafficClass:
    """The route's class, or the one ``X-Whoseturn-Class`` asks for where the caller
    may choose; 403 for a class the caller's key may not use."""
    key = caller.key
    cls = default
    wanted = request.headers.get(CLASS_HEADER)
    if wanted is not None:
        cls = _wanted_class(wanted)
        if not caller.may_override:
            raise APIError(
                403, "This API key may not set X-Whoseturn-Class.", err_type="permission_error"
            )
    if key is not None and cls.value not in key.classes:
        raise no_class(cls.value)
    return cls


def _wanted_class(wanted: str) -> TrafficClass:
    try:
        return TrafficClass(wanted.strip().lower())
    except ValueError:
        names = [c.value for c in TrafficClass]
        raise bad_request(f"X-Whoseturn-Class must be one of {names}.") from None


async def read_request(
    request: Request, path: str, default: TrafficClass, caller: Caller
) -> ChatRequest:
    """Read and check the client's request (400/403 on what is wrong with it)."""
    body = read_completion(await read_json(request), path)
    cls = traffic_class(request, default, caller)
    return describe(body, path, cls, tenant=caller.tenant)
