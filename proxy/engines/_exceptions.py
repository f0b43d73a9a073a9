"""The exceptions of the proxy's upstream I/O, and the mapping of httpx's onto them.

Hierarchy::

    UpstreamError              (.engine: the engine's name)
    ├── EngineUnavailable      no response byte came back: connect refused or timed
    │                          out, or the connection closed before the response
    │                          began; the request may be retried on another engine
    ├── EngineHTTPError        the engine answered non-2xx (.status, .body,
    │                          .content_type); 4xx bodies go to clients unchanged
    ├── EngineStreamBroken     the connection was lost, or a read failed or timed out,
    │                          after the response began
    │   └── EngineTimeout      the engine sent nothing for longer than the read
    │                          timeout of the stream's phase (a hung engine)
    └── EngineBadResponse      a 2xx answer the proxy cannot read (bad JSON, wrong
                               shape, unparsable /metrics)

httpx's exceptions never leave :mod:`proxy.engines` except out of
``response.aiter_raw()`` on a stream the caller is reading; map those with
:func:`map_stream_error`.
"""

from __future__ import annotations

import httpx


class UpstreamError(Exception):
    """Something went wrong talking to engine ``engine``."""

    def __init__(self, engine: str, message: str) -> None:
        super().__init__(f"{engine}: {message}")
        self.engine = engine


class EngineUnavailable(UpstreamError):
    """No response byte came back; the request may be retried elsewhere."""


class EngineConnectTimeout(EngineUnavailable):
    """The connection was not made within the connect timeout: the engine is slow to
    accept, or the proxy's own event loop was too busy to see it accept in time. The
    request was not sent."""


class EngineHTTPError(UpstreamError):
    """The engine answered with a non-2xx status."""

    def __init__(self, engine: str, status: int, body: bytes, content_type: str | None) -> None:
        super().__init__(engine, f"HTTP {status}")
        self.status = status
        self.body = body
        self.content_type = content_type


class EngineStreamBroken(UpstreamError):
    """The connection failed after the response began."""


class EngineTimeout(EngineStreamBroken):
    """The engine went silent past a read timeout; it is taken to be hung."""


class EngineBadResponse(UpstreamError):
    """A successful answer whose body the proxy cannot read."""


def describe(exc: BaseException) -> str:
    """``"ConnectError: All connection attempts failed"``, for messages and logs."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def map_request_error(engine: str, exc: httpx.HTTPError) -> UpstreamError:
    """An httpx error raised before the response began."""
    if isinstance(exc, httpx.ConnectTimeout):
        return EngineConnectTimeout(engine, describe(exc))
    return EngineUnavailable(engine, describe(exc))


def map_stream_error(engine: str, exc: Exception) -> UpstreamError:
    """The exception to raise for ``exc``, raised while reading a response body.

    Meant for ``httpx.HTTPError`` out of ``response.aiter_raw()`` (read errors,
    read timeouts, protocol errors, a stream closed under the reader); every such
    error becomes :class:`EngineStreamBroken`. An :class:`UpstreamError` is returned
    as it is. The result has ``exc`` as its ``__cause__``, so a bare
    ``raise map_stream_error(name, exc)`` keeps the chain.
    """
    if isinstance(exc, UpstreamError):
        return exc
    mapped = EngineStreamBroken(engine, describe(exc))
    mapped.__cause__ = exc
    return mapped
