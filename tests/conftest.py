from collections.abc import Iterator

import pytest

from tests.support.postgres import fresh_database, postgres_cluster


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def postgres_dsn() -> Iterator[str]:
    """A real PostgreSQL for the session (started on first use): its superuser DSN."""
    with postgres_cluster() as cluster:
        yield cluster.dsn()


@pytest.fixture
def postgres_db(postgres_dsn: str) -> str:
    """A new empty database on the session's PostgreSQL, for one test."""
    return fresh_database(postgres_dsn)
