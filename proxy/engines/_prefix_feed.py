"""What feeds the scheduler's prefix index of each engine (:mod:`proxy.scheduler.prefix`).

- Its cache's shape: block size and size in blocks, from the engine's
  ``vllm:cache_config_info`` (asked once per engine, again until it answers).
- Where the engine publishes KV-cache events (``kv_events`` in its settings), a
  :class:`~proxy.engines.KVEventSubscriber` per engine: the index follows them.
  Elsewhere the index is kept from what was routed there, corrected by the
  engine's ``cached_tokens``.

Which of the two each engine is in is logged when it joins and shown on ``/turn``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from proxy.config import EngineConfig
from proxy.engines._exceptions import UpstreamError
from proxy.engines._kv_events import KVEventSubscriber
from proxy.engines._pool import EnginePool
from proxy.scheduler.prefix import KVEvent

logger = logging.getLogger(__name__)


class PrefixFeed:
    """One per proxy. ``set_cache(name, block_size, blocks)``, ``follow(name)`` (the
    engine's index is now kept from its events) and ``on_events(name, events)``
    reach the scheduler; the subscribers' tasks live until :meth:`stop`."""

    def __init__(
        self,
        pool: EnginePool,
        set_cache: Callable[[str, int | None, int | None], None],
        follow: Callable[[str], None],
        on_events: Callable[[str, list[KVEvent]], None],
    ) -> None:
        self.pool = pool
        self._set_cache = set_cache
        self._follow = follow
        self._on_events = on_events
        self._shaped: set[str] = set()
        self.subscribers: dict[str, KVEventSubscriber] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def add(self, config: EngineConfig) -> None:
        """An engine joined: follow its events where it publishes them (the task
        starts at once when a loop runs, else at :meth:`start`)."""
        if not config.kv_events:
            logger.info(
                "engine %s: prefix index kept from what is routed there (no kv_events)",
                config.name,
            )
            return
        subscriber = KVEventSubscriber(
            config.name,
            config.kv_events,
            self._on_events,
            replay_endpoint=config.kv_events_replay or None,
        )
        self.subscribers[config.name] = subscriber
        self._follow(config.name)
        logger.info(
            "engine %s: prefix index follows its KV events at %s%s",
            config.name,
            config.kv_events,
            f" (replay {config.kv_events_replay})" if config.kv_events_replay else "",
        )
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        self._start(config.name)

    def remove(self, name: str) -> None:
        self._shaped.discard(name)
        self.subscribers.pop(name, None)
        task = self._tasks.pop(name, None)
        if task is not None:
            task.cancel()

    def start(self) -> None:
        """Start the subscribers not started yet."""
        for name in self.subscribers:
            if name not in self._tasks:
                self._start(name)

    def _start(self, name: str) -> None:
        task = asyncio.create_task(self.subscribers[name].run(), name=f"whoseturn-kv-{name}")
        task.add_done_callback(self._ended)
        self._tasks[name] = task

    def _ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.error("%s ended: %r", task.get_name(), task.exception())

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def shape(self) -> None:
        """Ask each engine whose cache shape is not known yet what it is."""
        for name in list(self.pool.engines):
            if name in self._shaped:
                continue
            try:
                facts = await self.pool.client_for(name).cache_facts()
            except UpstreamError as exc:
                logger.debug("engine %s: cache config not read: %s", name, exc)
                continue
            self._shaped.add(name)
            self._set_cache(name, facts.block_size, facts.num_gpu_blocks)
            logger.info(
                "engine %s: prefix cache of %s blocks of %s tokens",
                name,
                facts.num_gpu_blocks or "unknown",
                facts.block_size or "unknown",
            )

    def view(self) -> dict[str, dict[str, Any]]:
        """Each subscribed engine's event counts (``/turn``)."""
        return {
            name: {
                "endpoint": s.endpoint,
                "batches": s.batches,
                "events": s.events,
                "gaps": s.gaps,
                "lost": s.lost,
                "last_at": s.last_at,
            }
            for name, s in self.subscribers.items()
        }
