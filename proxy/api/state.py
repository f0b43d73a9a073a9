"""What the HTTP edge's handlers read of the running proxy: :class:`EdgeState`, a
protocol that the composition root's state (:class:`proxy.server.ProxyState`) meets,
so that the edge never imports the floor above it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from fastapi import Request

from proxy.admission import Admission
from proxy.api.box import Box
from proxy.api.forward import Forwarder
from proxy.cards import CardKeeper
from proxy.config import Settings
from proxy.engines import EngineMonitor
from proxy.metrics import ProxyMetrics
from proxy.replicas import SharedBudget


class EdgeState(Protocol):
    """The running proxy's parts that the edge's routes use."""

    settings: Settings
    created: int  # when the proxy started (epoch seconds): the models' ``created``
    admission: Admission
    forwarder: Forwarder
    monitor: EngineMonitor
    metrics: ProxyMetrics
    shared: SharedBudget | None  # the shared budget of several replicas, if there is one
    replica: str  # this proxy's name in the ledger (and on ``/turn``)
    box: Box | None  # this proxy is one of a box's worker processes
    cards: list[CardKeeper]  # models sharing a card, and which is awake

    def batch_store_health(self, now: float) -> dict[str, Any] | None:
        """The batch store's health at monotonic time ``now`` (``/readyz``); None
        while the Batch API is off."""
        ...


StateOf = Callable[[Request], EdgeState]
"""The running proxy's state for a request (its app's)."""
