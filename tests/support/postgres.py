"""A real PostgreSQL for the tests: see :mod:`loadtests.support.postgres` (re-exported here).

``postgres_cluster()`` starts a throwaway cluster (as the ``postgres`` user when run
as root) and stops it after; ``fresh_database(dsn)`` makes an empty database on it.
The session fixture ``postgres_dsn`` and the per-test ``postgres_db`` live in
``tests/conftest.py``.
"""

from __future__ import annotations

from loadtests.support.postgres import (
    Cluster,
    bin_dir,
    fresh_database,
    paused,
    postgres_cluster,
    start,
    stop,
)

__all__ = ["Cluster", "bin_dir", "fresh_database", "paused", "postgres_cluster", "start", "stop"]
