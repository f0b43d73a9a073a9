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
``whoseturn_box_workers_missing``), never waited for. ``/turn`` does the same
(:func:`box_turns`): its ``box`` section holds every worker's own ``/turn``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

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


async def ask_workers(
    box: Box, path: str, authorization: str | None
) -> tuple[dict[int, bytes], list[str]]:
    """Every other worker's answer to ``GET path?scope=worker`` (asked over its Unix
    socket with the caller's ``authorization``, all at once, within
    :data:`PEER_TIMEOUT_S`), by index; and the names of those that gave none."""
    parts: dict[int, bytes] = {}

    async def ask(index: int, socket_path: str) -> None:
        headers = {"authorization": authorization} if authorization else {}
        transport = httpx.AsyncHTTPTransport(uds=socket_path)
        try:
            async with httpx.AsyncClient(transport=transport, timeout=PEER_TIMEOUT_S) as client:
                answer = await client.get(
                    "http://worker" + path, params={"scope": "worker"}, headers=headers
                )
            if answer.status_code == 200:
                parts[index] = answer.content
            else:
                logger.debug("worker %s answered %d to %s", index, answer.status_code, path)
        except httpx.HTTPError as exc:
            logger.debug("worker %s did not answer %s: %s", index, path, exc)

    with anyio.move_on_after(PEER_TIMEOUT_S + 0.5):
        async with anyio.create_task_group() as group:
            for index, socket_path in enumerate(box.sockets):
                if index != box.index:
                    group.start_soon(ask, index, socket_path)
    others = (i for i in range(len(box.sockets)) if i != box.index)
    return dict(parts), [worker_name(i) for i in others if i not in parts]


async def box_metrics(box: Box, own: bytes, authorization: str | None) -> bytes:
    """This worker's exposition ``own`` with every other worker's, merged and
    labelled."""
    parts, missing = await ask_workers(box, "/metrics", authorization)
    parts[box.index] = own
    labelled = [(worker_name(i), parts[i]) for i in sorted(parts)]
    return merge_expositions(labelled, missing)


async def box_turns(box: Box, own: dict[str, Any], authorization: str | None) -> dict[str, Any]:
    """``/turn``'s ``box`` section: each worker's own ``/turn`` (this one's ``own``) by
    name, and the workers that did not answer in time. Each worker has its own
    scheduler and queue; the engines' budget they share is the ``ledger`` section."""
    parts, missing = await ask_workers(box, "/turn", authorization)
    workers: dict[str, Any] = {box.name: own}
    for index in sorted(parts):
        try:
            workers[worker_name(index)] = json.loads(parts[index])
        except ValueError:
            missing.append(worker_name(index))
    return {"this_worker": box.name, "workers": workers, "missing": sorted(missing)}
