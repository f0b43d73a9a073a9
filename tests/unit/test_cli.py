"""The command line does what it says: the serve path loads no bench module, flags
given before a ``sim`` subcommand are honoured or refused, help shows defaults in
plain text, and ``whoseturn serve`` logs where its settings came from."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
import subprocess
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from loadtests import cli as bench
from proxy import cli
from proxy.config import (
    DEFAULT_CONFIG_FILE,
    ApiKey,
    EngineConfig,
    Settings,
    load_settings,
    settings_from_dict,
)
from proxy.process.workers import worker_ids
from proxy.server import create_app
from tests.support.served import serve_app
from tests.unit.api.helpers import FakeEngines

ROOT = Path(__file__).resolve().parents[2]

SERVE_PATH = """
import sys
import proxy.cli
from proxy.server import create_app
from proxy.config import settings_from_dict
try:
    proxy.cli.build_parser().parse_args(["serve", "--help"])
except SystemExit:
    pass
create_app(settings_from_dict({"engines": ["http://127.0.0.1:8000"]}))
print(sorted(m for m in sys.modules if m == "loadtests" or m.startswith("loadtests.")))
"""


def test_serve_path_loads_no_bench_module() -> None:
    # A fresh interpreter, so this test process's own imports do not count.
    done = subprocess.run(
        [sys.executable, "-c", SERVE_PATH], capture_output=True, text=True, check=True
    )
    assert done.stdout.splitlines()[-1] == "[]", done.stdout


BENCH_PARSE = """
import sys

class DevExtrasAbsent:
    # as in an install without .[dev]: importing rich or matplotlib fails
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("rich", "matplotlib"):
            raise ImportError(name + " is not installed")
        return None

sys.meta_path.insert(0, DevExtrasAbsent())
from loadtests.cli import parse
for command, argv in [("sim", ["--port", "1"]), ("demo", []), ("probe", ["--engine", "u"]),
                      ("loadtest", ["w.yaml", "--target", "u"])]:
    parse(command, argv)
print("parsed")
"""


def test_bench_commands_parse_without_the_dev_extras() -> None:
    # The image installs the runtime dependencies only and runs `whoseturn sim`:
    # parsing any bench command must not import what only `.[dev]` brings.
    done = subprocess.run(
        [sys.executable, "-c", BENCH_PARSE], capture_output=True, text=True, check=True
    )
    assert done.stdout.splitlines()[-1] == "parsed", done.stdout


def help_of(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 0
    return capsys.readouterr().out


HELP_PAGES = [
    [],
    ["serve"],
    ["turn"],
    ["sim"],
    ["sim", "interference"],
    ["sim", "evaluate"],
    ["sim", "calibrate"],
    ["probe"],
]


@pytest.mark.parametrize("command", HELP_PAGES, ids=lambda c: " ".join(c) or "whoseturn")
def test_help_is_plain_text(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    text = help_of([*command, "--help"], capsys)
    assert "usage: whoseturn" in text
    assert "`" not in text


@pytest.mark.parametrize(
    ("command", "shown"),
    [
        ([], "(default: info)"),
        (["turn"], "(default: http://127.0.0.1:8080)"),
        (["serve"], "port (default: 8080)"),
        (["sim"], "(default: 8000)"),
        (["sim", "evaluate"], "virtual seconds (default: 600.0)"),
        (["sim", "interference"], "(default: 64)"),
        (["probe"], "measurements per size (default: 3)"),
    ],
)
def test_help_shows_defaults(
    command: list[str], shown: str, capsys: pytest.CaptureFixture[str]
) -> None:
    text = " ".join(help_of([*command, "--help"], capsys).split())
    assert shown in text


def test_serve_help_names_the_file_and_every_environment_variable(
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = "".join(help_of(["serve", "--help"], capsys).split())
    assert DEFAULT_CONFIG_FILE in text
    read = set(re.findall(r"WHOSETURN_[A-Z_]*[A-Z]", (ROOT / "proxy" / "config.py").read_text()))
    assert read, "proxy/config.py names no environment variable"
    assert read == set(cli.ENV_VARS)
    for name in read:
        assert name in text


def test_version_comes_from_the_distribution(capsys: pytest.CaptureFixture[str]) -> None:
    text = help_of(["--version"], capsys)
    assert text.strip() == f"whoseturn {metadata.version('whoseturn')}"


# --- sim: flags before a subcommand ---------------------------------------------------


@pytest.mark.parametrize("table", ["interference", "evaluate"])
def test_engine_flags_before_a_table_subcommand_are_honoured(table: str) -> None:
    args = bench.parse("sim", ["--profile", "cpu-tiny", "--max-num-seqs", "7", table])
    settings = bench.sim_settings(args)
    assert settings.profile.name == "cpu-tiny"
    assert settings.scheduler.max_num_seqs == 7


def test_a_flag_after_the_subcommand_wins() -> None:
    argv = ["--profile", "h100-llama3-8b", "interference", "--profile", "cpu-tiny"]
    assert bench.sim_settings(bench.parse("sim", argv)).profile.name == "cpu-tiny"


def test_sim_defaults_when_no_flag_is_given() -> None:
    serving = bench.sim_settings(bench.parse("sim", []))
    assert (serving.host, serving.port, serving.time_scale) == ("127.0.0.1", 8000, 1.0)
    assert serving.profile.name == "h100-llama3-8b"
    assert serving.scheduler.enable_chunked_prefill
    table = bench.sim_settings(bench.parse("sim", ["interference"]))
    assert table.port == 0
    assert table.served_model_name == table.profile.model


@pytest.mark.parametrize(
    ("argv", "refused"),
    [
        (["--port", "9000", "interference"], "--port"),
        (["--time-scale", "5", "--host", "0.0.0.0", "evaluate"], "--host, --time-scale"),
        (["--served-model-name", "tiny", "evaluate"], "--served-model-name"),
        (["--profile", "cpu-tiny", "calibrate", "--engine", "http://e"], "--profile"),
        (["--no-enable-chunked-prefill", "calibrate", "--engine", "http://e"], "--enable-"),
    ],
)
def test_flags_a_subcommand_cannot_use_are_refused(
    argv: list[str], refused: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        bench.parse("sim", argv)
    assert exit_.value.code == 2
    assert f"error: {refused}" in capsys.readouterr().err


def test_the_step_budget_before_calibrate_is_the_measured_engines() -> None:
    before = bench.parse("sim", ["--max-num-batched-tokens", "512", "calibrate", "--engine", "u"])
    assert before.max_num_batched_tokens == 512
    after = bench.parse("sim", ["calibrate", "--engine", "u", "--max-num-batched-tokens", "256"])
    assert after.max_num_batched_tokens == 256
    assert bench.parse("sim", ["calibrate", "--engine", "u"]).max_num_batched_tokens is None


def test_bench_commands_take_their_arguments_untouched() -> None:
    args = cli.build_parser().parse_args(["--log-level", "WARNING", "sim", "--port", "1", "-h"])
    assert (args.command, args.log_level, args.bench_args) == (
        "sim",
        "warning",
        ["--port", "1", "-h"],
    )


# --- serve: where the settings came from ------------------------------------------------


@pytest.fixture(autouse=True)
def any_port_is_free(monkeypatch: pytest.MonkeyPatch) -> None:
    """``serve``'s port check stands aside here: these tests name ports (8080, ...)
    that another program on the machine may hold, and run nothing on them.
    tests/unit/test_startup.py tests the check itself."""
    monkeypatch.setattr(cli, "port_free", lambda host, port: None)


class Runner:
    """Stands in for ``proxy.process.run``: records what it was asked to serve."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, settings: Settings, log_level: str) -> int:
        self.calls.append(
            {"host": settings.serving.host, "port": settings.serving.port, "log_level": log_level}
        )
        return 0


def serve_args(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(["serve", *argv])


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    for record in caplog.records:
        if record.name == cli.__name__:
            assert isinstance(record.msg, str) and "%s" in record.msg  # %-style, not f-strings
    return [r.getMessage() for r in caplog.records if r.name == cli.__name__]


def test_serve_logs_the_file_the_environment_and_what_engine_replaced(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / DEFAULT_CONFIG_FILE).write_text("port: 8123\nengines: [http://file-engine:1]\n")
    env = {"WHOSETURN_TTFT_TARGET_S": "0.25", "WHOSETURN_ENGINES": "http://secret-engine:2"}
    run = Runner()
    with caplog.at_level(logging.INFO, logger=cli.__name__):
        code = cli.serve(
            serve_args("--engine", "http://127.0.0.1:8000"), env=env, cwd=tmp_path, run=run
        )
    assert code == 0
    assert run.calls == [{"host": "127.0.0.1", "port": 8123, "log_level": "info"}]
    said = messages(caplog)
    file = tmp_path / DEFAULT_CONFIG_FILE
    assert f"settings file: {file}" in said
    assert "settings from the environment: WHOSETURN_ENGINES, WHOSETURN_TTFT_TARGET_S" in said
    assert f"--engine replaces the engine list of {file} and $WHOSETURN_ENGINES" in said
    assert (
        "OpenAI API: http://127.0.0.1:8123/v1 (batch class: http://127.0.0.1:8123/batch/v1)" in said
    )
    assert "status page: http://127.0.0.1:8123/status" in said
    assert "secret-engine" not in caplog.text and "0.25" not in caplog.text


def test_serve_says_when_no_file_was_found(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger=cli.__name__):
        cli.serve(
            serve_args("--engine", "http://e:1", "--port", "9001"),
            env={},
            cwd=tmp_path,
            run=Runner(),
        )
    said = messages(caplog)
    looked = f"no --config, no $WHOSETURN_CONFIG, no {DEFAULT_CONFIG_FILE} in {tmp_path}"
    assert f"settings file: none ({looked})" in said
    assert "settings from the environment: none" in said
    assert not any(m.startswith("--engine replaces") for m in said)
    assert "status page: http://127.0.0.1:9001/status" in said


def test_serve_reads_the_file_the_environment_names(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    named = tmp_path / "elsewhere.yaml"
    named.write_text("host: 0.0.0.0\nengines: [http://e:1]\n")
    (tmp_path / DEFAULT_CONFIG_FILE).write_text("port: 1\n")
    run = Runner()
    with caplog.at_level(logging.INFO, logger=cli.__name__):
        cli.serve(serve_args(), env={"WHOSETURN_CONFIG": str(named)}, cwd=tmp_path, run=run)
    assert run.calls[0]["host"] == "0.0.0.0" and run.calls[0]["port"] == 8080
    assert f"settings file: {named}" in messages(caplog)


def test_a_bad_setting_is_an_error_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / DEFAULT_CONFIG_FILE).write_text("prot: 8080\n")
    assert cli.main(["serve", "--engine", "http://e:1"]) == 2
    assert "prot" in capsys.readouterr().err


# --- the example settings file ----------------------------------------------------------


def test_the_example_file_lists_each_setting_under_its_section() -> None:
    sections: dict[str, list[str]] = {}
    for line in (ROOT / "whoseturn.example.yaml").read_text().splitlines():
        if header := re.match(r"# --- (\w+):", line):
            current = sections.setdefault(header[1], [])
        elif (key := re.match(r"(\w+):", line)) and key[1] not in ("engines", "cards"):
            current.append(key[1])
    settings = Settings(engines=())
    expected = {
        name: [
            f"{type(getattr(settings, name)).PREFIX}{f.name}"
            for f in dataclasses.fields(getattr(settings, name))
        ]
        for name in (f.name for f in dataclasses.fields(Settings))
        if name not in ("engines", "cards")
    }
    assert sections == expected


def test_the_example_file_is_valid_and_names_every_setting() -> None:
    path = ROOT / "whoseturn.example.yaml"
    settings = load_settings(str(path), env={}, cwd=ROOT)
    assert settings == load_settings(None, {"engines": ["http://127.0.0.1:8000"]}, env={})
    data = yaml.safe_load(path.read_text())
    assert set(data) == {"engines", "cards", *settings.keys()}
    assert set(data["engines"][0]) == {f.name for f in dataclasses.fields(EngineConfig)}
    for line in path.read_text().splitlines():
        if re.match(r"\s*-?\s*\w+:", line):
            assert "#" in line, f"setting without a comment: {line!r}"


# --- the README's hand-run commands agree with its advice and with `make sim` -------------


def sim_command_line(text: str) -> list[str]:
    """The arguments after ``whoseturn sim`` on the first line of ``text`` that runs it."""
    line = next(line for line in text.splitlines() if re.search(r"whoseturn sim --", line))
    return line.split("whoseturn sim", 1)[1].split("#")[0].split()


def test_the_readme_and_make_sim_run_the_engine_the_examples_use() -> None:
    readme = (ROOT / "README.md").read_text()
    make = (ROOT / "Makefile").read_text()
    by_hand = bench.sim_settings(bench.parse("sim", sim_command_line(readme)))
    make_sim = make.split("\nsim:", 1)[1]
    assert bench.sim_settings(bench.parse("sim", sim_command_line(make_sim))) == by_hand
    assert by_hand.port == 8000
    models = set(re.findall(r'"model": "([^"]+)"|model="([^"]+)"', readme))
    assert {m for pair in models for m in pair if m} == {by_hand.served_model_name}
    threshold = by_hand.scheduler.long_prefill_token_threshold
    assert f"--long-prefill-token-threshold {threshold}" in readme
    assert f"{threshold} for the tiny" in readme


# --- serve --workers --------------------------------------------------------------------


def test_serve_workers_without_a_database_share_files_in_the_data_directory(
    tmp_path: Path,
) -> None:
    """``--workers 2`` and nothing else: the workers share each engine's budget in a
    SQLite ledger and the Batch API's SQLite store, both in the data directory."""
    seen: list[Settings] = []

    def run(settings: Settings, log_level: str) -> int:
        seen.append(settings)
        return 0

    env = {"XDG_DATA_HOME": str(tmp_path / "xdg")}
    args = serve_args("--engine", "http://e:1", "--workers", "2")
    assert cli.serve(args, env=env, cwd=tmp_path, run=run) == 0
    data = tmp_path / "xdg" / "whoseturn"
    (settings,) = seen
    assert settings.replicas.workers == 2 and not settings.replicas.ledger_dsn
    assert settings.replicas.ledger_path == str(data / "ledger.sqlite3")
    assert settings.batch.on and settings.batch.store_path == str(data / "batch.sqlite3")


def test_serve_workers_flag_reaches_the_settings(tmp_path: Path) -> None:
    seen: list[Settings] = []

    def run(settings: Settings, log_level: str) -> int:
        seen.append(settings)
        return 0

    env = {"WHOSETURN_LEDGER_DSN": "postgresql://l@127.0.0.1/w", "WHOSETURN_WORKERS": "3"}
    cli.serve(serve_args("--engine", "http://e:1"), env=env, cwd=tmp_path, run=run)
    cli.serve(
        serve_args("--engine", "http://e:1", "--workers", "2"), env=env, cwd=tmp_path, run=run
    )
    assert [s.replicas.workers for s in seen] == [3, 2]


def test_each_worker_is_a_replica_of_its_own() -> None:
    base = {"engines": ["http://e:1"], "workers": 3, "ledger_dsn": "postgresql://l@h/w"}
    assert worker_ids(settings_from_dict(base), "host-1-ab") == [
        "host-1-ab-w0",
        "host-1-ab-w1",
        "host-1-ab-w2",
    ]
    named = settings_from_dict({**base, "replica_id": "edge"})
    assert worker_ids(named, "host-1-ab") == ["edge-w0", "edge-w1", "edge-w2"]


# --- serve: the Batch API on by default, and where ------------------------------------------


def test_serve_names_the_batch_store_it_uses(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[Settings] = []

    def run(settings: Settings, log_level: str) -> int:
        seen.append(settings)
        return 0

    env = {"XDG_DATA_HOME": str(tmp_path / "xdg")}
    with caplog.at_level(logging.INFO, logger=cli.__name__):
        cli.serve(serve_args("--engine", "http://e:1"), env=env, cwd=tmp_path, run=run)
        cli.serve(
            serve_args("--engine", "http://e:1", "--data-dir", str(tmp_path / "flag")),
            env=env,
            cwd=tmp_path,
            run=run,
        )
    default = tmp_path / "xdg" / "whoseturn" / "batch.sqlite3"
    flagged = tmp_path / "flag" / "batch.sqlite3"
    assert [s.batch.store_path for s in seen] == [str(default), str(flagged)]
    said = messages(caplog)
    assert f"batch API on: SQLite at {default}" in said
    assert f"batch API on: SQLite at {flagged}" in said


def test_serve_says_when_the_batch_api_is_off_and_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger=cli.__name__):
        env = {"WHOSETURN_BATCH_STORE": "off"}
        cli.serve(serve_args("--engine", "http://e:1"), env=env, cwd=tmp_path, run=Runner())
    said = messages(caplog)
    assert "batch API off (batch_store: off); batch_store: sqlite turns it on" in said


def test_serve_logs_a_postgres_store_without_its_password(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    env = {
        "WHOSETURN_BATCH_STORE": "postgres",
        "WHOSETURN_BATCH_DSN": "postgresql://jobs:hunter2@db.internal:5432/jobs",
    }
    with caplog.at_level(logging.INFO, logger=cli.__name__):
        cli.serve(serve_args("--engine", "http://e:1"), env=env, cwd=tmp_path, run=Runner())
    (line,) = [m for m in messages(caplog) if m.startswith("batch API")]
    assert line.startswith("batch API on: PostgreSQL at ") and "db.internal" in line
    assert "hunter2" not in caplog.text


# --- turn: a proxy that has keys ------------------------------------------------------------

READ_KEY = "sk-dashboard"


@pytest.fixture
def keyed_proxy() -> Iterator[str]:
    """A proxy with API keys (one of them a read key) on a loopback port."""
    engines = FakeEngines()
    settings = engines.settings(api_keys=(ApiKey(key=READ_KEY, role="read"), "sk-user"))
    app = create_app(settings, transport=httpx.MockTransport(engines))
    with serve_app(app, "the proxy") as (base_url, _):
        yield base_url


def test_turn_sends_the_key_as_a_bearer_token(
    keyed_proxy: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(cli.API_KEY_VAR, raising=False)
    assert cli.main(["turn", "--proxy", keyed_proxy, "--key", READ_KEY]) == 0
    assert capsys.readouterr().out.startswith("a: ")  # engine a's sentence, as text
    monkeypatch.setenv(cli.API_KEY_VAR, READ_KEY)
    assert cli.main(["turn", "--proxy", keyed_proxy]) == 0
    assert capsys.readouterr().out.startswith("a: ")


def test_turn_without_a_key_says_to_pass_one(
    keyed_proxy: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(cli.API_KEY_VAR, raising=False)
    assert cli.main(["turn", "--proxy", keyed_proxy]) == 1
    err = capsys.readouterr().err
    assert err == (
        f"whoseturn: {keyed_proxy} asks for an API key (401): pass one with --key KEY "
        f"(or set ${cli.API_KEY_VAR})\n"
    )
    assert cli.main(["turn", "--proxy", keyed_proxy, "--key", "sk-wrong"]) == 1
    assert "refused the key (401): pass a key the proxy has with --key" in capsys.readouterr().err
