"""All upstream I/O of the proxy: engine clients, discovery, health, load scrapes.

One :class:`httpx.AsyncClient` (from :func:`make_http_client`) is shared by an
:class:`EnginePool`; each engine is an :class:`EngineClient`; an
:class:`EngineMonitor` keeps the scheduler's view of engine health and load
current; an :class:`EngineDiscovery` keeps engine groups found by DNS in step
with their names; a :class:`KVEventSubscriber` follows an engine's KV-cache events
for the scheduler's prefix index. Failures are :class:`UpstreamError` subclasses
(the tree is drawn in ``proxy/engines/_exceptions.py``).
"""

from proxy.engines._activation import ActivationFailed, Activator
from proxy.engines._client import EngineClient
from proxy.engines._discovery import EngineDiscovery, EngineFleet, Resolver, resolve_addresses
from proxy.engines._exceptions import (
    EngineBadResponse,
    EngineConnectTimeout,
    EngineHTTPError,
    EngineStreamBroken,
    EngineTimeout,
    EngineUnavailable,
    UpstreamError,
    map_stream_error,
)
from proxy.engines._kv_events import KVEventSubscriber, decode_kv_events
from proxy.engines._metrics import (
    CacheFacts,
    parse_cache_facts,
    parse_load,
    parse_prefix_cache_hits,
)
from proxy.engines._monitor import AnswerWait, EngineMonitor, EngineStateSink
from proxy.engines._pool import EnginePool, engine_transport, make_http_client
from proxy.engines._prefix_feed import PrefixFeed
from proxy.engines._transport import PlainHTTPTransport, raw_chunks

__all__ = [
    "ActivationFailed",
    "Activator",
    "AnswerWait",
    "CacheFacts",
    "EngineBadResponse",
    "EngineClient",
    "EngineConnectTimeout",
    "EngineDiscovery",
    "EngineFleet",
    "EngineHTTPError",
    "EngineMonitor",
    "EnginePool",
    "EngineStateSink",
    "EngineStreamBroken",
    "EngineTimeout",
    "EngineUnavailable",
    "KVEventSubscriber",
    "PlainHTTPTransport",
    "PrefixFeed",
    "Resolver",
    "UpstreamError",
    "decode_kv_events",
    "engine_transport",
    "make_http_client",
    "map_stream_error",
    "parse_cache_facts",
    "parse_load",
    "parse_prefix_cache_hits",
    "raw_chunks",
    "resolve_addresses",
]
