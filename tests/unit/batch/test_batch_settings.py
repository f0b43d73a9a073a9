"""The batch settings: read from the file and the environment, checked by name."""

from __future__ import annotations

import pytest

from proxy.batch.postgres import redacted
from proxy.config import ConfigError, load_settings, settings_from_dict

ENGINES = {"engines": ["http://127.0.0.1:8000"]}


@pytest.mark.parametrize(
    "key",
    [
        "batch_max_file_bytes", "batch_max_lines", "batch_window", "batch_max_attempts",
        "batch_pool_size", "batch_lease_s",
    ],
)  # fmt: skip
def test_a_limit_below_one_names_its_key(key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        settings_from_dict({**ENGINES, key: 0})


def test_the_store_path_comes_from_the_environment() -> None:
    env = {"WHOSETURN_BATCH_STORE_PATH": "/tmp/b.db", "WHOSETURN_ENGINES": "http://h:1"}
    assert load_settings(None, env=env).batch.store_path == "/tmp/b.db"


def test_the_batch_api_is_on_by_default_and_off_when_asked() -> None:
    assert settings_from_dict(ENGINES).batch.store_path.endswith("/whoseturn/batch.sqlite3")
    off = settings_from_dict({**ENGINES, "batch_store": "off"}).batch
    assert (off.store_path, off.on) == ("", False)


def test_the_postgres_store_comes_from_the_environment_and_its_password_stays_out() -> None:
    dsn = "postgresql://whoseturn:hunter2@db.internal:5432/jobs"
    env = {"WHOSETURN_BATCH_STORE": "postgres", "WHOSETURN_BATCH_DSN": dsn,
           "WHOSETURN_ENGINES": "http://h:1"}  # fmt: skip
    settings = load_settings(None, env=env)
    assert (settings.batch.store, settings.batch.dsn) == ("postgres", dsn)
    assert "hunter2" not in repr(settings)
    shown = redacted(dsn)
    assert "hunter2" not in shown and "db.internal" in shown and "jobs" in shown


def test_the_postgres_store_needs_a_dsn_and_the_store_a_known_name() -> None:
    with pytest.raises(ConfigError, match="batch_dsn"):
        settings_from_dict({**ENGINES, "batch_store": "postgres"})
    with pytest.raises(ConfigError, match="batch_store"):
        settings_from_dict({**ENGINES, "batch_store": "mysql"})
