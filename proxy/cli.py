"""The whoseturn command line: ``serve`` and ``turn`` here, the bench's commands
(``sim``, ``probe``, ``demo``, ``loadtest``) in ``loadtests.cli``, imported only when
one of them runs. ``serve`` hands the loaded settings to :func:`proxy.process.run`,
which runs the proxy's processes (:mod:`proxy.process`).

:func:`main` takes the arguments (default ``sys.argv[1:]``) and returns the exit
status. ``whoseturn serve`` fails fast: a bad setting (every one, at once) or a port
already in use stops it before any part of the proxy starts; then it logs where its
settings came from, where it answers and where the Batch API keeps its jobs.
:func:`serve` takes the environment, the working directory, the server runner and
the port check as arguments, so tests pass their own. ``whoseturn turn`` sends an
API key (``--key``, ``$WHOSETURN_API_KEY``) to a proxy that asks for one.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from proxy.config import DEFAULT_CONFIG_FILE, ConfigError
from proxy.help_format import Parser
from proxy.logs import LOG_LEVELS, configure_logging

if TYPE_CHECKING:
    from proxy.config import Settings

_log = logging.getLogger(__name__)

ENV_VARS = (
    "WHOSETURN_CONFIG",
    "WHOSETURN_ENGINES",
    "WHOSETURN_HOST",
    "WHOSETURN_PORT",
    "WHOSETURN_TTFT_TARGET_S",
    "WHOSETURN_GAP_TARGET_S",
    "WHOSETURN_MAX_BODY_BYTES",
    "WHOSETURN_FIRST_BYTE_TIMEOUT_S",
    "WHOSETURN_IDLE_TIMEOUT_S",
    "WHOSETURN_DRAIN_TIMEOUT_S",
    "WHOSETURN_MAX_BODY_BYTES_IN_FLIGHT",
    "WHOSETURN_HEADER_TIMEOUT_S",
    "WHOSETURN_BODY_TIMEOUT_S",
    "WHOSETURN_MAX_INCOMPLETE_CONNECTIONS",
    "WHOSETURN_DNS_INTERVAL_S",
    "WHOSETURN_LEDGER_DSN",
    "WHOSETURN_LEDGER_PATH",
    "WHOSETURN_REPLICA_ID",
    "WHOSETURN_WORKERS",
    "WHOSETURN_BATCH_STORE_PATH",
    "WHOSETURN_DATA_DIR",
    "WHOSETURN_BATCH_MIN_SHARE",
    "WHOSETURN_HOLD_TIMEOUT_S",
    "WHOSETURN_BATCH_ABORT",
    "WHOSETURN_BATCH_ABORT_MAX",
    "WHOSETURN_BATCH_STORE",
    "WHOSETURN_BATCH_DSN",
    "WHOSETURN_FAIR_SHARE",
)
"""The environment variables the proxy's settings read (``proxy.config``)."""

API_KEY_VAR = "WHOSETURN_API_KEY"
"""The API key the commands that talk to a proxy send when ``--key`` is not given."""

BENCH_COMMANDS = {
    "sim": "run the simulated vLLM-compatible engine, or its tables in virtual time "
    "(interference, evaluate) or its calibration against an engine (calibrate)",
    "probe": "tell from outside whether an engine interleaves prefill with decode",
    "demo": "chat beside a batch job on two simulated engines, direct and through the "
    "proxy: the side-by-side table and a report",
    "loadtest": "a workload file against a proxy and, with --direct, against its engines",
}
"""The test bench's commands, run by ``loadtests.cli``."""

SERVE_EPILOG = f"""Settings come from a YAML file, then the environment, then these flags.
The file is --config FILE, else $WHOSETURN_CONFIG, else {DEFAULT_CONFIG_FILE} in the
working directory if there is one (whoseturn.example.yaml in the repository shows
every setting). Environment: {", ".join(ENV_VARS)} (WHOSETURN_ENGINES: comma-separated
URLs). --engine replaces the engine list of the file and the environment."""


def build_parser() -> Parser:
    """The ``whoseturn`` parser. ``sim`` and ``probe`` only collect their arguments
    here; ``loadtests.cli`` parses them."""
    parser = Parser(
        prog="whoseturn",
        description="A scheduling-aware reverse proxy for LLM serving that says whose "
        "turn it is. Also: python -m proxy.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument(
        "--log-level", default="info", type=str.lower, choices=LOG_LEVELS, help="logging level"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve_parser(commands)
    turn = commands.add_parser(
        "turn",
        help="print whose turn it is, one sentence per engine",
        description="Ask a running proxy's /turn whose turn it is on each engine, and why.",
    )
    turn.add_argument("--proxy", default="http://127.0.0.1:8080", help="the proxy's base URL")
    turn.add_argument(
        "--key",
        default=None,
        metavar="KEY",
        help=f"an API key of the proxy (a read key is enough), sent as a bearer token "
        f"(default: ${API_KEY_VAR}; none if unset)",
    )
    for name, text in BENCH_COMMANDS.items():
        # Everything after the command goes to loadtests.cli untouched, options
        # included: no prefix character of this parser matches them.
        bench = commands.add_parser(name, help=text, add_help=False, prefix_chars="\0")
        bench.add_argument("bench_args", nargs=argparse.REMAINDER, metavar="...")
    return parser


def _add_serve_parser(commands: argparse._SubParsersAction[Parser]) -> None:
    serve = commands.add_parser(
        "serve",
        help="run the proxy in front of engines",
        description="Run the proxy: OpenAI-compatible chat on /v1, batch work on "
        "/batch/v1, whose turn it is on /turn and /status, metrics on /metrics.",
        epilog=SERVE_EPILOG,
    )
    serve.add_argument(
        "--engine",
        action="append",
        default=None,
        metavar="URL",
        help="an engine's base URL, or dns+http://NAME:PORT for one engine per address "
        "NAME resolves to (repeat for several)",
    )
    serve.add_argument("--config", default=None, metavar="FILE", help="YAML settings file")
    serve.add_argument(
        "--host", default=None, metavar="ADDRESS", help="address to listen on (default: 127.0.0.1)"
    )
    serve.add_argument("--port", type=int, default=None, metavar="N", help="port (default: 8080)")
    for flag, dest, what in (
        ("--ttft-target", "ttft_target_s", "time-to-first-token target (default: 0.3)"),
        ("--gap-target", "gap_target_s", "inter-token gap target (default: 0.1)"),
    ):
        serve.add_argument(
            flag, type=float, default=None, dest=dest, metavar="SECONDS", help=f"interactive {what}"
        )
    serve.add_argument(
        "--data-dir",
        default=None,
        metavar="DIR",
        help="where the proxy keeps its data, the Batch API's SQLite store among it "
        "(default: $XDG_DATA_HOME/whoseturn, else ~/.local/share/whoseturn)",
    )
    serve.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="worker processes on one port, each a replica sharing the budget through "
        "the ledger (ledger_dsn, else a SQLite file in the data directory) (default: 1)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``whoseturn ARGV...``; the exit status."""
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    if args.command in BENCH_COMMANDS:
        from loadtests.cli import main as bench_main

        return bench_main(args.command, args.bench_args)
    if args.command == "turn":
        return turn(args.proxy, args.key or os.environ.get(API_KEY_VAR) or None)
    try:
        return serve(args)
    except ValueError as exc:  # ConfigError names the bad key
        print(f"whoseturn: error: {exc}", file=sys.stderr)
        return 2


def serve(
    args: argparse.Namespace,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    run: Callable[[Settings, str], int] | None = None,
    check_port: Callable[[str, int], None] | None = None,
) -> int:
    """``whoseturn serve``: load the settings, check the port is free, log where they
    came from, run the proxy until SIGTERM and its drain; the exit status.

    ``run(settings, log_level)`` runs the proxy (default :func:`proxy.process.run`,
    after :func:`make_data_dir`); ``check_port(host, port)`` raises
    :class:`ConfigError` if the proxy could not listen there (default
    :func:`port_free`). The check comes first because uvicorn binds only after the
    app's startup: without it a port in use would be reported after the engines were
    probed and the batch store opened.
    """
    from proxy.config import load_settings

    env = os.environ if env is None else env
    cwd = Path.cwd() if cwd is None else cwd
    file = settings_file(args.config, env, cwd)
    overrides = {
        "engines": [{"url": u} for u in args.engine] if args.engine else None,
        "host": args.host,
        "port": args.port,
        "ttft_target_s": args.ttft_target_s,
        "gap_target_s": args.gap_target_s,
        "workers": args.workers,
        "data_dir": args.data_dir,
    }
    settings = load_settings(str(file) if file else None, overrides, env=env, cwd=cwd)
    (check_port or port_free)(settings.serving.host, settings.serving.port)
    log_sources(file, env, engines_given=bool(args.engine), cwd=cwd)
    log_addresses(settings)
    log_batch(settings)
    if run is None:
        from proxy.process import run as run_processes  # uvicorn and the app: only here

        make_data_dir(settings)
        run = run_processes
    return run(settings, args.log_level)


def settings_file(config: str | None, env: Mapping[str, str], cwd: Path) -> Path | None:
    """The settings file the proxy reads: ``--config``, else ``$WHOSETURN_CONFIG``,
    else ``whoseturn.yaml`` in ``cwd`` if it exists, else None."""
    name = config or env.get("WHOSETURN_CONFIG")
    if name:
        return Path(name)
    default = cwd / DEFAULT_CONFIG_FILE
    return default if default.exists() else None


def log_sources(
    file: Path | None, env: Mapping[str, str], *, engines_given: bool, cwd: Path
) -> None:
    """Log, at info, where the settings came from: the file or none, the environment
    variables read (names only: values may be keys), what ``--engine`` replaced."""
    if file is not None:
        _log.info("settings file: %s", file)
    else:
        _log.info(
            "settings file: none (no --config, no $WHOSETURN_CONFIG, no %s in %s)",
            DEFAULT_CONFIG_FILE,
            cwd,
        )
    used = [name for name in ENV_VARS if name in env]
    _log.info("settings from the environment: %s", ", ".join(used) or "none")
    if not engines_given:
        return
    replaced = [f"${name}" for name in ("WHOSETURN_ENGINES",) if env.get(name)]
    if file is not None and _has_engines(file):
        replaced.insert(0, f"the engine list of {file}")
    if replaced:
        _log.info("--engine replaces %s", " and ".join(replaced))


def _has_engines(file: Path) -> bool:
    import yaml

    try:
        data = yaml.safe_load(file.read_text())
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(data, dict) and bool(data.get("engines"))


def log_addresses(settings: Settings) -> None:
    """Log, at info, the URLs of the API and of the status page."""
    host = f"[{settings.serving.host}]" if ":" in settings.serving.host else settings.serving.host
    base = f"http://{host}:{settings.serving.port}"
    _log.info("OpenAI API: %s/v1 (batch class: %s/batch/v1)", base, base)
    _log.info("status page: %s/status", base)


def port_free(host: str, port: int) -> None:
    """Raise :class:`ConfigError` naming the port and the flag to change it if the
    proxy could not listen on ``host``:``port`` now. Bound as uvicorn binds
    (``SO_REUSEADDR``, so a port whose last connections linger in TIME_WAIT is free),
    then closed again."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            why = (
                f"{host}:{port} is already in use (another whoseturn, or another "
                f"server?): stop it, or choose another port with --port N"
            )
        elif exc.errno == errno.EACCES:
            why = f"{host}:{port}: permission denied; choose a port above 1023 with --port N"
        else:
            reason = exc.strerror or str(exc)
            why = f"cannot listen on {host}:{port}: {reason}; check --host and --port"
        raise ConfigError("port", why) from None


def make_data_dir(settings: Settings) -> None:
    """Create the SQLite batch store's directory if missing, so that one that cannot
    be made stops the start here, naming it and the flag, rather than in the app's
    startup after the engines were probed."""
    batch = settings.batch
    if not (batch.on and batch.store == "sqlite"):
        return
    folder = Path(batch.store_path).parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            "data_dir",
            f"cannot create {folder}: {exc.strerror or exc}; choose another with --data-dir "
            f"DIR (or WHOSETURN_DATA_DIR), or turn the Batch API off with batch_store: off",
        ) from None


def log_batch(settings: Settings) -> None:
    """Log, at info, whether the Batch API is on and where it keeps its jobs (never
    the DSN's password), or why it is off and how to turn it on."""
    batch = settings.batch
    if batch.on and batch.store == "sqlite":
        _log.info("batch API on: SQLite at %s", batch.store_path)
    elif batch.on:
        from proxy.batch.postgres import redacted  # psycopg: only with its store

        _log.info("batch API on: PostgreSQL at %s", redacted(batch.dsn))
    else:
        _log.info("batch API off (batch_store: %s); batch_store: sqlite turns it on", batch.store)


def turn(proxy: str, key: str | None) -> int:
    """``whoseturn turn``: print the proxy's ``/turn`` as text; the exit status. ``key``
    is sent as a bearer token; a proxy that refuses the call is told apart from one
    that cannot be reached, with the flag that fixes it."""
    import httpx

    headers = {"authorization": f"Bearer {key}"} if key else {}
    url = f"{proxy.rstrip('/')}/turn"
    try:
        response = httpx.get(url, params={"format": "text"}, headers=headers, timeout=5)
    except httpx.HTTPError as exc:
        print(f"whoseturn: cannot ask {proxy}: {exc}", file=sys.stderr)
        return 1
    if response.status_code in (401, 403):
        print(f"whoseturn: {proxy} {_refusal(response.status_code, key)}", file=sys.stderr)
        return 1
    if response.is_error:
        print(f"whoseturn: {proxy} answered {response.status_code}", file=sys.stderr)
        return 1
    print(response.text, end="")
    return 0


def _refusal(status: int, key: str | None) -> str:
    """What a 401 or 403 from the proxy means for the caller, and what to do."""
    if status == 403:
        return "refused the key (403): it may not read /turn; use a key with role read or user"
    if key:
        return f"refused the key (401): pass a key the proxy has with --key (or ${API_KEY_VAR})"
    return f"asks for an API key (401): pass one with --key KEY (or set ${API_KEY_VAR})"


def _version() -> str:
    try:
        return metadata.version("whoseturn")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"
