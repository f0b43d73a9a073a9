"""The proxy's settings: YAML file, then ``WHOSETURN_*`` environment, then flags.

Everything is validated when loaded, with an error that names the bad key, so a
typo stops the proxy at start rather than at the first request; every error is
reported at once (one :class:`ConfigError` listing them), an unknown key with the
known key it is closest to. The file's keys are flat; :class:`Settings` holds them
in the sections ``whoseturn.example.yaml`` groups them in (``batch_store_path`` is
``settings.batch.store_path``). Example file::

    port: 8080
    ttft_target_s: 0.3            # interactive TTFT target (the budget loop aims below)
    gap_target_s: 0.1             # interactive inter-token gap target (p95)
    class_override: true          # X-Whoseturn-Class: true (anyone), false, a list of keys;
                                  # unset: anyone without api_keys, else keys that allow it
    fair_share: true              # within a class, tenants served by weighted fair share;
                                  # false: arrival order (docs/security.md, tenants)
    api_keys:                     # unset: no key needed; see docs/security.md
      - sk-plain-key              # a plain key: role user, no class override
      - {key: sk-dash, role: read}                  # reads only: /metrics, /turn, ...
      - {key: sk-pipe, classes: [batch], class_override: false}
      - key_file: /run/secrets/team-a             # the secret read from a file ...
        tenant: team-a            # its tenant (default: key- and a hash of the key)
        weight: 2                 # its share of a class against other tenants'
        tier: critical            # critical, standard or sheddable
        limits: {requests_per_minute: 600, tokens_per_minute: 200000, streams: 32}
      - {key_env: TEAM_B_KEY, tenant: team-b}       # ... or from the environment
    max_body_bytes: 8388608       # larger request bodies are refused with 413
    max_body_bytes_in_flight: 67108864  # all bodies held at once; beyond: 503, Retry-After
    header_timeout_s: 10          # a connection must send complete request headers by then
    body_timeout_s: 30            # the longest wait for the next bytes of a body (then 408)
    max_incomplete_connections: 1024  # beyond, the oldest incomplete connection is closed
    first_byte_timeout_s: 60      # an engine's answer must begin (headers, first chunk)
    idle_timeout_s: 30            # then no silence longer than this between chunks
    outlier_consecutive_errors: 5 # failed requests in a row that eject an engine
    health_timeout_s: 5           # a health check must answer within this; 2 failed in a
                                  # row (unhealthy_after) eject the engine, and requests
                                  # waiting for its answer go to another
    drain_timeout_s: 30           # on SIGTERM, in-flight requests get this long to finish
    batch_min_share: 0.05         # batch keeps about this share of each engine's prefill
    hold_timeout_s: 10            # a chat in prefill longer than this stops holding batch
    batch_abort: auto             # off / on: abort a batch request in prefill for a chat
    batch_abort_max: 3            # the most aborts of one batch request
    dns_interval_s: 5             # DNS groups of engines (dns+http://...) resolved again
    ledger_dsn: postgresql://...  # several replicas share each engine's budget
                                  # (docs/replicas.md); unset: this replica alone
    workers: 1                    # processes on one port, each a replica; they share
                                  # each engine's budget through ledger_path
    ledger_path: DATA_DIR/ledger.sqlite3  # the ledger of one box's replicas (no server)
    data_dir: ~/.local/share/whoseturn  # the default batch store lives here
    batch_store: sqlite           # the Batch API's store: sqlite, postgres, or off
    engines:
      - url: http://127.0.0.1:8000  # the engine's base URL: no /v1 (the proxy adds it)
        name: engine-a            # default: engine-0, engine-1, ...
                                  # url: dns+http://vllm-headless:8000 is a group found
                                  # by DNS: one engine per address, named NAME-ADDRESS
        models: [tiny]            # default: discovered from the engine's /v1/models
        scheduling_policy: fcfs   # the engine's --scheduling-policy
        max_inflight: 256
        batch_max_inflight: 64
        kv_high_watermark: 0.9
        budget: {initial_tokens: 8192, min_tokens: 512, max_tokens: 65536}
        piecing: auto             # off / on: prefill long batch prompts in pieces
        piece_tokens: 512         # the first piece's size (docs/scheduling.md)
        card: gpu0                # on a card shared with other engines' models, taking
        footprint_gib: 40         # this much of its memory awake, woken by vLLM's sleep
        activation: {sleep_level: 1}  # mode or {start: CMD, stop: CMD} (a process)
    cards:                        # what does not fit awake together takes turns
      - {name: gpu0, memory_gib: 80, min_awake_s: 60, chat_quiet_s: 30}

Environment: ``WHOSETURN_CONFIG``, ``WHOSETURN_HOST``, ``WHOSETURN_PORT``,
``WHOSETURN_ENGINES`` (comma-separated URLs), ``WHOSETURN_TTFT_TARGET_S``,
``WHOSETURN_GAP_TARGET_S``, ``WHOSETURN_MAX_BODY_BYTES``,
``WHOSETURN_FIRST_BYTE_TIMEOUT_S``, ``WHOSETURN_IDLE_TIMEOUT_S``,
``WHOSETURN_DRAIN_TIMEOUT_S``, ``WHOSETURN_DNS_INTERVAL_S``,
``WHOSETURN_MAX_BODY_BYTES_IN_FLIGHT``, ``WHOSETURN_HEADER_TIMEOUT_S``,
``WHOSETURN_BODY_TIMEOUT_S``, ``WHOSETURN_MAX_INCOMPLETE_CONNECTIONS``,
``WHOSETURN_LEDGER_DSN``, ``WHOSETURN_REPLICA_ID``, ``WHOSETURN_WORKERS``,
``WHOSETURN_BATCH_STORE_PATH``, ``WHOSETURN_DATA_DIR``, ``WHOSETURN_BATCH_STORE``,
``WHOSETURN_BATCH_DSN``, ``WHOSETURN_BATCH_MIN_SHARE``, ``WHOSETURN_HOLD_TIMEOUT_S``,
``WHOSETURN_BATCH_ABORT``, ``WHOSETURN_BATCH_ABORT_MAX``, ``WHOSETURN_FAIR_SHARE``.

The Batch API is on by default: with ``batch_store: sqlite`` (the default) and no
``batch_store_path``, its SQLite database is ``DATA_DIR/batch.sqlite3``, where
``DATA_DIR`` is ``data_dir`` (``--data-dir``, ``WHOSETURN_DATA_DIR``), else
``$XDG_DATA_HOME/whoseturn``, else ``~/.local/share/whoseturn``; ``batch_store: off``
turns it off.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import os
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit

import yaml

DEFAULT_CONFIG_FILE = "whoseturn.yaml"


class ConfigError(ValueError):
    """The settings are invalid; ``where`` names the key, ``why`` says what is wrong.
    ``errors``: each error found (this one alone, unless it lists several: see
    :meth:`of`)."""

    def __init__(self, where: str, why: str, errors: Iterable[ConfigError] = ()) -> None:
        super().__init__(f"{where}: {why}" if where else why)
        self.where = where
        self.why = why
        self.errors: tuple[ConfigError, ...] = tuple(errors) or (self,)

    @classmethod
    def of(cls, errors: Iterable[ConfigError]) -> ConfigError:
        """One error for all of ``errors`` (each once, in order): the error itself
        when there is one, so that one mistake reads as before."""
        found: dict[tuple[str, str], ConfigError] = {}
        for error in errors:
            for one in error.errors:
                found.setdefault((one.where, one.why), one)
        if len(found) == 1:
            return next(iter(found.values()))
        lines = "\n".join(f"  - {e}" for e in found.values())
        return cls("", f"{len(found)} errors in the settings:\n{lines}", found.values())


class _Problems:
    """The errors of checks that do not depend on each other, gathered so that the
    proxy reports every mistake at once instead of one per start."""

    def __init__(self) -> None:
        self.found: list[ConfigError] = []

    @contextmanager
    def gather(self) -> Iterator[None]:
        """An error raised inside is noted, and the code after the block goes on."""
        try:
            yield
        except ConfigError as exc:
            self.found.append(exc)

    def add(self, where: str, why: str) -> None:
        self.found.append(ConfigError(where, why))

    def raise_any(self) -> None:
        """Raise every error noted so far, as one."""
        if self.found:
            raise ConfigError.of(self.found)


Rule = tuple[bool, str, str]
"""A check: whether it holds, the key it names, what is wrong if not."""


def _check(cond: bool, where: str, why: str) -> None:
    if not cond:
        raise ConfigError(where, why)


def _checks(*rules: Rule) -> None:
    """Every rule that fails, raised at once."""
    failed = [ConfigError(where, why) for ok, where, why in rules if not ok]
    if failed:
        raise ConfigError.of(failed)


@contextmanager
def _under(where: str) -> Iterator[None]:
    """Errors raised inside name their key below ``where``."""
    try:
        yield
    except ConfigError as exc:
        below = [ConfigError(f"{where}.{e.where}" if e.where else where, e.why) for e in exc.errors]
        raise ConfigError.of(below) from None


@dataclass(frozen=True, kw_only=True)
class BudgetConfig:
    """An engine's batch prefill budget ``B`` and the loop that adapts it (see
    :mod:`proxy.scheduler.budget`). The file sets the three token bounds
    (``budget: {...}``); the targets are the top-level ``ttft_target_s`` and
    ``gap_target_s``; the rest are the loop's constants."""

    initial_tokens: int = 8192
    min_tokens: int = 512
    max_tokens: int = 65536
    ttft_target_s: float = 0.300
    gap_target_s: float = 0.100
    aim: float = 0.8
    percentile: float = 0.95
    window_s: float = 30.0
    interval_s: float = 1.0
    min_samples: int = 20  # fewer, and the nearest-rank p95 is the maximum: one slow chat
    decrease: float = 0.5
    increase_tokens: int = 512

    def __post_init__(self) -> None:
        _checks(
            (
                0 < self.min_tokens <= self.initial_tokens <= self.max_tokens,
                "budget",
                "need 0 < min_tokens <= initial_tokens <= max_tokens",
            ),
            (0 < self.decrease < 1, "budget.decrease", "must be in (0, 1)"),
            (0 < self.aim <= 1, "budget.aim", "must be in (0, 1]"),
            (0 < self.percentile <= 1, "budget.percentile", "must be in (0, 1]"),
            (
                self.ttft_target_s > 0 and self.gap_target_s > 0,
                "targets",
                "ttft_target_s and gap_target_s must be positive",
            ),
        )


BUDGET_FILE_KEYS = ("initial_tokens", "min_tokens", "max_tokens")


@dataclass(frozen=True, kw_only=True)
class Activation:
    """How an engine on a card is woken and put to sleep: vLLM's sleep mode
    (``sleep_level`` 1: the weights kept in CPU memory, or 2: dropped; the engine
    started with ``--enable-sleep-mode``), or commands (``start``, run in the
    background: the engine is awake once its health check passes; ``stop``, run to
    its end; without one the process ``start`` began is terminated). Commands run
    with ``sh -c``; the way that works on any machine, a CPU-only one too."""

    sleep_level: int = 0
    start: str = ""
    stop: str = ""
    wake_s: float = 30.0  # the wake's expected length until one is measured

    @property
    def by_command(self) -> bool:
        return bool(self.start)

    def __post_init__(self) -> None:
        _checks(
            (
                (self.sleep_level in (1, 2)) != bool(self.start),
                "",
                "expected sleep_level (1 or 2) or a start command, one of them",
            ),
            (not self.stop or bool(self.start), "stop", "only goes with a start command"),
            (self.wake_s > 0, "wake_s", "must be positive"),
        )


@dataclass(frozen=True, kw_only=True)
class CardConfig:
    """An accelerator's memory (or a machine's) that several engines' models share:
    what does not fit awake together takes turns, by the rule of
    :mod:`proxy.scheduler.residency` (``min_awake_s``, ``chat_quiet_s``,
    ``deadline_slack_s``)."""

    name: str
    memory_gib: float
    min_awake_s: float = 60.0
    chat_quiet_s: float = 30.0
    deadline_slack_s: float = 300.0

    def __post_init__(self) -> None:
        _checks(
            (self.memory_gib > 0, "memory_gib", "must be positive"),
            (self.min_awake_s >= 0, "min_awake_s", "must not be negative"),
            (self.chat_quiet_s >= 0, "chat_quiet_s", "must not be negative"),
            (self.deadline_slack_s >= 0, "deadline_slack_s", "must not be negative"),
        )


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """One engine: where it is and how the scheduler treats it.

    - ``max_inflight``: hard cap on requests the proxy keeps in the engine at once
      (interactive requests are dispatched at once unless this is reached).
    - ``batch_max_inflight``: cap on batch requests in the engine.
    - ``kv_high_watermark``: no batch admission while the engine reports KV-cache
      usage at or above this fraction.
    - ``models``: the models it serves (empty: discovered from the engine).
    - ``piecing``: prefill long batch prompts in pieces over the engine's prefix
      cache (``off``, ``on``, ``auto``, the default: where the engine reports prefix
      caching on, while chat is live or expected there, unless the engine chunks
      long prefills itself);
      ``piece_tokens``: the first piece's size, before the engine's cost is known;
      it also judges the engine's own chunking (see docs/scheduling.md).
    - ``kv_events``: where the engine publishes its KV-cache events (vLLM's
      ``--kv-events-config`` endpoint, as ``tcp://host:port``): the proxy's prefix
      index of the engine follows them exactly; ``kv_events_replay``, its replay
      endpoint, asked for what a gap lost. Without them the index is kept from
      what was routed there (docs/fleet.md).

    - ``card``: the card (:class:`CardConfig`) the engine's model lives on with
      others, taking ``footprint_gib`` of its memory when awake, woken and put to
      sleep by ``activation`` (docs/scheduling.md, several models on one card).

    A ``url`` of the form ``dns+http://HOST:PORT`` (or ``dns+https://``) is not one
    engine but a group found by DNS: ``HOST`` is resolved every ``dns_interval_s``
    and each address ``A`` becomes an engine named ``NAME-A`` at
    ``http://A:PORT``, with this entry's other settings (see
    :mod:`proxy.engines._discovery`).
    """

    name: str
    url: str = ""
    models: Collection[str] = ()
    scheduling_policy: str = "fcfs"
    max_inflight: int = 256
    batch_max_inflight: int = 64
    kv_high_watermark: float = 0.9
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    piecing: str = "auto"
    piece_tokens: int = 512
    kv_events: str = ""
    kv_events_replay: str = ""
    card: str = ""
    footprint_gib: float = 0.0
    activation: Activation | None = None

    def __post_init__(self) -> None:
        _checks(
            (self.footprint_gib >= 0, "footprint_gib", "must not be negative"),
            (self.piecing in ("off", "on", "auto"), "piecing", "expected off, on or auto"),
            (self.piece_tokens >= 1, "piece_tokens", "must be at least 1"),
            (
                self.scheduling_policy in ("fcfs", "priority"),
                "scheduling_policy",
                "expected fcfs or priority",
            ),
            (
                self.max_inflight >= 1 and self.batch_max_inflight >= 1,
                "",
                "max_inflight and batch_max_inflight must be at least 1",
            ),
            (0 < self.kv_high_watermark <= 1, "kv_high_watermark", "expected (0, 1]"),
        )

    @property
    def by_dns(self) -> bool:
        """Whether this entry is a group of engines found by DNS (``dns+http://``)."""
        return self.url.startswith(DNS_SCHEME_PREFIX)

    def at_address(self, address: str) -> EngineConfig:
        """The engine of this DNS group at ``address`` (an IP address)."""
        parts = urlsplit(self.url.removeprefix(DNS_SCHEME_PREFIX))
        host = f"[{address}]" if ":" in address else address
        netloc = f"{host}:{parts.port}" if parts.port else host
        url = f"{parts.scheme}://{netloc}{parts.path}"
        return dataclasses.replace(self, name=f"{self.name}-{address}", url=url)

    @property
    def dns_host_port(self) -> tuple[str, int]:
        """The name to resolve and the port, of a DNS group."""
        parts = urlsplit(self.url.removeprefix(DNS_SCHEME_PREFIX))
        default = 443 if parts.scheme == "https" else 80
        return parts.hostname or "", parts.port or default


DNS_SCHEME_PREFIX = "dns+"

ROLES = ("user", "read")
CLASSES = ("interactive", "batch")
TIERS = ("critical", "standard", "sheddable")
ROUTE_BY = ("prefix", "affinity", "load")
BATCH_STORES = ("sqlite", "postgres", "off")
BATCH_DATABASE = "batch.sqlite3"
LEDGER_DATABASE = "ledger.sqlite3"  # several workers share the budget here (no ledger_dsn)
"""The default SQLite batch store's file name, in the data directory."""
BATCH_ABORTS = ("off", "on", "auto")


@dataclass(frozen=True, kw_only=True)
class TenantLimits:
    """What one tenant may use (None: no limit). Requests and tokens count over a
    sliding minute (:mod:`proxy.scheduler.limits`): a request past one is refused
    with 429 and ``Retry-After`` at the HTTP edge; a batch line waits instead, as
    do batch jobs and lines past theirs: batch work is held, never failed."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None  # prompt (as counted at admission) + completion tokens
    streams: int | None = None  # requests in flight at once (interactive and batch lines)
    batch_jobs: int | None = None  # batch jobs running at once
    batch_lines: int | None = None  # batch lines in flight at once

    def any(self) -> bool:
        """Whether any limit is set (a tenant with none costs the meter nothing)."""
        return any(getattr(self, f.name) is not None for f in dataclasses.fields(self))


LIMIT_KEYS = tuple(f.name for f in dataclasses.fields(TenantLimits))


@dataclass(frozen=True, kw_only=True)
class Tenant:
    """Who a request is for, in the scheduler's fair share and the limits: its
    ``weight`` against the other tenants of its class, its ``tier`` (a band within
    the class, carried into the engine's ``priority``), its ``limits``.
    ``configured``: named by an API key of the config; the metrics label only those
    by name, so that callers cannot grow their series."""

    name: str  # "" anonymous
    weight: float = 1.0
    tier: str = "standard"  # one of TIERS
    limits: TenantLimits = TenantLimits()
    configured: bool = False


ANONYMOUS = Tenant(name="")
"""The tenant of a request that names none (a probe's, a test's): weight 1, standard."""


def key_tenant_name(key: str) -> str:
    """The tenant of a key that names none: ``key-`` and the start of the key's
    SHA-256, so that two keys are two tenants and the name tells nothing of the key."""
    return "key-" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:8]


@dataclass(frozen=True, kw_only=True)
class ApiKey:
    """One API key and its policy. ``role``: ``user`` may use every route, ``read``
    only the reads (models, metrics, turn, status, API docs; for dashboards and
    Prometheus). ``classes``: the traffic classes it may use. ``class_override``:
    whether it may choose its class by the ``X-Whoseturn-Class`` header.
    ``tenant`` (default: :func:`key_tenant_name` of the key), ``weight``, ``tier``
    and ``limits``: the tenant its requests are for and that tenant's policy, the
    same in every key that names it."""

    key: str
    role: str = "user"
    classes: tuple[str, ...] = CLASSES
    class_override: bool = False
    tenant: str = ""
    weight: float = 1.0
    tier: str = "standard"
    limits: TenantLimits = TenantLimits()

    def __post_init__(self) -> None:
        if not self.tenant:
            object.__setattr__(self, "tenant", key_tenant_name(self.key))

    def __repr__(self) -> str:  # never the key itself
        return (
            f"ApiKey(role={self.role!r}, classes={self.classes!r}, tenant={self.tenant!r}, "
            f"weight={self.weight!r}, tier={self.tier!r})"
        )

    def as_tenant(self) -> Tenant:
        """The key's tenant, as configured."""
        return Tenant(
            name=self.tenant,
            weight=self.weight,
            tier=self.tier,
            limits=self.limits,
            configured=True,
        )


@dataclass(frozen=True, kw_only=True)
class ServingSettings:
    """Where the proxy listens, the chat targets it keeps, how it stops, where it
    keeps its data."""

    PREFIX: ClassVar[str] = ""

    host: str = "127.0.0.1"  # 0.0.0.0: every interface
    port: int = 8080
    ttft_target_s: float = 0.300  # chat's time to first token (the budget loop aims below)
    gap_target_s: float = 0.100  # chat's gap between tokens, p95
    drain_timeout_s: float = 30.0  # on SIGTERM, requests in flight get this long
    decision_log_size: int = 1000  # decisions kept for GET /turn/log
    # how a request's engine is chosen among its model's: ``prefix`` (the least
    # expected time to first token, counting what each engine's prefix cache holds),
    # ``affinity`` (the least prefill in flight, a conversation kept on its engine),
    # ``load`` (the least prefill in flight)
    route_by: str = "prefix"
    # within each class, tenants served by a weighted fair share of the tokens (off:
    # arrival order within a class; proxy.scheduler.fair)
    fair_share: bool = True
    # where the proxy keeps its data (the default SQLite batch store); "" here: the
    # default, which loading resolves (default_data_dir)
    data_dir: str = ""


@dataclass(frozen=True, kw_only=True)
class AccessSettings:
    """Who may call the proxy, and who may choose a request's class (docs/security.md)."""

    PREFIX: ClassVar[str] = ""

    class_override: bool | tuple[str, ...] | None = None
    api_keys: tuple[str | ApiKey, ...] = field(default=(), repr=False)  # secrets: never shown

    def key_policies(self) -> tuple[ApiKey, ...]:
        """Every API key with its policy (a plain string is a ``user`` key)."""
        return tuple(k if isinstance(k, ApiKey) else ApiKey(key=k) for k in self.api_keys)

    def tenant(self, name: str) -> Tenant:
        """The tenant ``name`` as its keys configure it; else (a tenant found by a key
        or an address with no ``api_keys``, or an anonymous one) weight 1, standard,
        no limits, not configured."""
        found = self._tenants.get(name)
        return found if found is not None else Tenant(name=name)

    def tenant_names(self) -> tuple[str, ...]:
        """The configured tenants' names, each once, in the order of their keys."""
        return tuple(self._tenants)

    @functools.cached_property
    def _tenants(self) -> dict[str, Tenant]:
        """The configured tenants by name (looked up once per request: built once).
        Keys of one tenant agree on its policy (checked at load)."""
        tenants: dict[str, Tenant] = {}
        for key in self.key_policies():
            tenants.setdefault(key.tenant, key.as_tenant())
        return tenants


@dataclass(frozen=True, kw_only=True)
class EdgeSettings:
    """Slow clients and large bodies at the proxy's edge (docs/security.md)."""

    PREFIX: ClassVar[str] = ""

    max_body_bytes: int = 8 * 1024 * 1024
    max_body_bytes_in_flight: int = 64 * 1024 * 1024  # every body held at once
    header_timeout_s: float = 10.0  # from a connection's opening (or last response)
    body_timeout_s: float = 30.0  # between two pieces of a body the app waits for
    max_incomplete_connections: int = 1024  # beyond: the oldest is closed


@dataclass(frozen=True, kw_only=True)
class UpstreamSettings:
    """How the proxy talks to its engines, checks them and finds them."""

    PREFIX: ClassVar[str] = ""

    first_byte_timeout_s: float = 60.0
    idle_timeout_s: float = 30.0
    connect_timeout_s: float = 2.0
    outlier_consecutive_errors: int = 5
    health_interval_s: float = 1.0
    scrape_interval_s: float = 1.0
    unhealthy_after: int = 2
    # A health check not answered 2xx within this fails. With the two above it bounds
    # how long a request sent to a hung engine waits: the engine is ejected at most
    # unhealthy_after * (health_interval_s + health_timeout_s) after it stopped, and
    # requests still waiting for its answer go elsewhere (docs/security.md).
    health_timeout_s: float = 5.0
    dns_interval_s: float = 5.0  # how often DNS groups of engines are resolved again


@dataclass(frozen=True, kw_only=True)
class SharingSettings:
    """How chat holds batch (proxy.scheduler.HoldRules, docs/scheduling.md)."""

    PREFIX: ClassVar[str] = ""

    batch_min_share: float = 0.05
    hold_timeout_s: float = 10.0
    # Aborting a batch request in prefill for a chat whose TTFT it puts at risk, and
    # requeueing it: ``auto`` the final request of a pieced prompt (only where its
    # engine pieces); ``on`` every batch request; ``off``.
    batch_abort: str = "auto"
    batch_abort_max: int = 3  # the most times one batch request is aborted


@dataclass(frozen=True, kw_only=True)
class ReplicaSettings:
    """Several replicas, one budget (docs/replicas.md): off while no ledger DSN is set;
    worker processes on one listening address, each a replica (proxy.process.workers)."""

    PREFIX: ClassVar[str] = ""

    ledger_dsn: str = field(default="", repr=False)
    # the ledger in a SQLite file, for replicas on one box; with workers above 1 and no
    # ledger_dsn, loading sets it to DATA_DIR/ledger.sqlite3
    ledger_path: str = ""
    ledger_interval_s: float = 0.1  # publish this replica's load, read the others'
    ledger_lease_s: float = 3.0  # a replica's rows stop counting this long after its last write
    ledger_timeout_s: float = 1.0  # a ledger call that takes longer has failed
    replica_id: str = ""  # this replica's name in the ledger (default: host, pid, random)
    workers: int = 1


@dataclass(frozen=True, kw_only=True)
class BatchSettings:
    """The Batch API (docs/batch.md): ``store`` ``sqlite`` (the default; loading sets
    ``store_path`` to ``DATA_DIR/batch.sqlite3`` where none is given, for one proxy
    process), ``postgres`` (with ``dsn``) or ``off``; off too while no store path is
    set (SQLite) or no DSN (PostgreSQL). The DSN may hold a password: it is never
    printed. In the file each key has the prefix ``batch_`` (``batch_store_path``)."""

    PREFIX: ClassVar[str] = "batch_"

    store: str = "sqlite"
    store_path: str = ""
    dsn: str = field(default="", repr=False)
    pool_size: int = 10
    store_timeout_s: float = 2.0  # a quick store call's deadline (PostgreSQL)
    lease_s: float = 30.0
    max_file_bytes: int = 200_000_000
    max_lines: int = 50_000
    window: int = 64
    max_attempts: int = 3
    retry_backoff_s: float = 0.5

    @property
    def on(self) -> bool:
        """Whether the Batch API runs: its store chosen, and told where it is."""
        if self.store == "sqlite":
            return bool(self.store_path)
        return self.store == "postgres" and bool(self.dsn)


_SECTIONS: dict[str, type[Any]] = {
    "serving": ServingSettings,
    "access": AccessSettings,
    "edge": EdgeSettings,
    "upstream": UpstreamSettings,
    "sharing": SharingSettings,
    "replicas": ReplicaSettings,
    "batch": BatchSettings,
}


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Every setting, in the sections of ``whoseturn.example.yaml``. The file, the
    environment and the flags name them by flat keys (``port``, ``batch_store_path``):
    :meth:`from_keys` builds the sections from those, :meth:`keys` gives them back."""

    engines: tuple[EngineConfig, ...]
    cards: tuple[CardConfig, ...] = ()
    serving: ServingSettings = field(default_factory=ServingSettings)
    access: AccessSettings = field(default_factory=AccessSettings)
    edge: EdgeSettings = field(default_factory=EdgeSettings)
    upstream: UpstreamSettings = field(default_factory=UpstreamSettings)
    sharing: SharingSettings = field(default_factory=SharingSettings)
    replicas: ReplicaSettings = field(default_factory=ReplicaSettings)
    batch: BatchSettings = field(default_factory=BatchSettings)

    @classmethod
    def from_keys(
        cls, engines: Collection[EngineConfig], cards: Collection[CardConfig] = (), **keys: Any
    ) -> Settings:
        """The settings from the file's flat keys (unchecked: see :func:`settings_from_dict`)."""
        sections = {}
        for name, section in _SECTIONS.items():
            names = _file_keys(section)
            sections[name] = section(**{names[k]: keys.pop(k) for k in list(keys) if k in names})
        if keys:
            raise TypeError(f"unknown settings {sorted(keys)}")
        return cls(engines=tuple(engines), cards=tuple(cards), **sections)

    def keys(self) -> dict[str, Any]:
        """Every setting but the engines, by its key in the file."""
        out: dict[str, Any] = {}
        for name, section in _SECTIONS.items():
            values = getattr(self, name)
            out.update({k: getattr(values, f) for k, f in _file_keys(section).items()})
        return out


def _file_keys(section: type[Any]) -> dict[str, str]:
    """A section's keys in the file, each with its field's name."""
    return {section.PREFIX + f.name: f.name for f in dataclasses.fields(section)}


FILE_KEYS = ("engines", "cards", *(k for s in _SECTIONS.values() for k in _file_keys(s)))


def _known(names: Collection[str], data: Mapping[str, Any], where: str) -> None:
    """Each key of ``data`` not among ``names`` is an error of its own, with the known
    key it is closest to (a typo), else the known keys."""
    unknown = sorted((str(k) for k in data if k not in names), key=str)
    _checks(*((False, where, _unknown_key(key, names)) for key in unknown))


def _unknown_key(key: str, names: Collection[str]) -> str:
    close = difflib.get_close_matches(key, list(names), n=1)
    if close:
        return f"unknown key {key!r}: did you mean {close[0]!r}?"
    return f"unknown key {key!r}; known: {', '.join(sorted(names))}"


def _fields(cls: type[Any]) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


_NOUNS = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false"}


def _typed(
    cls: type[Any], data: Mapping[str, Any], where: str, key: str, problems: _Problems
) -> dict[str, Any]:
    """``data`` with the scalar fields of ``cls`` (each at ``key`` + its name) checked
    against their types (ints pass as floats), so that ``port: "80"`` is an error
    naming ``port``, not a TypeError later. A wrongly typed value is noted in
    ``problems`` and left out (its default stands in, so later checks go on)."""
    out = dict(data)
    for f in dataclasses.fields(cls):
        kind = str(f.type)  # a name: annotations are postponed
        name = key + f.name
        if name not in out or kind not in _NOUNS:
            continue
        value = out[name]
        if kind == "str":
            ok = isinstance(value, str)
        elif kind == "bool":
            ok = isinstance(value, bool)
        else:
            number = isinstance(value, int | float) and not isinstance(value, bool)
            ok = number and (kind == "float" or isinstance(value, int))
        if not ok:
            problems.add(where + name, f"expected {_NOUNS[kind]}, got {value!r}")
            del out[name]
        elif kind == "float":
            out[name] = float(value)
    return out


def _budget(data: Any, where: str, targets: Mapping[str, float]) -> BudgetConfig:
    _check(isinstance(data, Mapping), f"{where}.budget", "expected a mapping")
    problems = _Problems()
    with problems.gather():
        _known(BUDGET_FILE_KEYS, data, f"{where}.budget")
    known = {k: v for k, v in data.items() if k in BUDGET_FILE_KEYS}
    typed = _typed(BudgetConfig, known, f"{where}.budget.", "", problems)
    problems.raise_any()
    with _under(where):
        return BudgetConfig(
            **typed, ttft_target_s=targets["ttft_target_s"], gap_target_s=targets["gap_target_s"]
        )


def _engine_url(given: Any, where: str) -> str:
    """The engine's base URL, without a trailing slash. One that ends in ``/v1`` is
    refused with the URL to give instead: the proxy adds ``/v1/...`` itself, so the
    engine would answer 404 to every call and be ejected."""
    url = str(given or "").rstrip("/")
    parts = urlsplit(url.removeprefix(DNS_SCHEME_PREFIX))
    _check(
        parts.scheme in ("http", "https") and bool(parts.hostname),
        where,
        f"expected http(s)://host:port or dns+http(s)://name:port, got {url!r}",
    )
    _check(
        not parts.path.endswith("/v1"),
        where,
        f"{given!r} ends in /v1: drop /v1: the proxy adds the routes itself; "
        f"use {url.removesuffix('/v1')}",
    )
    return url


def _engine(data: Any, index: int, targets: Mapping[str, float]) -> EngineConfig:
    where = f"engines[{index}]"
    if isinstance(data, str):
        data = {"url": data}
    _check(isinstance(data, Mapping), where, "expected a URL or a mapping")
    problems = _Problems()
    names = _fields(EngineConfig)
    with problems.gather():
        _known(names, data, where)
    body = {k: v for k, v in data.items() if k in names}
    url = ""
    with problems.gather():
        url = _engine_url(body.get("url"), f"{where}.url")
    budget = BudgetConfig(
        ttft_target_s=targets["ttft_target_s"], gap_target_s=targets["gap_target_s"]
    )
    with problems.gather():
        budget = _budget(body.pop("budget", {}) or {}, where, targets)
    activation = None
    if body.get("activation") is not None:
        with problems.gather():
            activation = _activation(body["activation"], f"{where}.activation")
    body.pop("activation", None)
    models = body.pop("models", ()) or ()
    if not (isinstance(models, list | tuple) and all(isinstance(m, str) for m in models)):
        problems.add(f"{where}.models", "expected a list of model names")
        models = ()
    body.update(url=url, name=str(body.get("name") or f"engine-{index}"))
    if isinstance(body.get("piecing"), bool):  # YAML reads a bare off / on as a bool
        body["piecing"] = "on" if body["piecing"] else "off"
    typed = _typed(EngineConfig, body, f"{where}.", "", problems)
    engine = None
    with problems.gather(), _under(where):
        engine = EngineConfig(**typed, models=tuple(models), budget=budget, activation=activation)
    problems.raise_any()
    assert engine is not None
    return engine


ACTIVATION_KEYS = ("sleep_level", "start", "stop", "wake_s")
CARD_KEYS = ("name", "memory_gib", "min_awake_s", "chat_quiet_s", "deadline_slack_s")


def _activation(data: Any, where: str) -> Activation:
    _check(isinstance(data, Mapping), where, "expected a mapping: {sleep_level: 1} or {start: CMD}")
    problems = _Problems()
    with problems.gather():
        _known(ACTIVATION_KEYS, data, where)
    typed = _typed(Activation, {k: v for k, v in data.items() if k in ACTIVATION_KEYS},
                   f"{where}.", "", problems)  # fmt: skip
    problems.raise_any()
    with _under(where):
        return Activation(**typed)


def _cards(data: Any) -> tuple[CardConfig, ...]:
    cards = data or []
    _check(isinstance(cards, list | tuple), "cards", "expected a list")
    problems = _Problems()
    parsed: list[CardConfig] = []
    for index, entry in enumerate(cards):
        where = f"cards[{index}]"
        if not isinstance(entry, Mapping):
            problems.add(where, "expected a mapping with name and memory_gib")
            continue
        with problems.gather():
            _known(CARD_KEYS, entry, where)
        body = {k: v for k, v in entry.items() if k in CARD_KEYS}
        if not isinstance(body.get("name"), str) or not body.get("name"):
            problems.add(f"{where}.name", "expected the card's name")
            continue
        if "memory_gib" not in body:
            problems.add(f"{where}.memory_gib", "expected the card's memory in GiB")
            continue
        typed = _typed(CardConfig, body, f"{where}.", "", problems)
        with problems.gather(), _under(where):
            parsed.append(CardConfig(**typed))
    names = [c.name for c in parsed]
    if len(set(names)) != len(names):
        problems.add("cards", f"names must be unique, got {names}")
    problems.raise_any()
    return tuple(parsed)


def _check_cards(settings: Settings) -> None:
    """Each engine on a card: the card exists, its model is named (an engine asleep
    cannot be asked), it says how it is woken, and it fits in the card's memory;
    a card is kept by one proxy process (two would swap against each other)."""
    cards = {c.name: c for c in settings.cards}
    rules: list[Rule] = []
    for i, e in enumerate(settings.engines):
        where = f"engines[{i}]"
        if not e.card:
            rules.append((e.activation is None, f"{where}.activation", "only goes with card"))
            continue
        card = cards.get(e.card)
        rules.append((card is not None, f"{where}.card", f"no card named {e.card!r} in cards"))
        rules.append(
            (not e.by_dns, f"{where}.url", "an engine on a card is one engine, not a DNS group")
        )
        rules.append(
            (len(e.models) == 1, f"{where}.models", "an engine on a card names its one model")
        )
        rules.append(
            (
                e.activation is not None,
                f"{where}.activation",
                "an engine on a card says how it is woken: {sleep_level: 1} or {start: CMD}",
            )
        )
        rules.append(
            (
                e.footprint_gib > 0,
                f"{where}.footprint_gib",
                "an engine on a card states the memory its model takes awake",
            )
        )
        if card is not None and e.footprint_gib > card.memory_gib:
            rules.append(
                (
                    False,
                    f"{where}.footprint_gib",
                    f"{e.footprint_gib:g} GiB fits on no card: "
                    f"card {card.name} has {card.memory_gib:g} GiB",
                )
            )
    for card in settings.cards:
        on = [e for e in settings.engines if e.card == card.name]
        rules.append((len(on) >= 1, "cards", f"card {card.name} holds no engine"))
        models = [m for e in on for m in e.models]
        rules.append(
            (
                len(set(models)) == len(models),
                "cards",
                f"card {card.name} holds a model twice: {models}",
            )
        )
    several = settings.replicas.workers > 1 or bool(settings.replicas.ledger_dsn)
    rules.append(
        (
            not (settings.cards and several),
            "cards",
            "a card is kept by one proxy process: not with workers above 1 or ledger_dsn",
        )
    )
    _checks(*rules)


TARGET_KEYS = ("ttft_target_s", "gap_target_s")


def _targets(body: Mapping[str, Any]) -> dict[str, float]:
    """The TTFT and gap targets every engine's budget loop aims under (a wrongly
    typed one is reported with the other serving settings; its default stands in)."""
    given = {k: body[k] for k in TARGET_KEYS if k in body}
    typed = _typed(ServingSettings, given, "", "", _Problems())
    targets = {k: typed.get(k, getattr(ServingSettings, k)) for k in TARGET_KEYS}
    _check(
        all(v > 0 for v in targets.values()),
        "targets",
        "ttft_target_s and gap_target_s must be positive",
    )
    return targets


def _engines(data: Any, targets: Mapping[str, float]) -> tuple[EngineConfig, ...]:
    engines = data or []
    _check(isinstance(engines, list | tuple), "engines", "expected a list")
    _check(len(engines) > 0, "engines", "at least one engine is needed (--engine URL)")
    problems = _Problems()
    parsed: list[EngineConfig] = []
    for index, entry in enumerate(engines):
        with problems.gather():
            parsed.append(_engine(entry, index, targets))
    names = [e.name for e in parsed]
    if len(set(names)) != len(names):
        problems.add("engines", f"names must be unique, got {names}")
    problems.raise_any()
    return tuple(parsed)


def _class_override(value: Any) -> bool | tuple[str, ...] | None:
    if isinstance(value, list | tuple):
        value = tuple(str(k) for k in value)
    _check(
        value is None or isinstance(value, bool | tuple),
        "class_override",
        "expected true, false or a list of API keys",
    )
    return value  # type: ignore[no-any-return]


KEY_SOURCES = ("key", "key_file", "key_env")
"""Where a key entry's secret comes from: given, read from a file, or from the
environment; exactly one of them."""


def _api_keys(data: Any, env: Mapping[str, str]) -> tuple[str | ApiKey, ...]:
    """The ``api_keys`` list: each entry checked (every bad one reported), then the
    keys of one tenant checked to agree."""
    _check(isinstance(data, list | tuple), "api_keys", "expected a list")
    problems = _Problems()
    keys: list[str | ApiKey] = []
    for index, entry in enumerate(data):
        with problems.gather():
            keys.append(_api_key(entry, index, env))
    problems.raise_any()
    _same_tenants(tuple(keys))
    return tuple(keys)


def _api_key(data: Any, index: int, env: Mapping[str, str]) -> str | ApiKey:
    """A plain key string, or ``{key | key_file | key_env, role, classes,
    class_override, tenant, weight, tier, limits}``. No error shows the secret."""
    where = f"api_keys[{index}]"
    if isinstance(data, str | int):
        return str(data)
    _check(isinstance(data, Mapping), where, "expected a key or a mapping with `key`")
    problems = _Problems()
    with problems.gather():
        _known([*KEY_SOURCES[1:], *_fields(ApiKey)], data, where)
    secret = ""
    with problems.gather():
        secret = _secret(data, where, env)
    given = data.get("classes", CLASSES)
    classes = tuple(given) if isinstance(given, list | tuple) else ()
    override = data.get("class_override", False)
    tenant = data.get("tenant", "")
    weight = data.get("weight", 1.0)
    tier = data.get("tier", "standard")
    with problems.gather():
        _checks(
            (data.get("role", "user") in ROLES, f"{where}.role", f"expected one of {ROLES}"),
            (
                isinstance(given, list | tuple) and all(c in CLASSES for c in classes),
                f"{where}.classes",
                f"expected some of {CLASSES}",
            ),
            (isinstance(override, bool), f"{where}.class_override", "expected true or false"),
            (isinstance(tenant, str), f"{where}.tenant", "expected a name"),
            (
                isinstance(weight, int | float) and not isinstance(weight, bool) and weight > 0,
                f"{where}.weight",
                f"expected a positive number, got {weight!r}",
            ),
            (tier in TIERS, f"{where}.tier", f"expected one of {TIERS}"),
        )
    limits = TenantLimits()
    with problems.gather():
        limits = _limits(data.get("limits") or {}, f"{where}.limits")
    problems.raise_any()
    return ApiKey(
        key=secret,
        role=str(data.get("role", "user")),
        classes=classes,
        class_override=override,
        tenant=tenant.strip(),
        weight=float(weight),
        tier=tier,
        limits=limits,
    )


def _secret(data: Mapping[str, Any], where: str, env: Mapping[str, str]) -> str:
    """The key of an entry: ``key`` itself, the contents of ``key_file`` (without
    the line end), or environment variable ``key_env``; errors name the entry and
    the file or variable, never the key."""
    given = [k for k in KEY_SOURCES if k in data]
    _check(bool(given), f"{where}.key", "required (or key_file: PATH, or key_env: VARIABLE)")
    _check(len(given) == 1, where, f"give one of key, key_file and key_env, not {given}")
    source, value = given[0], data[given[0]]
    _check(isinstance(value, str) and bool(value), f"{where}.{source}", "expected a string")
    if source == "key_file":
        try:
            secret = Path(value).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise ConfigError(f"{where}.key_file", f"cannot read {value}: {why}") from None
        _check(bool(secret), f"{where}.key_file", f"{value} is empty")
        return secret
    if source == "key_env":
        secret = env.get(value, "").strip()
        _check(bool(secret), f"{where}.key_env", f"environment variable {value} is unset or empty")
        return secret
    return str(value)


def _limits(data: Any, where: str) -> TenantLimits:
    _check(isinstance(data, Mapping), where, f"expected a mapping of some of {list(LIMIT_KEYS)}")
    problems = _Problems()
    with problems.gather():
        _known(LIMIT_KEYS, data, where)
    for name, value in data.items():
        ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
        if name in LIMIT_KEYS and not (ok or value is None):
            problems.add(f"{where}.{name}", f"expected a positive integer, got {value!r}")
    problems.raise_any()
    return TenantLimits(**data)


def _same_tenants(keys: tuple[str | ApiKey, ...]) -> None:
    """Keys that name one tenant give it one policy: its weight, tier and limits."""
    first: dict[str, tuple[int, ApiKey]] = {}
    rules: list[Rule] = []
    for index, entry in enumerate(keys):
        key = entry if isinstance(entry, ApiKey) else ApiKey(key=entry)
        seen = first.setdefault(key.tenant, (index, key))
        other = seen[1]
        rules += [
            (
                getattr(key, name) == getattr(other, name),
                f"api_keys[{index}].{name}",
                f"tenant {key.tenant!r} has {name} {getattr(other, name)!r} in "
                f"api_keys[{seen[0]}]: the keys of one tenant must agree on weight, "
                f"tier and limits",
            )
            for name in ("weight", "tier", "limits")
        ]
    _checks(*rules)


def default_data_dir(env: Mapping[str, str]) -> Path:
    """Where the proxy keeps its data when ``data_dir`` is unset, as the XDG base
    directory specification has it: ``$XDG_DATA_HOME/whoseturn`` (an absolute path;
    a relative one is ignored), else ``~/.local/share/whoseturn``."""
    xdg = env.get("XDG_DATA_HOME", "")
    if xdg and Path(xdg).is_absolute():
        return Path(xdg) / "whoseturn"
    home = env.get("HOME") or str(Path.home())
    return Path(home) / ".local" / "share" / "whoseturn"


def _data_dir(body: dict[str, Any], env: Mapping[str, str]) -> None:
    """``data_dir`` resolved, and what lives in it placed there where no path is
    given: the SQLite batch store (the Batch API on by default) and, for several
    worker processes with no ``ledger_dsn``, the ledger they share the budget in."""
    given = body.get("data_dir") or ""
    data_dir = Path(given).expanduser() if given else default_data_dir(env)
    body["data_dir"] = str(data_dir)
    sqlite = body.get("batch_store", "sqlite") == "sqlite"
    if sqlite and not body.get("batch_store_path"):
        body["batch_store_path"] = str(data_dir / BATCH_DATABASE)
    several = isinstance(body.get("workers"), int) and body["workers"] > 1
    if several and not body.get("ledger_dsn") and not body.get("ledger_path"):
        body["ledger_path"] = str(data_dir / LEDGER_DATABASE)


def settings_from_dict(data: Mapping[str, Any], env: Mapping[str, str] | None = None) -> Settings:
    """Validate a settings document (the merged YAML, environment and flags); ``env``
    (default: the process's) holds the keys given as ``key_env`` and the XDG
    directories. Every error is found before one is raised: a :class:`ConfigError`
    that lists them all."""
    env = os.environ if env is None else env
    problems = _Problems()
    with problems.gather():
        _known(FILE_KEYS, data, "settings")
    body = {k: v for k, v in data.items() if k in FILE_KEYS}
    for key, true in (("batch_abort", "on"), ("batch_store", "sqlite")):
        if isinstance(body.get(key), bool):  # YAML reads a bare off / on as a bool
            body[key] = true if body[key] else "off"
    targets = {k: getattr(ServingSettings, k) for k in TARGET_KEYS}
    with problems.gather():
        targets = _targets(body)
    engines: tuple[EngineConfig, ...] = ()
    with problems.gather():
        engines = _engines(body.pop("engines", None), targets)
    cards: tuple[CardConfig, ...] = ()
    with problems.gather():
        cards = _cards(body.pop("cards", None))
    override = body.pop("class_override", None)
    with problems.gather():
        body["class_override"] = _class_override(override)
    keys = body.pop("api_keys", ()) or ()
    with problems.gather():
        body["api_keys"] = _api_keys(keys, env)
    for section in _SECTIONS.values():
        body = _typed(section, body, "", section.PREFIX, problems)
    _data_dir(body, env)
    settings = Settings.from_keys(engines, cards, **body)
    checks = (_check_serving, _check_upstream, _check_edge, _check_sharing, _check_batch,
              _check_cards)  # fmt: skip
    for check in checks:
        with problems.gather():
            check(settings)
    with problems.gather():
        _check_replicas(settings)
    problems.raise_any()
    return settings


def _positive(s: Any, *names: str) -> list[Rule]:
    """Each of ``names`` of section ``s`` above zero; an error names the file's key."""
    return [(getattr(s, name) > 0, s.PREFIX + name, "must be positive") for name in names]


def _at_least_one(s: Any, *names: str) -> list[Rule]:
    return [(getattr(s, name) >= 1, s.PREFIX + name, "must be at least 1") for name in names]


def _check_serving(settings: Settings) -> None:
    """The port, the decision log, the drain."""
    s = settings.serving
    _checks(
        (1 <= s.port <= 65535, "port", "expected 1..65535"),
        *_at_least_one(s, "decision_log_size"),
        (s.drain_timeout_s >= 0, "drain_timeout_s", "must not be negative"),
        (s.route_by in ROUTE_BY, "route_by", "expected " + ", ".join(ROUTE_BY)),
    )


def _check_upstream(settings: Settings) -> None:
    """The engine timeouts, outlier ejection, the health checks, discovery."""
    s = settings.upstream
    _checks(
        *_positive(s, "first_byte_timeout_s", "idle_timeout_s", "connect_timeout_s"),
        *_positive(s, "health_interval_s", "scrape_interval_s", "health_timeout_s"),
        *_positive(s, "dns_interval_s"),
        *_at_least_one(s, "outlier_consecutive_errors", "unhealthy_after"),
    )


def _check_sharing(settings: Settings) -> None:
    """How chat and batch share an engine."""
    s = settings.sharing
    _checks(
        (0 <= s.batch_min_share < 1, "batch_min_share", "must be in [0, 1)"),
        *_positive(s, "hold_timeout_s"),
        (s.batch_abort in BATCH_ABORTS, "batch_abort", "expected off, on or auto"),
        *_at_least_one(s, "batch_abort_max"),
    )


def _check_edge(settings: Settings) -> None:
    """The largest body, the slow-client timeouts, the cap and the budget of bodies in
    flight."""
    s = settings.edge
    _checks(
        (s.max_body_bytes >= 1024, "max_body_bytes", "must be at least 1024"),
        *_positive(s, "header_timeout_s", "body_timeout_s"),
        *_at_least_one(s, "max_incomplete_connections"),
        (
            s.max_body_bytes_in_flight >= s.max_body_bytes,
            "max_body_bytes_in_flight",
            f"must be at least max_body_bytes ({s.max_body_bytes}), or no body that large "
            f"could ever be served",
        ),
    )


def _check_replicas(settings: Settings) -> None:
    """The ledger; several worker processes need what several replicas need: the
    shared ledger (each process has its own scheduler) and, with the Batch API, its
    shared store."""
    s = settings.replicas
    _checks(
        (
            0 < s.ledger_interval_s < s.ledger_lease_s,
            "ledger_interval_s",
            "must be positive and below ledger_lease_s",
        ),
        *_positive(s, "ledger_timeout_s"),
        *_at_least_one(s, "workers"),
    )
    _checks(
        (
            not (s.ledger_dsn and s.ledger_path),
            "ledger_path",
            "and ledger_dsn are two places for one ledger: set one of them",
        ),
    )


def _check_batch(settings: Settings) -> None:
    s = settings.batch
    _checks(
        (
            s.store in BATCH_STORES,
            "batch_store",
            f"must be one of {', '.join(BATCH_STORES)}, got {s.store!r}",
        ),
        *_at_least_one(s, "max_file_bytes", "max_lines", "window", "max_attempts", "pool_size"),
        *_positive(s, "lease_s", "store_timeout_s"),
        (
            s.store != "postgres" or bool(s.dsn),
            "batch_dsn",
            "is required when batch_store is postgres (or set WHOSETURN_BATCH_DSN)",
        ),
        (s.retry_backoff_s >= 0, "batch_retry_backoff_s", "must not be negative"),
    )


def boolean(text: str) -> bool:
    """An environment variable's yes or no: true/false, 1/0, yes/no, on/off."""
    word = text.strip().lower()
    if word in ("true", "1", "yes", "on"):
        return True
    if word in ("false", "0", "no", "off"):
        return False
    raise ValueError(text)


_ENV: dict[str, tuple[str, Callable[[str], Any]]] = {
    "WHOSETURN_HOST": ("host", str),
    "WHOSETURN_PORT": ("port", int),
    "WHOSETURN_TTFT_TARGET_S": ("ttft_target_s", float),
    "WHOSETURN_GAP_TARGET_S": ("gap_target_s", float),
    "WHOSETURN_MAX_BODY_BYTES": ("max_body_bytes", int),
    "WHOSETURN_FIRST_BYTE_TIMEOUT_S": ("first_byte_timeout_s", float),
    "WHOSETURN_IDLE_TIMEOUT_S": ("idle_timeout_s", float),
    "WHOSETURN_DRAIN_TIMEOUT_S": ("drain_timeout_s", float),
    "WHOSETURN_MAX_BODY_BYTES_IN_FLIGHT": ("max_body_bytes_in_flight", int),
    "WHOSETURN_HEADER_TIMEOUT_S": ("header_timeout_s", float),
    "WHOSETURN_BODY_TIMEOUT_S": ("body_timeout_s", float),
    "WHOSETURN_MAX_INCOMPLETE_CONNECTIONS": ("max_incomplete_connections", int),
    "WHOSETURN_DNS_INTERVAL_S": ("dns_interval_s", float),
    "WHOSETURN_LEDGER_DSN": ("ledger_dsn", str),
    "WHOSETURN_LEDGER_PATH": ("ledger_path", str),
    "WHOSETURN_REPLICA_ID": ("replica_id", str),
    "WHOSETURN_WORKERS": ("workers", int),
    "WHOSETURN_BATCH_STORE_PATH": ("batch_store_path", str),
    "WHOSETURN_DATA_DIR": ("data_dir", str),
    "WHOSETURN_BATCH_MIN_SHARE": ("batch_min_share", float),
    "WHOSETURN_HOLD_TIMEOUT_S": ("hold_timeout_s", float),
    "WHOSETURN_BATCH_ABORT": ("batch_abort", str),
    "WHOSETURN_BATCH_ABORT_MAX": ("batch_abort_max", int),
    "WHOSETURN_BATCH_STORE": ("batch_store", str),
    "WHOSETURN_BATCH_DSN": ("batch_dsn", str),
    "WHOSETURN_FAIR_SHARE": ("fair_share", boolean),
}


def _from_env(env: Mapping[str, str], problems: _Problems) -> dict[str, Any]:
    """The settings the environment gives; a value that does not read is noted in
    ``problems`` (naming the variable) and left out."""
    out: dict[str, Any] = {}
    for var, (key, kind) in _ENV.items():
        if var in env:
            try:
                out[key] = kind(env[var])
            except ValueError:
                what = getattr(kind, "__name__", "a value")
                problems.add(var, f"cannot read {env[var]!r} as {what}")
    if env.get("WHOSETURN_ENGINES"):
        out["engines"] = [u.strip() for u in env["WHOSETURN_ENGINES"].split(",") if u.strip()]
    return out


def _from_file(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ConfigError(str(path), f"cannot read: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(str(path), f"not valid YAML: {exc}") from exc
    _check(isinstance(data, dict), str(path), "expected a mapping at top level")
    return data


def load_settings(
    config_file: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> Settings:
    """Merge defaults < YAML file < environment < ``overrides`` (the flags) and validate.

    The file is ``config_file``, else ``$WHOSETURN_CONFIG``, else ``whoseturn.yaml``
    in ``cwd`` if it exists. A file that cannot be read stops at once; otherwise the
    environment's errors and the settings' are raised together.
    """
    env = os.environ if env is None else env
    merged: dict[str, Any] = {}
    name = config_file or env.get("WHOSETURN_CONFIG")
    default = (cwd or Path.cwd()) / DEFAULT_CONFIG_FILE
    if name:
        merged.update(_from_file(Path(name)))
    elif default.exists():
        merged.update(_from_file(default))
    problems = _Problems()
    merged.update(_from_env(env, problems))
    merged.update({k: v for k, v in (overrides or {}).items() if v is not None})
    settings = None
    with problems.gather():
        settings = settings_from_dict(merged, env)
    problems.raise_any()
    assert settings is not None
    return settings
