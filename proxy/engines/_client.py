"""One engine's HTTP API: its models, health, load, token counts, streamed requests.

Every call goes through the pool's shared :class:`httpx.AsyncClient`. Control
calls (``/v1/models``, ``/health``, ``/metrics``, ``/tokenize``) have a total time
limit; a streamed request's response must begin within the caller's
``first_byte_timeout_s``, and its body has no limit here (an answer may take
minutes: the caller times each read, see :mod:`proxy.api.relay`). All failures
come out as :class:`~proxy.engines.UpstreamError` subclasses (see ``_exceptions``),
except read errors while the caller iterates a stream, which it maps with
:func:`~proxy.engines.map_stream_error`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any, TypeGuard, TypeVar

import anyio
import httpx
import orjson

from proxy.config import EngineConfig
from proxy.engines._exceptions import (
    EngineBadResponse,
    EngineHTTPError,
    EngineUnavailable,
    UpstreamError,
    describe,
    map_request_error,
    map_stream_error,
)
from proxy.engines._metrics import (
    CacheFacts,
    MetricsParseError,
    parse_cache_facts,
    parse_load,
    parse_prefix_cache_hits,
)
from proxy.engines._tokens import DEFAULT_TOKEN_CACHE_SIZE, TokenCountCache, content_key
from proxy.engines._transport import PlainHTTPTransport, request_head_lines
from proxy.scheduler import EngineLoad

logger = logging.getLogger(__name__)
T = TypeVar("T")

CONTROL_TIMEOUT_S = 5.0

Prompt = str | list[int] | list[str] | list[list[int]]
"""A completions ``prompt``: text, token ids, or a batch of either."""


def _is_token_ids(value: object) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


async def close_now(response: httpx.Response) -> None:
    """Close ``response`` even inside a cancelled scope, so the engine sees the hang-up."""
    with anyio.CancelScope(shield=True):
        await response.aclose()


class EngineClient:
    """The HTTP API of the engine ``config`` describes, over the shared ``client``."""

    def __init__(
        self,
        config: EngineConfig,
        client: httpx.AsyncClient,
        *,
        control_timeout_s: float = CONTROL_TIMEOUT_S,
        token_cache_size: int = DEFAULT_TOKEN_CACHE_SIZE,
        direct: PlainHTTPTransport | None = None,
    ) -> None:
        """``direct``: ``client``'s own transport, where it is the plain one; a
        streamed request is then written onto it as bytes (:meth:`stream`)."""
        self.config = config
        self.name = config.name
        self.url = config.url
        self.token_cache = TokenCountCache(token_cache_size)
        self._client = client
        self._control_timeout = self._timeout(control_timeout_s)
        # a streamed request's parts that never change, made once (see _stream_request)
        self._stream_headers = httpx.Headers(client.headers)
        self._stream_headers["Content-Type"] = "application/json"
        self._stream_timeout = client.timeout.as_dict()
        self._urls: dict[str, httpx.URL] = {}
        self._direct = direct
        self._heads: dict[str, tuple[httpx.Request, bytes] | None] = {}

    def __repr__(self) -> str:
        return f"EngineClient(name={self.name!r}, url={self.url!r})"

    # -- control calls -------------------------------------------------------------

    async def models(self) -> list[str]:
        """The ids the engine's ``GET /v1/models`` lists."""
        data = await self._call_json("GET", "/v1/models")
        try:
            return [str(card["id"]) for card in data["data"]]
        except (KeyError, TypeError) as exc:
            raise self._bad("/v1/models", exc) from exc

    async def health(self, timeout_s: float | None = None) -> bool:
        """Whether ``GET /health`` answers 2xx in time (``timeout_s``; default: the
        control calls' limit); never raises."""
        limits = None if timeout_s is None else self._timeout(timeout_s)
        try:
            await self._call("GET", "/health", limits=limits)
        except UpstreamError as exc:
            logger.debug("engine %s: health check failed: %s", self.name, exc)
            return False
        return True

    async def sleep(self, level: int, timeout_s: float) -> None:
        """vLLM's sleep mode: ``POST /sleep?level=N`` (the engine started with
        ``--enable-sleep-mode``; the route served with ``VLLM_SERVER_DEV_MODE=1``)."""
        await self._call("POST", f"/sleep?level={level}", limits=self._timeout(timeout_s))

    async def wake_up(self, timeout_s: float) -> None:
        """``POST /wake_up``: the engine's weights and KV cache back on its card."""
        await self._call("POST", "/wake_up", limits=self._timeout(timeout_s))

    async def is_sleeping(self) -> bool:
        """``GET /is_sleeping``: whether the engine is asleep now."""
        answer = await self._call_json("GET", "/is_sleeping")
        sleeping = answer.get("is_sleeping") if isinstance(answer, dict) else None
        if not isinstance(sleeping, bool):
            raise self._bad("/is_sleeping", ValueError(f"unexpected answer {answer!r}"))
        return sleeping

    async def load(self) -> EngineLoad:
        """The engine's load as its ``GET /metrics`` reports it now."""
        return await self._metrics(parse_load)

    async def cache_facts(self) -> CacheFacts:
        """Prefix caching and block size as the engine's ``GET /metrics`` says."""
        return await self._metrics(parse_cache_facts)

    async def prefix_cache_hits(self) -> float | None:
        """The engine's prefix-cache hits so far, in prompt tokens, as its
        ``GET /metrics`` says (None: it does not export them)."""
        return await self._metrics(parse_prefix_cache_hits)

    async def _metrics(self, parse: Callable[[str], T]) -> T:
        """What ``parse`` reads from the engine's ``GET /metrics`` now."""
        response = await self._call("GET", "/metrics")
        try:
            return parse(response.text)
        except MetricsParseError as exc:
            raise self._bad("/metrics", exc) from exc

    async def token_ids(
        self,
        model: str,
        *,
        prompt: str | None = None,
        messages: list[Any] | None = None,
        timeout_s: float | None = None,
    ) -> list[int]:
        """The token ids ``POST /tokenize`` makes of ``prompt`` or ``messages``
        (exactly one; messages through the engine's chat template); within
        ``timeout_s`` if given (else the control calls' limit)."""
        if (prompt is None) == (messages is None):
            raise ValueError("give exactly one of prompt and messages")
        body = (
            {"model": model, "messages": messages}
            if prompt is None
            else {"model": model, "prompt": prompt}
        )
        limits = None if timeout_s is None else self._timeout(timeout_s)
        response = await self._call("POST", "/tokenize", body, limits)
        try:
            data = response.json()
        except ValueError as exc:
            raise self._bad("/tokenize", exc) from exc
        ids = data.get("tokens") if isinstance(data, dict) else None
        if not _is_token_ids(ids):
            raise EngineBadResponse(self.name, "/tokenize: no token ids in the answer")
        return ids

    async def count_tokens(
        self,
        model: str,
        *,
        prompt: Prompt | None = None,
        messages: list[dict[str, Any]] | None = None,
    ) -> int:
        """The prompt tokens the engine's tokenizer makes of ``prompt`` or ``messages``.

        Exactly one of them. ``prompt`` takes every shape of the completions API:
        a string, token ids, or a list of either (counted as their sum). Token ids
        count as they are, without a call; text and messages are counted by
        ``POST /tokenize`` and cached per (model, content). Raises
        :class:`ValueError` for anything else, before any call.
        """
        if (prompt is None) == (messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if prompt is None:
            if not isinstance(messages, list):
                raise ValueError("messages must be a list")
            return await self._counted(model, "messages", messages)
        if isinstance(prompt, str):
            return await self._counted(model, "prompt", prompt)
        if _is_token_ids(prompt):
            return len(prompt)
        if not isinstance(prompt, list) or not all(
            isinstance(part, str) or _is_token_ids(part) for part in prompt
        ):
            raise ValueError("prompt must be a string, token ids, or a list of either")
        total = 0
        for part in prompt:
            total += (
                len(part) if _is_token_ids(part) else await self._counted(model, "prompt", part)
            )
        return total

    async def _counted(self, model: str, kind: str, content: Any) -> int:
        key = content_key(model, kind, content)
        count = self.token_cache.get(key)
        if count is None:
            count = await self._tokenize({"model": model, kind: content})
            self.token_cache.put(key, count)
        return count

    async def _tokenize(self, body: dict[str, Any]) -> int:
        data = await self._call_json("POST", "/tokenize", body)
        count = data.get("count") if isinstance(data, dict) else None
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            kind = type(data).__name__
            raise EngineBadResponse(self.name, f"/tokenize: no token count in the {kind}")
        return count

    # -- streamed requests ---------------------------------------------------------

    @asynccontextmanager
    async def stream(
        self,
        path: str,
        body: dict[str, Any],
        headers: Mapping[str, str] | None = None,
        first_byte_timeout_s: float | None = None,
    ) -> AsyncIterator[httpx.Response]:
        """``POST`` ``body`` as JSON to ``path`` and yield the open 2xx response.

        Raises :class:`EngineUnavailable` if no response began (within
        ``first_byte_timeout_s``, when given) and
        :class:`EngineHTTPError` (with the whole body) on a non-2xx status. The
        caller reads ``raw_chunks(response)`` (or ``response.aiter_raw()``); httpx
        errors raised there are its to map with :func:`map_stream_error`. On leaving
        the block — normally, by an exception or by cancellation — the response is
        closed at once, so the engine sees the disconnect and aborts the request.
        """
        content = json_bytes(body)
        head = None if headers else self._head(path)
        with anyio.move_on_after(first_byte_timeout_s) as waited:
            if head is None:
                response = await self._send(self._stream_request(path, content, headers))
            else:
                response = await self._send_direct(head, content)
        if waited.cancelled_caught:
            raise EngineUnavailable(self.name, f"no response within {first_byte_timeout_s:g} s")
        try:
            if not response.is_success:
                await self._read(response)
                raise self._http_error(response)
            yield response
        finally:
            await close_now(response)

    # -- plumbing ------------------------------------------------------------------

    def _url(self, path: str) -> httpx.URL:
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = httpx.URL(self.url + path)
        return url

    def _head(self, path: str) -> tuple[httpx.Request, bytes] | None:
        """For a streamed request to ``path`` written straight onto the plain
        transport: the request that names it (in errors, on the response) and the
        bytes of its head up to its length. None: it goes through the client (no
        plain transport, or an ``https://`` engine)."""
        if self._direct is None:
            return None
        if path not in self._heads:
            url = self._url(path)
            named = httpx.Request("POST", url, headers=self._stream_headers)
            del named.headers["Content-Length"]
            head = request_head_lines(named) + b"Content-Length: "
            self._heads[path] = (named, head) if url.scheme == "http" else None
        return self._heads[path]

    async def _send_direct(
        self, head: tuple[httpx.Request, bytes], content: bytes
    ) -> httpx.Response:
        """``content`` POSTed by the plain transport with the head made once: the
        same bytes as :meth:`_stream_request` makes, without an :class:`httpx.Request`
        per request or the client's layers (auth, redirects, cookies, hooks: none
        of which the engines use), a tenth of a one-token request's CPU."""
        assert self._direct is not None
        named, start = head
        data = b"%s%d\r\n\r\n%s" % (start, len(content), content)
        try:
            return await self._direct.exchange(named, data, self._stream_timeout)
        except httpx.HTTPError as exc:
            raise map_request_error(self.name, exc) from exc

    def _stream_request(
        self, path: str, content: bytes, headers: Mapping[str, str] | None
    ) -> httpx.Request:
        """The request :meth:`stream` sends: what ``build_request`` would make (the
        client's headers and timeouts, the engine's URL; the client has no base URL),
        from parts made once per engine and path, without the client's cookie jar (a
        cookie an engine set is not sent on these requests; vLLM sets none). Every chat and
        every batch line is one; the merge cost a twentieth of a request's CPU."""
        url = self._url(path)
        merged = self._stream_headers.copy()
        if headers:
            merged.update(headers)
        extensions = {"timeout": self._stream_timeout}
        return httpx.Request("POST", url, headers=merged, content=content, extensions=extensions)

    def _timeout(self, limit_s: float) -> httpx.Timeout:
        """``limit_s`` for a control call's every phase but connecting, which the
        shared client's connect timeout bounds."""
        return httpx.Timeout(limit_s, connect=self._client.timeout.connect)

    async def _call(
        self, method: str, path: str, body: Any = None, limits: httpx.Timeout | None = None
    ) -> httpx.Response:
        """A control call, read whole; raises on failure and on non-2xx. ``limits``:
        its timeouts, the control calls' own unless given."""
        request = self._client.build_request(
            method, self.url + path, json=body, timeout=limits or self._control_timeout
        )
        response = await self._send(request)
        try:
            await self._read(response)
        finally:
            await close_now(response)
        if not response.is_success:
            raise self._http_error(response)
        return response

    async def _call_json(self, method: str, path: str, body: Any = None) -> Any:
        response = await self._call(method, path, body)
        try:
            return response.json()
        except ValueError as exc:
            raise self._bad(path, exc) from exc

    async def _send(self, request: httpx.Request) -> httpx.Response:
        try:
            return await self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise map_request_error(self.name, exc) from exc

    async def _read(self, response: httpx.Response) -> bytes:
        try:
            return await response.aread()
        except httpx.HTTPError as exc:
            raise map_stream_error(self.name, exc) from exc

    def _http_error(self, response: httpx.Response) -> EngineHTTPError:
        content_type = response.headers.get("content-type")
        return EngineHTTPError(self.name, response.status_code, response.content, content_type)

    def _bad(self, path: str, exc: Exception) -> EngineBadResponse:
        return EngineBadResponse(self.name, f"{path}: {describe(exc)}")


def json_bytes(body: Any) -> bytes:
    """``body`` as compact UTF-8 JSON, as httpx's ``json=`` would send it, by orjson:
    Python's encoder escapes a string at ~2 ns a character, so a 100,000-character
    prompt cost ~0.3 ms per request (docs/overhead.md). What orjson cannot encode (an
    integer beyond 64 bits) goes through Python's."""
    try:
        return orjson.dumps(body)
    except TypeError:  # orjson.JSONEncodeError
        text = json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        return text.encode()
