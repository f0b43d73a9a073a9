"""Plain HTTP/1.1 to the engines on asyncio's protocols, parsed by httptools.

:class:`PlainHTTPTransport` is an ``httpx`` transport for ``http://`` engines. The
client, its timeouts and its errors stay httpx's; only the connection underneath
changes. httpx's own transport reads a streamed response through httpcore and
h11: per chunk, half a dozen async generators, h11's pure-Python parser and its
state machine. Every token a chat client receives is such a chunk, and that path
was half of the proxy's CPU per relayed event (profile in docs/overhead.md).
Here the engine's bytes arrive in :meth:`_Connection.data_received`, httptools
(C, the parser uvicorn serves with) splits the chunked framing, and the reader
gets each body chunk from a buffer: one future woken per read.

What it does, as httpcore did for the proxy:

- keep-alive: a connection whose response was read to its end goes back to its
  origin's idle list and is reused (newest first); one closed by the engine
  meanwhile, or idle longer than :data:`IDLE_EXPIRY_S` (under the engines' own
  keep-alive timeout, uvicorn's 5 s), is dropped when it is picked; a request sent
  on a kept connection that the engine closed with no byte of answer (it closed the
  idle connection as the request arrived) is sent once more on a new connection;
- a response closed before its end closes its connection at once, so the engine
  sees the disconnect and aborts the request;
- the request's ``timeout`` extension: ``connect`` (:class:`httpx.ConnectTimeout`),
  ``write`` (:class:`httpx.WriteTimeout`, waiting on a full socket) and ``read``
  (:class:`httpx.ReadTimeout`, per wait for the head or a chunk; the proxy's
  streams pass ``None``);
- errors as httpx names them: :class:`httpx.ConnectError` when the connection
  cannot be made, :class:`httpx.RemoteProtocolError` when the engine closes it
  before a whole response or sends something that is not HTTP,
  :class:`httpx.ReadError` when the socket fails;
- flow control both ways: reading pauses while an unread backlog passes
  :data:`HIGH_WATER` bytes, writing waits while the socket's buffer is full.

What it leaves to ``fallback`` (httpx's own pooled transport): ``https://``
engines, and ``HEAD`` (whose response has no body whatever its headers say).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import cast

import httptools
import httpx

HIGH_WATER = 1 << 20
"""Unread body bytes at which a connection stops reading from its socket (it resumes
once the reader has taken the backlog, :meth:`_Connection.take`)."""
MAX_IDLE = 4096
"""Idle keep-alive connections kept per origin; more are closed."""
IDLE_EXPIRY_S = 4.0
"""A kept connection idle longer is not used again: vLLM (uvicorn) closes its idle
connections after 5 s, and a request written as it closes one is lost."""

Origin = tuple[str, int]
BODY_EXTENSION = "whoseturn.body"
"""The response extension holding the body as this transport reads it
(:func:`raw_chunks`)."""


def raw_chunks(response: httpx.Response) -> AsyncIterator[bytes]:
    """``response``'s body as it arrives, like ``response.aiter_raw()``; read straight
    from this transport's connection where the response is one of its own (httpx's
    two wrappers around the stream cost two async generator steps per chunk, that is
    per token), else through httpx."""
    body = response.extensions.get(BODY_EXTENSION)
    if isinstance(body, _ResponseBody) and not response.is_stream_consumed:
        response.is_stream_consumed = True
        return body.__aiter__()
    return response.aiter_raw()


class PlainHTTPTransport(httpx.AsyncBaseTransport):
    """HTTP/1.1 over plain TCP with keep-alive, for ``http://`` URLs (see the module
    docstring); ``fallback`` takes everything else."""

    def __init__(
        self, fallback: httpx.AsyncBaseTransport, idle_expiry_s: float = IDLE_EXPIRY_S
    ) -> None:
        self._fallback = fallback
        self.idle_expiry_s = idle_expiry_s
        self._idle: dict[Origin, list[_Connection]] = {}
        self._open: set[_Connection] = set()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme != "http" or request.method == "HEAD":
            return await self._fallback.handle_async_request(request)
        try:
            body = request.content
        except httpx.RequestNotRead:
            body = b"".join([part async for part in request.stream])  # type: ignore[union-attr]
        timeouts = request.extensions.get("timeout", {})
        return await self.exchange(request, _request_head(request) + body, timeouts)

    async def exchange(
        self, request: httpx.Request, data: bytes, timeouts: dict[str, float | None]
    ) -> httpx.Response:
        """Send ``data``, a whole HTTP/1.1 request as bytes, to the origin of
        ``request`` (an ``http://`` URL, a method other than ``HEAD``), and return the
        response once its head came: what :meth:`handle_async_request` does with the
        bytes it makes of a request. ``request`` names the exchange on the response
        and in errors; ``timeouts`` as httpx's ``timeout`` extension says them.
        A caller that makes the bytes itself (a streamed chat's, whose head is the
        same each time: :class:`~proxy.engines.EngineClient`) spares the making of an
        :class:`httpx.Request` and the client's layers around the send."""
        url = request.url
        origin = (url.host, url.port or 80)
        connection = self._idle_connection(origin)
        if connection is not None:
            try:
                await self._exchange(connection, data, timeouts, request)
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
                if connection.received:
                    raise
                connection = None  # the engine closed it as the request came: once more
        if connection is None:
            connection = await self._connect(origin, timeouts.get("connect"), request)
            await self._exchange(connection, data, timeouts, request)
        stream = _ResponseBody(self, origin, connection, timeouts.get("read"), request)
        return httpx.Response(
            connection.status,
            headers=connection.headers,
            stream=stream,
            request=request,
            extensions={
                "http_version": b"HTTP/1.1",
                "reason_phrase": connection.reason,
                BODY_EXTENSION: stream,
            },
        )

    async def _exchange(
        self,
        connection: _Connection,
        data: bytes,
        timeouts: dict[str, float | None],
        request: httpx.Request,
    ) -> None:
        """Send the request and wait for the head of its answer (closed on failure)."""
        try:
            await connection.send(data, timeouts.get("write"), request)
            await connection.wait_for_head(timeouts.get("read"), request)
        except BaseException:
            connection.close()
            raise

    async def aclose(self) -> None:
        for connection in list(self._open):
            connection.close()
        self._idle.clear()
        await self._fallback.aclose()

    def _idle_connection(self, origin: Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        while idle:
            connection = idle.pop()
            if connection.usable and connection.idle_for() < self.idle_expiry_s:
                return connection
            connection.close()
        return None

    def release(self, origin: Origin, connection: _Connection) -> None:
        """``connection``'s response was read to its end: keep it for the next
        request to ``origin`` if it can take one."""
        idle = self._idle.setdefault(origin, [])
        if connection.reusable and len(idle) < MAX_IDLE:
            connection.reset()
            connection.idle_since = connection.now()
            idle.append(connection)
        else:
            connection.close()

    async def _connect(
        self, origin: Origin, limit_s: float | None, request: httpx.Request
    ) -> _Connection:
        loop = asyncio.get_running_loop()
        host, port = origin
        try:
            async with asyncio.timeout(limit_s):
                _, connection = await loop.create_connection(
                    lambda: _Connection(loop, self._open), host, port
                )
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(
                f"no connection within {limit_s:g} s", request=request
            ) from exc
        except OSError as exc:
            raise httpx.ConnectError(str(exc) or type(exc).__name__, request=request) from exc
        return connection


class _Connection(asyncio.Protocol):
    """One TCP connection to an engine and the response being read on it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, open_set: set[_Connection]) -> None:
        self._loop = loop
        self._open = open_set
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[None] | None = None
        self._drained: asyncio.Future[None] | None = None
        self._write_paused = False
        self._read_paused = False
        self.closed = False
        self.idle_since = 0.0
        # why it closed, when not by us nor by the engine's orderly close
        self.error: httpx.TransportError | None = None
        self.reset()

    def reset(self) -> None:
        """Ready for the next response."""
        self.status = 0
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.complete = False
        self.keep_alive = False
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.received = False  # any byte of this response yet

    def now(self) -> float:
        return self._loop.time()

    def idle_for(self) -> float:
        return self._loop.time() - self.idle_since

    # -- state ---------------------------------------------------------------------

    @property
    def usable(self) -> bool:
        """Open and idle: a request may be sent on it."""
        transport = self._transport
        return not self.closed and transport is not None and not transport.is_closing()

    @property
    def reusable(self) -> bool:
        return self.complete and self.keep_alive and self.usable

    def close(self) -> None:
        if self._transport is not None and not self.closed:
            self._transport.close()
        self._mark_closed()

    # -- what the transport and the body stream await --------------------------------

    async def send(self, data: bytes, limit_s: float | None, request: httpx.Request) -> None:
        if not self.usable:
            raise httpx.RemoteProtocolError(
                "Server disconnected before the request was sent.", request=request
            )
        assert self._transport is not None
        self._transport.write(data)
        while self._write_paused and not self.closed:
            self._drained = self._loop.create_future()
            try:
                async with asyncio.timeout(limit_s):
                    await self._drained
            except TimeoutError as exc:
                raise httpx.WriteTimeout(
                    f"the request was not sent within {limit_s:g} s", request=request
                ) from exc

    async def wait_for_head(self, limit_s: float | None, request: httpx.Request) -> None:
        while not self.head_done:
            if self.closed:
                raise self._lost(request, "Server disconnected without sending a response.")
            await self.wait(limit_s, request)

    async def wait(self, limit_s: float | None, request: httpx.Request) -> None:
        """Until more of the response came, or the connection closed."""
        self._waiter = waiter = self._loop.create_future()
        if limit_s is None:
            await waiter
            return
        try:
            async with asyncio.timeout(limit_s):
                await waiter
        except TimeoutError as exc:
            raise httpx.ReadTimeout(f"nothing read within {limit_s:g} s", request=request) from exc

    def take(self) -> bytes:
        """Every body byte buffered so far, in one piece."""
        chunks = self.chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self.buffered = 0
        if self._read_paused and self._transport is not None:
            self._read_paused = False
            self._transport.resume_reading()
        return data

    def ended(self, request: httpx.Request) -> httpx.HTTPError:
        """The error for a body cut short by the connection's end."""
        return self._lost(request, "peer closed connection without sending complete message body")

    def _lost(self, request: httpx.Request, message: str) -> httpx.HTTPError:
        error = self.error or httpx.RemoteProtocolError(message)
        error.request = request
        return error

    # -- asyncio.Protocol ----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self._open.add(self)

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._fail(httpx.RemoteProtocolError(f"the engine's response is not HTTP/1.1: {exc}"))
            return
        if self.buffered > HIGH_WATER and not self._read_paused and self._transport is not None:
            self._read_paused = True
            self._transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool | None:
        return False  # close the connection

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is not None and self.error is None:
            self.error = httpx.ReadError(str(exc) or type(exc).__name__)
        if self.head_done and not self.complete and self._ends_at_close():
            self.complete = True  # a body delimited by the connection's end
        self._mark_closed()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._wake_drain()

    # -- httptools' callbacks ------------------------------------------------------

    def on_status(self, status: bytes) -> None:
        self.reason += status

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self._parser.should_keep_alive()

    # -- plumbing ------------------------------------------------------------------

    def _ends_at_close(self) -> bool:
        names = {name.lower() for name, _ in self.headers}
        return b"content-length" not in names and b"transfer-encoding" not in names

    def _fail(self, error: httpx.TransportError) -> None:
        self.error = error
        if self._transport is not None:
            self._transport.close()
        self._mark_closed()

    def _mark_closed(self) -> None:
        if not self.closed:
            self.closed = True
            self._open.discard(self)
        self._wake()
        self._wake_drain()

    def _wake(self) -> None:
        _resolve(self._waiter)
        self._waiter = None

    def _wake_drain(self) -> None:
        _resolve(self._drained)
        self._drained = None


@dataclass(eq=False)
class _ResponseBody(httpx.AsyncByteStream):
    """A response's body as it arrives: what is buffered, in one piece per read."""

    transport: PlainHTTPTransport
    origin: Origin
    connection: _Connection
    read_limit_s: float | None
    request: httpx.Request
    closed: bool = field(default=False, init=False)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        connection = self.connection
        while True:
            if connection.chunks:
                yield connection.take()
            elif connection.complete:
                return
            elif connection.closed:
                raise connection.ended(self.request)
            else:
                await connection.wait(self.read_limit_s, self.request)

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        connection = self.connection
        if connection.complete:
            self.transport.release(self.origin, connection)
        else:
            connection.close()


def _resolve(future: asyncio.Future[None] | None) -> None:
    if future is not None and not future.done():
        future.set_result(None)


def _request_head(request: httpx.Request) -> bytes:
    return request_head_lines(request) + b"\r\n"


def request_head_lines(request: httpx.Request) -> bytes:
    """``request``'s request line and header lines, without the blank line that ends
    them."""
    target = request.url.raw_path
    lines = [b"%s %s HTTP/1.1\r\n" % (request.method.encode("ascii"), target)]
    lines += [b"%s: %s\r\n" % pair for pair in request.headers.raw]
    return b"".join(lines)
