"""DNS groups of engines: addresses join, leave (drained, then forgotten), and a
failed look-up changes nothing."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pytest

from proxy.config import EngineConfig, settings_from_dict
from proxy.engines import EngineDiscovery

pytestmark = pytest.mark.anyio


class Dns:
    """A resolver the test drives: each name's addresses, or a failure."""

    def __init__(self) -> None:
        self.addresses: dict[str, list[str]] = {}
        self.failing = False
        self.asked: list[tuple[str, int]] = []

    async def __call__(self, host: str, port: int) -> Sequence[str]:
        self.asked.append((host, port))
        if self.failing:
            raise OSError("Temporary failure in name resolution")
        return self.addresses.get(host, [])


class Fleet:
    """Records joins and leaves; an engine can be forgotten once ``idle`` says so."""

    def __init__(self) -> None:
        self.engines: dict[str, EngineConfig] = {}
        self.draining: set[str] = set()
        self.busy: set[str] = set()
        self.events: list[str] = []

    def join(self, config: EngineConfig) -> None:
        self.engines[config.name] = config
        self.draining.discard(config.name)
        self.events.append(f"join {config.name}")

    def leave(self, name: str) -> None:
        self.draining.add(name)
        self.events.append(f"leave {name}")

    def forget(self, name: str) -> bool:
        if name in self.busy:
            return False
        del self.engines[name]
        self.draining.discard(name)
        self.events.append(f"forget {name}")
        return True


def group(url: str = "dns+http://vllm-headless.ns.svc:8000", **extra: object) -> EngineConfig:
    return settings_from_dict({"engines": [{"url": url, "name": "vllm", **extra}]}).engines[0]


async def test_each_address_is_an_engine_with_the_groups_settings() -> None:
    dns, fleet = Dns(), Fleet()
    dns.addresses["vllm-headless.ns.svc"] = ["10.0.0.7", "10.0.0.5"]
    discovery = EngineDiscovery([group(max_inflight=9, models=["tiny"])], dns, fleet)
    await discovery.resolve_once()
    assert dns.asked == [("vllm-headless.ns.svc", 8000)]
    assert sorted(fleet.engines) == ["vllm-10.0.0.5", "vllm-10.0.0.7"]
    one = fleet.engines["vllm-10.0.0.5"]
    assert (one.url, one.max_inflight, tuple(one.models)) == ("http://10.0.0.5:8000", 9, ("tiny",))


async def test_engines_join_and_leave_and_are_forgotten_once_idle() -> None:
    dns, fleet = Dns(), Fleet()
    dns.addresses["vllm-headless.ns.svc"] = ["10.0.0.1", "10.0.0.2"]
    discovery = EngineDiscovery([group()], dns, fleet)
    await discovery.resolve_once()
    fleet.busy.add("vllm-10.0.0.1")
    dns.addresses["vllm-headless.ns.svc"] = ["10.0.0.2", "10.0.0.3"]
    await discovery.resolve_once()
    assert fleet.events[2:] == ["join vllm-10.0.0.3", "leave vllm-10.0.0.1"]
    assert "vllm-10.0.0.1" in fleet.engines, "forgotten while work ran there"
    await discovery.resolve_once()
    assert fleet.events[4:] == []
    fleet.busy.clear()
    await discovery.resolve_once()
    assert fleet.events[4:] == ["forget vllm-10.0.0.1"]
    assert sorted(fleet.engines) == ["vllm-10.0.0.2", "vllm-10.0.0.3"]


async def test_an_address_back_while_draining_joins_again_and_is_not_forgotten() -> None:
    dns, fleet = Dns(), Fleet()
    dns.addresses["vllm-headless.ns.svc"] = ["10.0.0.1"]
    discovery = EngineDiscovery([group()], dns, fleet)
    await discovery.resolve_once()
    fleet.busy.add("vllm-10.0.0.1")
    dns.addresses["vllm-headless.ns.svc"] = []
    await discovery.resolve_once()
    dns.addresses["vllm-headless.ns.svc"] = ["10.0.0.1"]
    fleet.busy.clear()
    await discovery.resolve_once()
    assert fleet.events == ["join vllm-10.0.0.1", "leave vllm-10.0.0.1", "join vllm-10.0.0.1"]
    assert fleet.draining == set()


async def test_a_failed_lookup_keeps_the_engines(caplog: pytest.LogCaptureFixture) -> None:
    dns, fleet = Dns(), Fleet()
    dns.addresses["vllm-headless.ns.svc"] = ["10.0.0.1"]
    discovery = EngineDiscovery([group()], dns, fleet)
    await discovery.resolve_once()
    dns.failing = True
    with caplog.at_level(logging.WARNING):
        await discovery.resolve_once()
    assert fleet.events == ["join vllm-10.0.0.1"]
    assert discovery.failures == 1
    assert "cannot resolve vllm-headless.ns.svc" in caplog.text


async def test_static_engines_are_not_looked_up() -> None:
    dns, fleet = Dns(), Fleet()
    static = settings_from_dict({"engines": ["http://a:8000"]}).engines[0]
    discovery = EngineDiscovery([static], dns, fleet)
    await discovery.resolve_once()
    assert (dns.asked, fleet.events, discovery.groups) == ([], [], [])


def test_ipv6_addresses_and_https() -> None:
    config = group("dns+https://vllm.example/v").at_address("fd00::1")
    assert (config.name, config.url) == ("vllm-fd00::1", "https://[fd00::1]/v")
    assert group("dns+https://vllm.example").dns_host_port == ("vllm.example", 443)


async def test_the_default_resolver_answers_for_localhost() -> None:
    from proxy.engines import resolve_addresses

    assert "127.0.0.1" in await resolve_addresses("localhost", 80)
