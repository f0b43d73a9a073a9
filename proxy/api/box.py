"""One box's worker processes seen as one: each worker's own metrics, labelled with
the worker, in every scrape.

With ``serve --workers N`` a scrape of ``/metrics`` lands on whichever worker
accepts the connection, and each worker has its own scheduler and registry. So
that one scrape tells the whole box's story, the parent binds one Unix socket per
worker (in a private temporary folder, :mod:`proxy.process.workers`) beside the
shared TCP one; each worker serves its app on both. The worker a scrape lands on
asks every other worker for its own metrics (``/metrics?scope=worker``) over
their Unix sockets, at once and within :data:`PEER_TIMEOUT_S`, and answers the
union (:func:`proxy.metrics.merge_expositions`): every sample gains a ``worker`` label (``w0``
...), so counters add up with ``sum without (worker)`` and never go back and forth
between scrapes, and a gauge reads per worker or summed. A worker that does not
answer in time is left out of that scrape (and named in
``whoseturn_box_workers_missing``), never waited for.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import anyio
import httpx

from proxy.metrics import merge_expositions

logger = logging.getLogger(__name__)
PEER_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Box:
    """This worker's place in the box: its index and every worker's Unix socket."""

    index: int
    sockets: tuple[str, ...]

    @property
    def name(self) -> str:
        return worker_name(self.index)


def worker_name(index: int) -> str:
    return f"w{index}"


async def box_metrics(box: Box, own: bytes, authorization: str | None) -> bytes:
    """This worker's exposition ``own`` with every other worker's (asked over its
    Unix socket with the scrape's ``authorization``), merged and labelled."""
    parts: dict[int, bytes] = {box.index: own}

    async def ask(index: int, path: str) -> None:
        headers = {"authorization": authorization} if authorization else {}
        transport = httpx.AsyncHTTPTransport(uds=path)
        try:
            async with httpx.AsyncClient(transport=transport, timeout=PEER_TIMEOUT_S) as client:
                answer = await client.get(
                    "http://worker/metrics", params={"scope": "worker"}, headers=headers
                )
            if answer.status_code == 200:
                parts[index] = answer.content
            else:
                logger.debug("worker %s answered %d to /metrics", index, answer.status_code)
        except httpx.HTTPError as exc:
            logger.debug("worker %s did not answer /metrics: %s", index, exc)

    with anyio.move_on_after(PEER_TIMEOUT_S + 0.5):
        async with anyio.create_task_group() as group:
            for index, path in enumerate(box.sockets):
                if index != box.index:
                    group.start_soon(ask, index, path)
    missing = [worker_name(i) for i in range(len(box.sockets)) if i not in parts]
    labelled = [(worker_name(i), parts[i]) for i in sorted(parts)]
    return merge_expositions(labelled, missing)
