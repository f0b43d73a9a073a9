"""The proxy as operating-system processes: what ``whoseturn serve`` runs once its
settings are loaded.

The startup story, top to bottom:

- :mod:`proxy.cli`: the command line; ``whoseturn serve`` loads the settings, logs
  where they came from, and calls :func:`run`.
- :func:`run`: one process, or a parent of ``workers`` processes on one port.
- :mod:`proxy.process.workers`: the parent: binds the port once, starts the worker
  processes, drains them all on SIGTERM; each worker runs the one-process path.
- :mod:`proxy.process.uvicorn_server`: one process: the app on uvicorn until SIGTERM,
  then the drain; the garbage collector's thresholds while serving.
- :mod:`proxy.process.slow_clients`: uvicorn's HTTP protocol with the header read
  timeout and the cap on incomplete connections.
- :mod:`proxy.server`: the composition root the app is built from: every part, its
  startup and its shutdown (the app's lifespan).
"""

from __future__ import annotations

from proxy.config import Settings
from proxy.process.uvicorn_server import run_uvicorn
from proxy.process.workers import run_workers

__all__ = ["run"]


def run(settings: Settings, log_level: str = "info") -> int:
    """Run the proxy until SIGTERM or SIGINT, then drain; the exit status. With
    ``settings.replicas.workers`` above 1, as that many worker processes
    (:func:`proxy.process.workers.run_workers`), else in this one
    (:func:`proxy.process.uvicorn_server.run_uvicorn`)."""
    if settings.replicas.workers > 1:
        return run_workers(settings, log_level)
    return run_uvicorn(settings, log_level)
