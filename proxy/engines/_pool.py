"""The engines the proxy fronts, sharing one HTTP client, and that client's factory."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import anyio
import httpx

from proxy.config import EngineConfig, Settings
from proxy.engines._client import EngineClient
from proxy.engines._exceptions import UpstreamError
from proxy.engines._transport import PlainHTTPTransport

logger = logging.getLogger(__name__)

MIN_CONNECTIONS = 1000
POOL_SHARDS = 16
WRITE_TIMEOUT_S = 30.0
USER_AGENT = "whoseturn"


def engine_transport(settings: Settings) -> PlainHTTPTransport:
    """The transport under the engines' client (see :func:`make_http_client`)."""
    connections = max(MIN_CONNECTIONS, 2 * sum(e.max_inflight for e in settings.engines))
    per_shard = -(-connections // POOL_SHARDS)
    limits = httpx.Limits(max_connections=per_shard, max_keepalive_connections=per_shard)
    tls = httpx.create_ssl_context()  # one for all: each costs loading the CA bundle
    return PlainHTTPTransport(
        fallback=ShardedTransport(
            [httpx.AsyncHTTPTransport(verify=tls, limits=limits) for _ in range(POOL_SHARDS)]
        )
    )


def make_http_client(
    settings: Settings, transport: httpx.AsyncBaseTransport | None = None
) -> httpx.AsyncClient:
    """The one client for all upstream traffic; the caller closes it.

    Connects time out after ``settings.upstream.connect_timeout_s``; reads never do (a
    stream may run for minutes; control calls set their own limit). Engines are
    asked not to compress (``Accept-Encoding: identity``) so raw bytes can be
    passed through to clients as they are, and proxy variables in the environment
    are ignored.

    ``http://`` engines are reached through :class:`PlainHTTPTransport` (asyncio's
    protocols and httptools: the relay's cheap path), which opens a connection for
    each request in flight that finds none idle (the scheduler's ``max_inflight``
    bounds them) and never waits for one; ``https://`` ones through httpx's own,
    its connections in :data:`POOL_SHARDS` pools (:class:`ShardedTransport`), where
    waiting for a free connection is queueing, not failure (:func:`engine_transport`).
    Unless ``transport`` is given (tests swap it).
    """
    return httpx.AsyncClient(
        transport=transport if transport is not None else engine_transport(settings),
        timeout=httpx.Timeout(
            connect=settings.upstream.connect_timeout_s, read=None, write=WRITE_TIMEOUT_S, pool=None
        ),
        headers={"Accept-Encoding": "identity", "User-Agent": USER_AGENT},
        trust_env=False,
    )


class ShardedTransport(httpx.AsyncBaseTransport):
    """Requests spread in turn over several connection pools.

    httpcore's pool walks all its connections each time a request starts or a
    response closes, and for each idle one builds a list of them all again: the
    work per stream grows with the connections open, and with a thousand streams
    open (one connection each) it was a large part of the proxy's CPU (profile in
    docs/overhead.md). In ``n`` pools each walk covers a ``1/n`` share.
    """

    def __init__(self, shards: Sequence[httpx.AsyncBaseTransport]) -> None:
        if not shards:
            raise ValueError("a sharded transport needs at least one shard")
        self._shards = list(shards)
        self._turn = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self._turn = (self._turn + 1) % len(self._shards)
        try:
            return await self._shards[self._turn].handle_async_request(request)
        except AttributeError as exc:
            # anyio on uvloop: a connection the engine closed while httpcore was still
            # setting it up has no socket left, and asking it for its TLS object raises
            # AttributeError (seen when an engine was killed mid-run). Nothing was
            # sent yet: it is a failed connect, retried elsewhere like any other.
            raise httpx.ConnectError(
                f"the connection closed while it was being set up ({exc})", request=request
            ) from exc

    async def aclose(self) -> None:
        for shard in self._shards:
            await shard.aclose()


class EnginePool:
    """An :class:`EngineClient` per configured engine, by name in config order."""

    def __init__(
        self,
        configs: Sequence[EngineConfig],
        client: httpx.AsyncClient,
        direct: PlainHTTPTransport | None = None,
    ) -> None:
        """``direct``: ``client``'s transport, where it is the plain one (each
        engine's streamed requests are then written onto it as bytes)."""
        self.client = client
        self.direct = direct
        self.engines: dict[str, EngineClient] = {}
        for config in configs:
            if config.name in self.engines:
                raise ValueError(f"engine names must be unique, {config.name!r} repeats")
            self.add(config)

    def add(self, config: EngineConfig) -> EngineClient:
        """The client of the engine ``config`` describes, made once per name."""
        engine = self.engines.get(config.name)
        if engine is None:
            engine = EngineClient(config, self.client, direct=self.direct)
            self.engines[config.name] = engine
        return engine

    def remove(self, name: str) -> None:
        """Forget engine ``name`` (it left); its connections close as they go idle."""
        self.engines.pop(name, None)

    def client_for(self, name: str) -> EngineClient:
        """The engine called ``name``; :class:`KeyError` if there is none."""
        try:
            return self.engines[name]
        except KeyError:
            raise KeyError(f"no engine named {name!r}") from None

    async def discover(self) -> dict[str, tuple[str, ...]]:
        """Each engine's models: as configured, else from its ``/v1/models``.

        Engines are asked concurrently; one that cannot answer gets ``()`` and a
        warning in the log. Returns every engine, in config order.
        """
        found = {name: tuple(engine.config.models) for name, engine in self.engines.items()}
        async with anyio.create_task_group() as tg:
            for name, engine in self.engines.items():
                if not found[name]:
                    tg.start_soon(self._ask, engine, found)
        return found

    @staticmethod
    async def _ask(engine: EngineClient, found: dict[str, tuple[str, ...]]) -> None:
        try:
            found[engine.name] = tuple(await engine.models())
        except UpstreamError as exc:
            logger.warning("engine %s: cannot list its models: %s", engine.name, exc)
