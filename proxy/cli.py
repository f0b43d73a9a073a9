"""The whoseturn command line: ``serve`` and ``turn`` here, the bench's commands
(``sim``, ``probe``, ``demo``, ``loadtest``) in ``loadtests.cli``, imported only when
one of them runs. ``serve`` hands the loaded settings to :func:`proxy.process.run`,
which runs the proxy's processes (:mod:`proxy.process`).

:func:`main` takes the arguments (default ``sys.argv[1:]``) and returns the exit
status. ``whoseturn serve`` logs at start where its settings came from and where it
answers; :func:`serve` takes the environment, the working directory and the server
runner as arguments, so tests pass their own.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from proxy.config import DEFAULT_CONFIG_FILE
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
    "WHOSETURN_REPLICA_ID",
    "WHOSETURN_WORKERS",
    "WHOSETURN_BATCH_STORE_PATH",
    "WHOSETURN_BATCH_MIN_SHARE",
    "WHOSETURN_HOLD_TIMEOUT_S",
    "WHOSETURN_BATCH_ABORT",
    "WHOSETURN_BATCH_ABORT_MAX",
    "WHOSETURN_BATCH_STORE",
    "WHOSETURN_BATCH_DSN",
    "WHOSETURN_FAIR_SHARE",
)
"""The environment variables the proxy's settings read (``proxy.config``)."""

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
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="worker processes on one port, each a replica sharing the budget through "
        "ledger_dsn, which N > 1 needs (default: 1)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``whoseturn ARGV...``; the exit status."""
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    if args.command in BENCH_COMMANDS:
        from loadtests.cli import main as bench_main

        return bench_main(args.command, args.bench_args)
    if args.command == "turn":
        return _turn(args.proxy)
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
) -> int:
    """``whoseturn serve``: load the settings, log where they came from, run the proxy
    until SIGTERM and its drain; the exit status.

    ``run(settings, log_level)`` runs the proxy (default :func:`proxy.process.run`).
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
    }
    settings = load_settings(str(file) if file else None, overrides, env=env, cwd=cwd)
    log_sources(file, env, engines_given=bool(args.engine), cwd=cwd)
    log_addresses(settings)
    if run is None:
        from proxy.process import run as run_processes  # uvicorn and the app: only here

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


def _turn(proxy: str) -> int:
    import httpx

    try:
        response = httpx.get(f"{proxy.rstrip('/')}/turn", params={"format": "text"}, timeout=5)
        response.raise_for_status()
    except httpx.HTTPError as exc:
        print(f"whoseturn: cannot ask {proxy}: {exc}", file=sys.stderr)
        return 1
    print(response.text, end="")
    return 0


def _version() -> str:
    try:
        return metadata.version("whoseturn")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"
