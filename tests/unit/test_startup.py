"""A start that fails fast and says what is true: a port in use stops ``whoseturn
serve`` before any part of the proxy starts; the Batch API works with no settings
at all, its SQLite store in the data directory; the line that says how an engine
chunks advises only the engine flags it does not show."""

from __future__ import annotations

import argparse
import functools
import json
import logging
import socket
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import pytest

from proxy import cli
from proxy.config import ConfigError, Settings, settings_from_dict
from proxy.server import create_app
from tests.support.polling import wait_until
from tests.unit.api.helpers import CHAT, MESSAGES, FakeEngines
from tests.unit.api.test_piece_sender import SteppingEngines, post, running, settings

pytestmark = pytest.mark.timeout(20)


class Runner:
    """Stands in for ``proxy.process.run``: notes the settings it was asked to serve."""

    def __init__(self) -> None:
        self.served: list[Settings] = []

    def __call__(self, settings: Settings, log_level: str) -> int:
        self.served.append(settings)
        return 0


def serve_args(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(["serve", "--engine", "http://e:1", *argv])


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A loopback port another server listens on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        yield other.getsockname()[1]


# -- the port ---------------------------------------------------------------------------------


def test_a_port_in_use_stops_serve_before_anything_runs(tmp_path: Path, taken_port: int) -> None:
    run = Runner()
    with pytest.raises(ConfigError) as caught:
        cli.serve(serve_args("--port", str(taken_port)), env={}, cwd=tmp_path, run=run)
    assert run.served == []  # nothing started: no app, no engine probed, no batch store
    assert caught.value.where == "port"
    assert caught.value.why == (
        f"127.0.0.1:{taken_port} is already in use (another whoseturn, or another "
        f"server?): stop it, or choose another port with --port N"
    )


def test_the_port_check_comes_after_the_settings_are_checked(
    tmp_path: Path, taken_port: int
) -> None:
    env = {"WHOSETURN_TTFT_TARGET_S": "fast"}
    with pytest.raises(ConfigError, match=r"^WHOSETURN_TTFT_TARGET_S: cannot read"):
        cli.serve(serve_args("--port", str(taken_port)), env=env, cwd=tmp_path, run=Runner())


def test_a_free_port_passes_and_stays_free(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    run = Runner()
    assert cli.serve(serve_args("--port", str(port)), env={}, cwd=tmp_path, run=run) == 0
    assert [s.serving.port for s in run.served] == [port]
    cli.port_free("127.0.0.1", port)  # the check let go of the port


def test_main_says_the_port_is_in_use_and_exits_2(
    taken_port: int, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli, "serve", functools.partial(cli.serve, run=Runner()))
    assert cli.main(["serve", "--engine", "http://e:1", "--port", str(taken_port)]) == 2
    err = capsys.readouterr().err
    assert f"whoseturn: error: port: 127.0.0.1:{taken_port} is already in use" in err
    assert "--port N" in err


# -- the data directory -------------------------------------------------------------------------


def test_a_data_dir_that_cannot_be_made_stops_the_start_naming_the_flag(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    settings = settings_from_dict({"engines": ["http://e:1"], "data_dir": str(blocker / "d")})
    with pytest.raises(ConfigError) as caught:
        cli.make_data_dir(settings)
    assert caught.value.where == "data_dir"
    assert f"cannot create {blocker / 'd'}" in caught.value.why
    assert "--data-dir DIR" in caught.value.why and "batch_store: off" in caught.value.why


def test_the_data_dir_is_made_where_missing(tmp_path: Path) -> None:
    settings = settings_from_dict({"engines": ["http://e:1"], "data_dir": str(tmp_path / "x/y")})
    cli.make_data_dir(settings)
    assert (tmp_path / "x" / "y").is_dir()


@pytest.mark.anyio
async def test_with_no_settings_the_batch_api_answers_from_the_data_dir(tmp_path: Path) -> None:
    engines = FakeEngines()
    engine = {"url": engines.url("a"), "name": "a", "models": ["m"]}
    settings = settings_from_dict({"engines": [engine]}, env={"XDG_DATA_HOME": str(tmp_path)})
    app = create_app(settings, transport=httpx.MockTransport(engines))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            line = json.dumps(
                {
                    "custom_id": "q",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {"model": "m", "messages": MESSAGES, "max_tokens": 3},
                }
            ).encode()
            files = {"file": ("in.jsonl", line)}
            uploaded = await client.post("/v1/files", files=files, data={"purpose": "batch"})
            listed = await client.get("/v1/files")
    assert uploaded.status_code == 200, uploaded.text
    assert [f["id"] for f in listed.json()["data"]] == [uploaded.json()["id"]]
    assert (tmp_path / "whoseturn" / "batch.sqlite3").is_file()


# -- what the piecing line advises ------------------------------------------------------------


async def judged_line(engines: SteppingEngines, caplog: pytest.LogCaptureFixture) -> str:
    """The line that says what the first piece beside a chat stream showed of the
    engine's own chunking."""
    engines.generate = engines.step
    with caplog.at_level(logging.INFO, logger="proxy.api.piece_sender"):
        async with (
            running(settings(engines, "auto"), engines) as (client, state),
            anyio.create_task_group() as group,
        ):
            body = {"model": "m", "messages": MESSAGES, "max_tokens": 30, "stream": True}
            group.start_soon(functools.partial(client.post, CHAT, json=body))
            await wait_until(lambda: state.admission.interactive_streams("a") == 1)
            assert (await post(client)).status_code == 200
            await engines.stream.end()
    (line,) = [r.getMessage() for r in caplog.records if "stalled a chat" in r.getMessage()]
    return line


@pytest.mark.anyio
async def test_a_piece_in_one_step_advises_the_threshold_below_its_size_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # vLLM started with --long-prefill-token-threshold 1024: a 512-token piece fits
    # in one step of it. The engine reports cached tokens in its answers.
    line = await judged_line(SteppingEngines(threshold=1024), caplog)
    assert line.startswith("engine a: pieces while chat is live: a 512-token piece of ")
    assert (
        "So vLLM runs without --long-prefill-token-threshold, or with one of 512 or more; "
        "one below 512 (say 256) would let it interleave long prefills with decode by "
        "itself, and the proxy would send prompts whole (no extra requests)."
    ) in line
    assert "--enable-prompt-tokens-details" not in line  # its answers show it is on


@pytest.mark.anyio
async def test_the_cached_tokens_flag_is_advised_where_answers_lack_them(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engines = SteppingEngines()
    engines.report_cached = False
    engines.export_hits = True
    line = await judged_line(engines, caplog)
    assert "--enable-prompt-tokens-details would let the proxy check" in line


@pytest.mark.anyio
async def test_an_engine_that_chunks_itself_is_advised_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    line = await judged_line(SteppingEngines(threshold=256), caplog)
    assert line.startswith("engine a: chunks long prefills itself")
    assert "--long-prefill-token-threshold" not in line
    assert "--enable-prompt-tokens-details" not in line
