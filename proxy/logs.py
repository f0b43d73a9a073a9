"""How the proxy's processes log: to stderr, each line with its time, level, logger
and, in a worker process, the worker's tag.

Both the command line (:mod:`proxy.cli`) and each worker process
(:mod:`proxy.process.workers`, a fresh interpreter) set logging up here; it lives on
the ground floor so that neither imports the other.
"""

from __future__ import annotations

import logging

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
"""The levels ``--log-level`` takes."""


def configure_logging(level: str, tag: str = "") -> None:
    """Log at ``level`` to stderr, each line with its time, level, logger and ``tag``
    (a worker process's, e.g. ``w0``)."""
    where = f"{tag} %(name)s" if tag else "%(name)s"
    logging.basicConfig(
        level=level.upper(), format=f"%(asctime)s %(levelname)s {where}: %(message)s"
    )
    # httpx logs every upstream call at info; keep those for debugging only.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    # psycopg's pool warns at every failed reconnect while a database is down; the
    # proxy logs each outage once, with its cause and its length (proxy.batch.health).
    for name in ("psycopg", "psycopg.pool"):
        logging.getLogger(name).setLevel(max(logging.ERROR, logging.getLogger().level))
