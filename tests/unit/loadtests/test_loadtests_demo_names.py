"""The demo's engines have one name each: the proxy is configured with the names the
report uses. The timeline plot's legend is the proxy's ``/turn``, which names the
engines as its config does; the report's tables name the servers watched. No process
is started here: the servers are stand-ins that only say where they would listen."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from loadtests.demo import setup
from loadtests.support.processes import ServeCommand


@dataclass
class StandIn:
    """A server that was never started: its URL and command only."""

    url: str
    command: list[str]
    waited: list[str] = field(default_factory=list)

    def wait_ready(self, path: str, *, what: str, timeout_s: float = 30.0) -> None:
        self.waited.append(path)


@pytest.fixture
def stand_ins(monkeypatch: pytest.MonkeyPatch) -> list[StandIn]:
    made: list[StandIn] = []

    @contextmanager
    def serving(command: ServeCommand, **_: Any) -> Iterator[StandIn]:
        port = 9000 + len(made)
        made.append(StandIn(f"http://127.0.0.1:{port}", command(port=port)))
        yield made[-1]

    monkeypatch.setattr(setup, "serving", serving)
    return made


def test_the_proxy_names_the_engines_as_the_report_does(
    tmp_path: Path, stand_ins: list[StandIn]
) -> None:
    with setup.servers(tmp_path, "proxy", engines=2, time_scale=1.0, via_proxy=True) as s:
        watched = s.watched()
    config = yaml.safe_load((tmp_path / "proxy.yaml").read_text())
    in_the_proxy = {e["name"]: e["url"] for e in config["engines"]}
    assert in_the_proxy == {name: url for name, url in watched.items() if name != "proxy"}
    assert list(watched) == ["engine-0", "engine-1", "proxy"]
    assert watched["proxy"] == stand_ins[-1].url
    assert [s.waited for s in stand_ins] == [["/health"], ["/health"], ["/readyz"]]


def test_both_arms_name_the_engines_alike(tmp_path: Path, stand_ins: list[StandIn]) -> None:
    with setup.servers(tmp_path, "direct", engines=2, time_scale=1.0, via_proxy=False) as d:
        direct = d.watched()
    with setup.servers(tmp_path, "proxy", engines=2, time_scale=1.0, via_proxy=True) as p:
        proxied = p.watched()
    assert list(direct) == ["engine-0", "engine-1"]
    assert [n for n in proxied if n != "proxy"] == list(direct)
