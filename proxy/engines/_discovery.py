"""Engines found by DNS: a name resolved again and again, one engine per address.

An engine entry whose URL is ``dns+http://HOST:PORT`` (``dns+https://`` too) is a
group (:attr:`proxy.config.EngineConfig.by_dns`). Every ``dns_interval_s``
:class:`EngineDiscovery` resolves ``HOST``; each address ``A`` is an engine named
``NAME-A`` at ``http://A:PORT`` with the entry's other settings (for Kubernetes: a
headless Service, whose name resolves to the address of every ready pod).

- An address that appears **joins** (:meth:`EngineFleet.join`).
- An address that is gone **leaves** (:meth:`EngineFleet.leave`): the engine is
  drained (no new work; work in flight there finishes; queued work goes to the
  others), and forgotten (:meth:`EngineFleet.forget`) once nothing runs there. An
  address that comes back while its engine drains takes new work again.
- A look-up that fails (no answer, a DNS server error) changes nothing: the group
  keeps the engines it had, and the failure is logged at warning. A name that
  resolves to no address at all fails the same way (``getaddrinfo`` raises), so a
  DNS outage never drains every engine.

The resolver is injected (:data:`Resolver`); the default,
:func:`resolve_addresses`, is the event loop's ``getaddrinfo``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from proxy.config import EngineConfig

logger = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[Sequence[str]]]
"""``await resolver(host, port)``: the addresses ``host`` has now; raises
:class:`OSError` when the look-up fails."""


async def resolve_addresses(host: str, port: int) -> list[str]:
    """The addresses ``host`` resolves to (the event loop's ``getaddrinfo``), sorted."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


class EngineFleet(Protocol):
    """The parts that learn of engines joining and leaving (built in
    :mod:`proxy.server`)."""

    def join(self, config: EngineConfig) -> None: ...

    def leave(self, name: str) -> None: ...

    def forget(self, name: str) -> bool:
        """Drop a left engine if nothing runs on it; whether it is gone."""
        ...


class EngineDiscovery:
    """Keeps the engines of the DNS ``groups`` in step with what their names resolve to."""

    def __init__(
        self, groups: Sequence[EngineConfig], resolver: Resolver, fleet: EngineFleet
    ) -> None:
        self.groups = [g for g in groups if g.by_dns]
        self.resolver = resolver
        self.fleet = fleet
        self.engines: dict[str, dict[str, EngineConfig]] = {g.name: {} for g in self.groups}
        self.leaving: set[str] = set()
        self.failures = 0

    async def resolve_once(self) -> None:
        """Look every group up once, and join, drain and forget engines to match."""
        for group in self.groups:
            await self._resolve(group)
        for name in sorted(self.leaving):
            if self.fleet.forget(name):
                self.leaving.discard(name)
                logger.info("engine %s drained and forgotten", name)

    async def run(self, interval_s: float) -> None:
        """:meth:`resolve_once` every ``interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            await self.resolve_once()

    async def _resolve(self, group: EngineConfig) -> None:
        host, port = group.dns_host_port
        try:
            addresses = await self.resolver(host, port)
        except OSError as exc:
            self.failures += 1
            logger.warning("engines %s: cannot resolve %s (keeping %d): %s",
                           group.name, host, len(self.engines[group.name]), exc)  # fmt: skip
            return
        now = {c.name: c for c in (group.at_address(a) for a in addresses)}
        before = self.engines[group.name]
        for name in sorted(now.keys() - before.keys()):
            logger.info("engine %s joins at %s", name, now[name].url)
            self.leaving.discard(name)
            self.fleet.join(now[name])
        for name in sorted(before.keys() - now.keys()):
            logger.info("engine %s leaves (no longer in DNS): draining it", name)
            self.leaving.add(name)
            self.fleet.leave(name)
        self.engines[group.name] = now
