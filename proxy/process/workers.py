"""``whoseturn serve --workers N``: N proxy processes behind one listening address.

One Python process relays on one core (docs/overhead.md, "Several cores"). With
``workers`` above 1 the process started is a parent that serves nothing itself:

- It binds the listening socket once, then starts N worker processes
  (multiprocessing's ``spawn``: fresh interpreters, none of the parent's threads
  or state) and hands each the socket. Each worker builds its own app
  (:func:`proxy.process.uvicorn_server.run_uvicorn`, which calls ``create_app``)
  after it starts and accepts on that one socket: the kernel gives each new
  connection to one worker.
  This is what uvicorn's own ``--workers`` does. Why not ``SO_REUSEPORT`` (every
  worker binding the port itself): the address is bound once, so a port in use
  stops the start before any worker runs, and no other process of the same user
  can bind the port too and take a share of the connections (``SO_REUSEPORT``
  lets it); and there is one accept queue, so a connection the kernel queued is
  never lost with one worker's socket (with ``SO_REUSEPORT`` each socket has its
  own queue, whose waiting connections are reset when that worker stops). The
  cost: connections are not spread evenly (whichever worker accepts first takes
  the connection). The parent closes its own copy of the socket once the workers
  have theirs, so after every worker has closed it in its drain new connections are
  refused.
- Each worker is a replica (docs/replicas.md) named ``ID-wI``, ``ID`` being
  ``replica_id`` or the default name (host, parent pid, a random suffix), ``I`` 0 to
  N - 1: the workers share each engine's batch prefill budget through the ledger,
  PostgreSQL's at ``ledger_dsn`` or, by default, a SQLite file in the data
  directory (``ledger_path``, :mod:`proxy.replicas.sqlite`): one box needs no
  database server. The SQLite batch store is shared the same way (its leases in
  the file, :mod:`proxy.batch.sqlite`); the parent migrates it and drops its old
  leases before it starts the workers.
- SIGTERM or SIGINT to the parent: it sends SIGTERM to every worker, each drains
  as one proxy does (:mod:`proxy.process.uvicorn_server`), and the parent exits 0
  once all have exited 0.
- A worker that exits before the parent was told to stop is logged, the others are
  drained, and the parent exits 1. Workers are not restarted: the simpler correct
  behaviour, and what lets the supervisor (systemd, Kubernetes) see a crash
  instead of a loop of them hidden inside one process; the server then restarts
  as a whole. A worker whose parent dies (``SIGKILL``) is sent SIGTERM by the
  kernel (``PR_SET_PDEATHSIG``), so no orphan keeps the port.
- ``/turn`` and ``/status`` answer from the worker that took the connection: each
  worker has its own registry and scheduler (docs/overhead.md). ``/metrics`` answers
  for the box: the parent binds one Unix socket per worker too, in a private
  temporary folder it removes at the end, and the worker a scrape lands on adds the
  others' metrics, asked over those sockets, each sample labelled ``worker``
  (:mod:`proxy.api.box`).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import os
import signal
import socket
import sys
import tempfile
from dataclasses import replace
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType

from proxy.api.box import Box, worker_name
from proxy.config import Settings
from proxy.logs import configure_logging
from proxy.process.uvicorn_server import run_uvicorn
from proxy.server import default_replica_id

logger = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1  # prctl(2)


def worker_ids(settings: Settings, base: str) -> list[str]:
    """The replica id of each worker: ``replica_id`` (else ``base``) and ``-wI``."""
    name = settings.replicas.replica_id or base
    return [f"{name}-w{i}" for i in range(settings.replicas.workers)]


def bind(settings: Settings) -> socket.socket:
    """The listening socket on ``host``:``port``, as uvicorn binds it."""
    family = socket.AF_INET6 if ":" in settings.serving.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((settings.serving.host, settings.serving.port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)  # uvicorn's default backlog
    sock.set_inheritable(True)
    return sock


def bind_worker_sockets(count: int) -> tuple[Path, list[socket.socket]]:
    """A private folder (mode 0700) and ``count`` listening Unix sockets in it, one
    per worker (``w0.sock`` ...), inheritable; the parent removes the folder."""
    folder = Path(tempfile.mkdtemp(prefix="whoseturn-box-"))
    sockets = []
    for i in range(count):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(folder / f"{worker_name(i)}.sock"))
        sock.listen(128)
        sock.set_inheritable(True)
        sockets.append(sock)
    return folder, sockets


def remove_folder(folder: Path) -> None:
    """The sockets' folder and what is in it."""
    for entry in folder.iterdir():
        entry.unlink(missing_ok=True)
    os.rmdir(folder)


def run_workers(settings: Settings, log_level: str = "info") -> int:
    """Run ``settings.replicas.workers`` workers on one listening socket until SIGTERM or
    SIGINT, or until one exits; the exit status (0: all drained and exited 0)."""
    try:
        sock = bind(settings)
    except OSError as exc:
        logger.error(
            "cannot listen on %s:%d: %s", settings.serving.host, settings.serving.port, exc
        )
        return 1
    if settings.batch.on and settings.batch.store == "sqlite":
        from proxy.batch.sqlite import prepare

        prepare(Path(settings.batch.store_path))  # migrated once, no lease left from before
    context = multiprocessing.get_context("spawn")
    workers: list[BaseProcess] = []
    folder, unix = bind_worker_sockets(settings.replicas.workers)
    paths = tuple(str(folder / f"{worker_name(i)}.sock") for i in range(len(unix)))
    try:
        with sock:
            for i, replica in enumerate(worker_ids(settings, default_replica_id())):
                # ``workers`` stays N: a worker knows it shares the box's files
                mine = replace(settings, replicas=replace(settings.replicas, replica_id=replica))
                process = context.Process(
                    target=worker_main,
                    args=(mine, log_level, [sock, unix[i]], os.getpid(), Box(i, paths)),
                    name=f"whoseturn-w{i}",
                )
                process.start()
                logger.info("worker %d: pid %s, replica %s", i, process.pid, replica)
                workers.append(process)
        for each in unix:
            each.close()
        return _supervise(workers)
    finally:
        remove_folder(folder)


def _supervise(workers: list[BaseProcess]) -> int:
    """Wait for a signal or a worker's exit; then stop every worker and wait for
    them all. 0 only if the parent was told to stop and every worker exited 0."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    told: list[int] = []

    def on_signal(sig: int, frame: FrameType | None) -> None:
        told.append(sig)
        with contextlib.suppress(BlockingIOError):
            os.write(wake_w, b"\0")

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        by_sentinel = {w.sentinel: w for w in workers}
        ready = wait([wake_r, *by_sentinel])
        early = [by_sentinel[s] for s in ready if s in by_sentinel]
        for worker in early:
            worker.join()
            logger.error(
                "worker %s (pid %s) exited with status %s; stopping the others",
                worker.name,
                worker.pid,
                worker.exitcode,
            )
        if told:
            logger.warning("%s: draining %d workers", signal.Signals(told[0]).name, len(workers))
        failed = _stop_all(workers, early)
        return 0 if told and not early and not failed else 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        os.close(wake_r)
        os.close(wake_w)


def _stop_all(workers: list[BaseProcess], early: list[BaseProcess]) -> bool:
    """Send SIGTERM to every worker still running and wait for them all; whether
    any exited with a status other than 0 (logged, but for ``early``: already)."""
    for worker in workers:
        if worker.exitcode is None and worker.pid is not None:
            os.kill(worker.pid, signal.SIGTERM)
    for worker in workers:
        worker.join()
    failed = [w for w in workers if w.exitcode != 0]
    for worker in failed:
        if worker not in early:
            logger.error("worker %s exited with status %s", worker.name, worker.exitcode)
    return bool(failed)


def worker_main(
    settings: Settings, log_level: str, sockets: list[socket.socket], parent: int, box: Box
) -> None:
    """One worker process (its target): the proxy on the parent's ``sockets`` (the
    shared port and this worker's Unix socket)."""
    _die_with(parent)
    configure_logging(log_level, tag=box.name)
    sys.exit(run_uvicorn(settings, log_level, sockets=sockets, box=box))


def _die_with(parent: int) -> None:
    """SIGTERM this process (a drain) when ``parent`` dies; Linux only, else nothing."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before the prctl
        os.kill(os.getpid(), signal.SIGTERM)
