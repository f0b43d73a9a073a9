"""What the HTTP edge's handlers read of the running proxy: :class:`EdgeState`, a
protocol that the composition root's state (:class:`proxy.server.ProxyState`) meets,
so that the edge never imports the floor above it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from fastapi import Request

from proxy.admission import Admission
from proxy.api.forward import Forwarder
from proxy.config import Settings
from proxy.engines import EngineMonitor
from proxy.metrics import ProxyMetrics
from proxy.replicas import SharedBudget


class EdgeState(Protocol):
    """The running proxy's parts that the edge's routes use."""

    @property
    def settings(self) -> Settings: ...

    @property
    def created(self) -> int:
        """When the proxy started (epoch seconds): the models' ``created``."""
        ...

    @property
    def admission(self) -> Admission: ...

    @property
    def forwarder(self) -> Forwarder: ...

    @property
    def monitor(self) -> EngineMonitor: ...

    @property
    def metrics(self) -> ProxyMetrics: ...

    @property
    def shared(self) -> SharedBudget | None:
        """The shared budget of several replicas, if there is one."""
        ...

    @property
    def replica(self) -> str:
        """This proxy's name in the ledger (and on ``/turn``)."""
        ...

    def batch_store_health(self, now: float) -> dict[str, Any] | None:
        """The batch store's health at monotonic time ``now`` (``/readyz``); None
        while the Batch API is off."""
        ...


StateOf = Callable[[Request], EdgeState]
"""The running proxy's state for a request (its app's)."""
