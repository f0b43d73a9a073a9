from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.postgres import fresh_database, postgres_cluster


@pytest.fixture(scope="session", autouse=True)
def data_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The default data directory under a temporary one for the whole session.

    The Batch API is on by default, its SQLite store in ``$XDG_DATA_HOME/whoseturn``
    (else ``~/.local/share/whoseturn``): every proxy a test builds from loaded
    settings opens it. Set in the process's environment (not per test), so that
    module-scoped proxies built before any test's own fixtures, and ``whoseturn``
    child processes, which inherit it, keep out of the user's home too. A developer's
    own ``WHOSETURN_DATA_DIR`` is set aside for the same reason."""
    home = tmp_path_factory.mktemp("xdg-data-home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_DATA_HOME", str(home))
        patch.delenv("WHOSETURN_DATA_DIR", raising=False)
        yield home


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
