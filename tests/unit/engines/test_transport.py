"""The plain HTTP/1.1 transport, against real sockets: a scripted server per test.

Each test runs on asyncio's own loop and on uvloop (the proxy's, under uvicorn):
their transports differ in type and timing.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
import httpx
import pytest

from proxy.config import EngineConfig, Settings
from proxy.engines import (
    EngineClient,
    EngineUnavailable,
    engine_transport,
    make_http_client,
    raw_chunks,
)
from proxy.engines._transport import PlainHTTPTransport

Handler = Callable[["Peer"], Awaitable[None]]


@pytest.fixture(
    params=[
        pytest.param(("asyncio", {"use_uvloop": False}), id="asyncio"),
        pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> object:
    return request.param


@dataclass
class Server:
    """A TCP server whose every connection runs ``handler``; what it saw."""

    port: int = 0
    connections: int = 0
    requests: list[tuple[bytes, dict[bytes, bytes], bytes]] = field(default_factory=list)
    closed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def read_request(self, reader: asyncio.StreamReader) -> bool:
        """Read one request (head and Content-Length body); False at EOF."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return False
        first, *lines = head[:-4].split(b"\r\n")
        headers = {k.strip().lower(): v.strip() for k, v in (x.split(b":", 1) for x in lines)}
        body = await reader.readexactly(int(headers.get(b"content-length", b"0")))
        self.requests.append((first, headers, body))
        return True


@dataclass
class Peer:
    """The server's side of one connection."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    server: Server

    async def request(self) -> bool:
        return await self.server.read_request(self.reader)


def answer_once(data: bytes, *, then_wait: bool = False) -> Handler:
    """A handler that reads one request, writes ``data`` (maybe nothing), then closes
    the connection, or with ``then_wait`` waits for the client to close it."""

    async def handler(peer: Peer) -> None:
        await peer.request()
        peer.writer.write(data)
        await peer.writer.drain()
        if then_wait:
            await peer.reader.read()

    return handler


@asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[Server]:
    server = Server()

    async def run(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        server.connections += 1
        try:
            await handler(Peer(reader, writer, server))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    listener = await asyncio.start_server(run, "127.0.0.1", 0)
    server.port = listener.sockets[0].getsockname()[1]
    try:
        yield server
    finally:
        listener.close()


@asynccontextmanager
async def client(
    fallback: httpx.AsyncBaseTransport | None = None,
) -> AsyncIterator[httpx.AsyncClient]:
    transport = PlainHTTPTransport(fallback or httpx.AsyncHTTPTransport())
    async with httpx.AsyncClient(transport=transport, timeout=5) as http:
        yield http


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def keep_answering(peer: Peer) -> None:
    while await peer.request():
        body = b"hello " + peer.server.requests[-1][2]
        peer.writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        await peer.writer.drain()


@pytest.mark.anyio
async def test_a_request_and_its_answer_cross_whole_and_the_connection_is_reused() -> None:
    prompt = b"x" * 100_000
    async with serving(keep_answering) as server, client() as http:
        first = await http.post(server.url + "/v1/echo?a=1", content=prompt)
        second = await http.post(server.url + "/v1/echo", content=b"again")
    assert first.status_code == 200 and first.content == b"hello " + prompt
    assert first.http_version == "HTTP/1.1" and first.reason_phrase == "OK"
    assert second.content == b"hello again"
    assert server.connections == 1
    line, headers, _ = server.requests[0]
    assert line == b"POST /v1/echo?a=1 HTTP/1.1"
    assert headers[b"host"] == f"127.0.0.1:{server.port}".encode()
    assert headers[b"content-length"] == b"100000"


@pytest.mark.anyio
async def test_a_chunked_stream_is_read_as_it_is_sent() -> None:
    """Each chunk reaches the reader before the server sends the next."""
    proceed = asyncio.Event()

    async def stream(peer: Peer) -> None:
        await peer.request()
        peer.writer.write(
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + chunk(b"data: 1\n\n")
        )
        await proceed.wait()
        peer.writer.write(chunk(b"data: 2\n\n") + b"0\r\n\r\n")
        await peer.request()  # keep the connection open

    received = []
    async with (
        serving(stream) as server,
        client() as http,
        http.stream("POST", server.url + "/v1/x", content=b"{}") as response,
    ):
        async for data in response.aiter_raw():
            received.append(data)
            proceed.set()
    assert received == [b"data: 1\n\n", b"data: 2\n\n"]


@pytest.mark.anyio
async def test_closing_a_response_before_its_end_closes_the_connection() -> None:
    """The engine sees the disconnect (and aborts the request); the connection is
    not reused."""

    async def endless(peer: Peer) -> None:
        await peer.request()
        peer.writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        while True:
            peer.writer.write(chunk(b"data: token\n\n"))
            await peer.writer.drain()
            if peer.reader.at_eof():
                peer.server.closed.set()
                return
            await asyncio.sleep(0.01)

    async with serving(endless) as server, client() as http:
        async with http.stream("POST", server.url + "/v1/x", content=b"{}") as response:
            async for _ in response.aiter_raw():
                break
        with anyio.fail_after(5):
            await server.closed.wait()
        async with http.stream("POST", server.url + "/v1/x", content=b"{}") as response:
            async for _ in response.aiter_raw():
                break
    assert server.connections == 2


@pytest.mark.anyio
async def test_an_engine_that_dies_mid_body_is_a_protocol_error() -> None:
    async def dies(peer: Peer) -> None:
        await peer.request()
        peer.writer.write(
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + chunk(b"data: 1\n\n")
        )
        await peer.writer.drain()

    received = []
    async with (
        serving(dies) as server,
        client() as http,
        http.stream("POST", server.url + "/v1/x", content=b"{}") as response,
    ):
        with pytest.raises(httpx.RemoteProtocolError, match="complete message body"):
            async for data in response.aiter_raw():
                received.append(data)
    assert received == [b"data: 1\n\n"]


@pytest.mark.anyio
async def test_an_engine_that_closes_without_answering_is_a_protocol_error() -> None:
    async with serving(answer_once(b"")) as server, client() as http:
        with pytest.raises(httpx.RemoteProtocolError, match="without sending a response"):
            await http.get(server.url + "/health")


@pytest.mark.anyio
async def test_an_answer_that_is_not_http_is_a_protocol_error() -> None:
    garbage = answer_once(b"SSH-2.0-OpenSSH_9.6\r\n\r\n", then_wait=True)
    async with serving(garbage) as server, client() as http:
        with pytest.raises(httpx.RemoteProtocolError, match=r"not HTTP/1\.1"):
            await http.get(server.url + "/health")


@pytest.mark.anyio
async def test_a_body_delimited_by_the_connections_end_is_whole() -> None:
    until_close = answer_once(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it")
    async with serving(until_close) as server, client() as http:
        first = await http.get(server.url + "/metrics")
        second = await http.get(server.url + "/metrics")
    assert first.content == second.content == b"all of it"
    assert server.connections == 2


@pytest.mark.anyio
async def test_a_kept_connection_the_engine_closed_meanwhile_is_not_used() -> None:
    # then closed, though it said keep-alive
    one_then_close = answer_once(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
    async with serving(one_then_close) as server, client() as http:
        assert (await http.get(server.url + "/health")).content == b"ok"
        await asyncio.sleep(0.1)  # the close arrives
        assert (await http.get(server.url + "/health")).content == b"ok"
    assert server.connections == 2


def answer_once_then_drop_the_next() -> Handler:
    """Keep-alive for one answer; then the next request arrives as the engine closes
    the idle connection: read, and closed with no byte of answer."""

    async def handler(peer: Peer) -> None:
        if peer.server.connections == 1:
            await peer.request()
            peer.writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await peer.writer.drain()
            await peer.request()
            return  # closed without an answer
        await keep_answering(peer)

    return handler


@pytest.mark.anyio
async def test_a_request_lost_as_the_engine_closes_a_kept_connection_is_sent_again() -> None:
    async with serving(answer_once_then_drop_the_next()) as server, client() as http:
        assert (await http.get(server.url + "/health")).content == b"ok"
        second = await http.post(server.url + "/v1/x", content=b"again")
        assert second.content == b"hello again"
    assert server.connections == 2
    assert [r[2] for r in server.requests] == [b"", b"again", b"again"]


@pytest.mark.anyio
async def test_a_new_connection_closed_without_an_answer_is_not_tried_again() -> None:
    async with serving(answer_once(b"")) as server, client() as http:
        with pytest.raises(httpx.RemoteProtocolError):
            await http.post(server.url + "/v1/x", content=b"once")
    assert server.connections == 1


@pytest.mark.anyio
async def test_a_connection_idle_past_the_expiry_is_not_used_again() -> None:
    async with serving(keep_answering) as server:
        transport = PlainHTTPTransport(httpx.AsyncHTTPTransport(), idle_expiry_s=0.2)
        async with httpx.AsyncClient(transport=transport, timeout=5) as http:
            await http.get(server.url + "/a")
            await http.get(server.url + "/b")  # reused at once
            assert server.connections == 1
            await asyncio.sleep(0.3)
            await http.get(server.url + "/c")
    assert server.connections == 2


@pytest.mark.anyio
async def test_a_refused_connection_is_a_connect_error() -> None:
    async with serving(keep_answering) as server:
        url = server.url
    async with client() as http:
        with pytest.raises(httpx.ConnectError):
            await http.get(url + "/health")


@pytest.mark.anyio
async def test_silence_past_the_read_timeout_is_a_read_timeout() -> None:
    async with serving(answer_once(b"", then_wait=True)) as server, client() as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.get(server.url + "/health", timeout=httpx.Timeout(5, read=0.2))


@pytest.mark.anyio
async def test_a_large_body_crosses_whole_while_the_reader_is_slow() -> None:
    """More than the high-water mark unread: reading pauses and resumes, nothing is
    lost or reordered."""
    payload = bytes(range(256)) * 40_000  # 10 MB

    async def big(peer: Peer) -> None:
        await peer.request()
        peer.writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(payload))
        for i in range(0, len(payload), 65536):
            peer.writer.write(payload[i : i + 65536])
            await peer.writer.drain()
        await peer.request()

    async with (
        serving(big) as server,
        client() as http,
        http.stream("GET", server.url + "/big") as response,
    ):
        await asyncio.sleep(0.2)  # let the backlog build
        parts = [data async for data in response.aiter_raw()]
    assert b"".join(parts) == payload


@pytest.mark.anyio
async def test_a_request_the_engine_does_not_read_is_a_write_timeout() -> None:
    async def deaf(peer: Peer) -> None:
        await asyncio.sleep(10)

    async with serving(deaf) as server, client() as http:
        with pytest.raises(httpx.WriteTimeout):
            await http.post(
                server.url + "/v1/x", content=b"x" * 64_000_000, timeout=httpx.Timeout(5, write=0.3)
            )


@pytest.mark.anyio
async def test_https_and_head_go_to_the_fallback() -> None:
    seen: list[str] = []

    def fallback(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.method} {request.url}")
        return httpx.Response(204)

    async with serving(keep_answering) as server, client(httpx.MockTransport(fallback)) as http:
        assert (await http.get("https://engine.test/health")).status_code == 204
        assert (await http.head(server.url + "/health")).status_code == 204
    assert seen == ["GET https://engine.test/health", f"HEAD {server.url}/health"]
    assert server.connections == 0


async def answer_events(peer: Peer) -> None:
    """Answer each request with a short event stream, chunked, as vLLM does."""
    while await peer.request():
        events = [b'data: {"n":1}\n\n', b"data: [DONE]\n\n"]
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        head += b"transfer-encoding: chunked\r\n\r\n"
        peer.writer.write(head + b"".join(chunk(e) for e in events) + b"0\r\n\r\n")
        await peer.writer.drain()


@pytest.mark.anyio
async def test_a_streamed_request_written_as_bytes_is_the_one_httpx_would_send() -> None:
    """The engine client writes a streamed request onto the plain transport itself
    (its head made once); the engine gets what the client's own path sends, and the
    answer reads the same, on one kept connection."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "é" * 3000}]}
    async with serving(answer_events) as server:
        config = EngineConfig(url=server.url, name="a")
        settings = Settings.from_keys(engines=(config,))
        transport = engine_transport(settings)
        elsewhere = httpx.MockTransport(lambda request: httpx.Response(599))
        async with (
            make_http_client(settings, transport) as http,
            make_http_client(settings, elsewhere) as other,
        ):
            via_httpx = EngineClient(config, http)
            # its client answers 599: only bytes written onto ``transport`` reach the engine
            direct = EngineClient(config, other, direct=transport)
            answers = []
            for engine in (via_httpx, direct, direct):
                async with engine.stream("/v1/chat/completions", body) as response:
                    assert response.status_code == 200
                    assert response.headers["content-type"] == "text/event-stream"
                    answers.append(b"".join([c async for c in raw_chunks(response)]))
    assert answers[0] == answers[1] == answers[2] == b'data: {"n":1}\n\ndata: [DONE]\n\n'
    assert server.connections == 1  # the direct requests took the connection httpx's left
    (line, headers, sent), *others = server.requests
    assert line == b"POST /v1/chat/completions HTTP/1.1"
    assert json.loads(sent) == body
    assert headers[b"host"] == f"127.0.0.1:{server.port}".encode()
    assert headers[b"content-type"] == b"application/json"
    assert headers[b"accept-encoding"] == b"identity"
    assert [(line, headers, sent)] * 2 == others


@pytest.mark.anyio
async def test_a_direct_request_to_a_refused_port_is_the_engines_connect_error() -> None:
    async with serving(answer_events) as server:
        port = server.port
    config = EngineConfig(url=f"http://127.0.0.1:{port}", name="a")
    settings = Settings.from_keys(engines=(config,))
    transport = engine_transport(settings)
    async with make_http_client(settings, transport) as http:
        engine = EngineClient(config, http, direct=transport)
        with pytest.raises(EngineUnavailable):
            async with engine.stream("/v1/chat/completions", {"model": "tiny"}):
                pass
