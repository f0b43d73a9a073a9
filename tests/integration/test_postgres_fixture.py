"""The test cluster itself: a real PostgreSQL, a fresh database per test."""

from __future__ import annotations

import psycopg
import pytest

pytestmark = pytest.mark.integration


def test_each_test_gets_its_own_empty_database(postgres_dsn: str, postgres_db: str) -> None:
    with psycopg.connect(postgres_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (x int)")
        conn.execute("INSERT INTO t VALUES (1)")
        row = conn.execute("SELECT current_database(), count(*) FROM t").fetchone()
    assert row is not None and row[0].startswith("t_") and row[1] == 1
    with psycopg.connect(postgres_dsn) as admin:
        server = admin.execute("SHOW server_version_num").fetchone()
        names = [r[0] for r in admin.execute("SELECT datname FROM pg_database").fetchall()]
    assert server is not None and int(server[0]) >= 120000
    assert row[0] in names
