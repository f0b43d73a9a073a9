"""Every route but the probes behind a key when ``api_keys`` is set; a read-only
role; classes and the class header by each key's policy; keys compared in
constant time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.api import auth
from proxy.config import ApiKey, ConfigError, EngineConfig, Settings, settings_from_dict

from .helpers import CHAT, MESSAGES, FakeEngines, running

pytestmark = pytest.mark.anyio

USER, READER = "sk-user-1", "sk-read-1"
KEYS = (USER, ApiKey(key=READER, role="read"))
BODY = {"model": "m", "messages": MESSAGES}
READS = [
    "/metrics",
    "/turn",
    "/turn/log",
    "/turn/history",
    "/status",
    "/v1/models",
    "/batch/v1/models",
    "/openapi.json",
    "/docs",
    "/redoc",
]
PROBES = ["/healthz", "/readyz"]


def bearer(key: str | None) -> dict[str, str]:
    return {} if key is None else {"authorization": f"Bearer {key}"}


async def status_of(client: httpx.AsyncClient, method: str, path: str, key: str | None) -> int:
    body: Any = BODY if method == "POST" else None
    response = await client.request(method, path, json=body, headers=bearer(key))
    if response.status_code in (401, 403):
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    return response.status_code


ROUTES = [("GET", p) for p in PROBES + READS] + [
    ("POST", CHAT),
    ("POST", "/batch" + CHAT),
    ("POST", "/v1/completions"),
    ("GET", "/no/such/route"),
]


def expected(method: str, path: str, key: str | None) -> int:
    if path in PROBES:
        return 200
    if key not in (USER, READER):
        return 401
    if path == "/no/such/route":
        return 403 if key == READER else 404
    if method == "POST":
        return (
            403 if key == READER else (400 if "completions" in path and "chat" not in path else 200)
        )
    return 200


@pytest.mark.parametrize("key", [None, "sk-wrong", READER, USER])
async def test_every_route_behind_its_role(key: str | None) -> None:
    engines = FakeEngines()
    async with running(engines.settings(api_keys=KEYS), engines) as (client, _):
        got = {(m, p): await status_of(client, m, p, key) for m, p in ROUTES}
    assert got == {(m, p): expected(m, p, key) for m, p in ROUTES}


async def test_without_keys_every_route_is_open() -> None:
    engines = FakeEngines()
    async with running(engines.settings(), engines) as (client, _):
        for path in PROBES + READS:
            assert (await client.get(path)).status_code == 200, path


def test_every_key_is_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = auth.hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    settings = Settings.from_keys(
        engines=(EngineConfig(name="e", url="http://e:1"),), api_keys=KEYS
    )
    assert auth.find_key(settings, USER) == ApiKey(key=USER)  # the first key matches...
    assert len(calls) == len(KEYS)  # ...and every key was still compared
    calls.clear()
    assert auth.find_key(settings, "sk-user-é") is None  # non-ASCII: no TypeError
    assert len(calls) == len(KEYS)


async def test_the_key_is_checked_once_per_request(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A chat request, a read and a Batch API route each compare the caller's key with
    every configured key once: as the request comes in, not again on its way."""
    compared: list[bytes] = []
    real = auth.hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        compared.append(b)
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    engines = FakeEngines()
    config = engines.settings(api_keys=KEYS, batch_store_path=str(tmp_path / "b.db"))
    async with running(config, engines) as (client, _):
        for method, path in [("POST", CHAT), ("GET", "/v1/models"), ("GET", "/v1/batches")]:
            compared.clear()
            body = BODY if method == "POST" else None
            response = await client.request(method, path, json=body, headers=bearer(USER))
            assert response.status_code == 200, (path, response.text)
            assert len(compared) == len(KEYS), (path, len(compared))


CLASS_KEYS = (
    "sk-plain",
    ApiKey(key="sk-chooser", class_override=True),
    ApiKey(key="sk-batch-only", classes=("batch",)),
)


@pytest.mark.parametrize(
    ("key", "path", "header", "status", "served_as"),
    [
        ("sk-plain", CHAT, None, 200, "interactive"),
        ("sk-plain", CHAT, "batch", 403, None),  # keys set: the header needs a key that allows it
        ("sk-chooser", CHAT, "batch", 200, "batch"),
        ("sk-chooser", "/batch" + CHAT, "interactive", 200, "interactive"),
        ("sk-batch-only", CHAT, None, 403, None),  # no batch work served as interactive
        ("sk-batch-only", "/batch" + CHAT, None, 200, "batch"),
    ],
)
async def test_classes_by_each_keys_policy(
    key: str, path: str, header: str | None, status: int, served_as: str | None
) -> None:
    engines = FakeEngines()
    headers = bearer(key) | ({"x-whoseturn-class": header} if header else {})
    async with running(engines.settings(api_keys=CLASS_KEYS), engines) as (client, _):
        response = await client.post(path, json=BODY, headers=headers)
    assert response.status_code == status, response.text
    if served_as is not None:
        assert response.headers["x-whoseturn-class"] == served_as
    else:
        assert response.json()["error"]["type"] == "permission_error"


def test_api_keys_config_takes_plain_strings_and_policies() -> None:
    s = settings_from_dict(
        {
            "engines": ["http://e:1"],
            "api_keys": ["k1", {"key": "k2", "role": "read"}, {"key": "k3", "classes": ["batch"]}],
        }
    )
    assert s.access.api_keys[0] == "k1"
    assert s.access.key_policies() == (
        ApiKey(key="k1"),
        ApiKey(key="k2", role="read"),
        ApiKey(key="k3", classes=("batch",)),
    )
    assert "k2" not in repr(s.access.key_policies())


@pytest.mark.parametrize(
    ("entry", "where"),
    [
        ({"role": "read"}, r"api_keys\[0\]\.key"),
        ({"key": "k", "role": "admin"}, r"api_keys\[0\]\.role"),
        ({"key": "k", "classes": ["urgent"]}, r"api_keys\[0\]\.classes"),
        ({"key": "k", "class_override": "yes"}, r"api_keys\[0\]\.class_override"),
        ({"key": "k", "colour": "red"}, r"api_keys\[0\]"),
    ],
)
def test_bad_key_policies_name_the_key(entry: dict[str, Any], where: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{where}"):
        settings_from_dict({"engines": ["http://e:1"], "api_keys": [entry]})


async def test_a_browser_may_give_the_key_as_a_basic_password() -> None:
    engines = FakeEngines()
    basic = httpx.BasicAuth("anyone", READER)
    wrong = httpx.BasicAuth("anyone", "sk-wrong")
    async with running(engines.settings(api_keys=KEYS), engines) as (client, _):
        challenged = await client.get("/status")
        refused = await client.get("/status", auth=wrong)
        page = await client.get("/status", auth=basic)
        garbled = await client.get("/status", headers={"authorization": "Basic !!!"})
    assert "Basic" in challenged.headers["www-authenticate"]
    assert (challenged.status_code, refused.status_code, garbled.status_code) == (401, 401, 401)
    assert page.status_code == 200 and "<html" in page.text.lower()
