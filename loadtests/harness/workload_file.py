"""Workload files (``loadtests/workloads/*.yaml``): the traffic classes a run loads
together, and its plan. Checked on load: a bad file raises :class:`WorkloadError`
naming the key.

```yaml
name: demo
model: tiny                 # the served model name sent in every request
seed: 0                     # arrivals and prompt choice; same seed, same run
plan:
  cold: false               # one run first, reported apart (caches empty)
  warm_runs: 1              # then this many runs, pooled
  duration_s: 40            # each run's length, wall-clock seconds
  warmup_s: 8               # latencies of requests sent before this are not counted
classes:
  chat:
    route: chat             # chat: the proxy's /v1; batch: its /batch/v1; batch-api: jobs
                            # of the proxy's Files + Batch API (/v1/files, /v1/batches),
                            # each of job_lines requests; closed: concurrency jobs at
                            # once; open: a job per arrival (the proxy arm only)
    api: chat               # chat: /chat/completions with messages; completions: a prompt
    arrival: {process: poisson, rate: 2.0}
      # or {process: gamma, rate: R, burstiness: B}, {process: periodic, rate: R} (one
      # every 1/R s), {process: closed, concurrency: N},
      # {process: trace, file: PATH}  (PATH relative to the workload file)
    prompt: {source: python-docs, chars: 400}
      # source: one of loadtests.harness.corpus.SETS: python-docs (needs chars), python-pages,
      # licences, rfc, book, long-document (chars optional: a passage, else whole
      # documents in turn), questions, conversations, extraction (chars cuts the
      # document)
    max_tokens: 48
    temperature: 0          # the default: greedy, so answers can be compared across arms
    model: tiny             # optional: this class's model (default: the workload's); two
                            # models on one card: chat on one, batch on the other
tenants:                    # optional: clients with an API key each, and what each sends
  - name: quiet             # letters, digits, - and _; its classes are named quiet/CLASS
    key: quiet-key          # sent as `Authorization: Bearer KEY`; or key_env: VAR (read
                            # at load); two tenants never share a key
    classes:                # as the top-level classes (which, if any, send no key)
      chat: {route: chat, api: chat, arrival: {process: periodic, rate: 2},
             prompt: {source: python-docs, chars: 200}, max_tokens: 8}
engines:                    # optional: the harness starts these, fresh for each arm
  count: 2
  command: whoseturn sim --profile cpu-tiny --port {port}
    # {port}: a free loopback port; {python}: this interpreter; {vllm_python}: the
    # .venv-vllm interpreter; {model_dir}: the tiny model; {dtype}: bfloat16 where the
    # CPU computes in it, else float32; "whoseturn" runs this
    # checkout's `python -m proxy`
  health: /health           # polled until 200: the model load, timed
  ready_timeout_s: 120
  env: {}                   # added to the environment
proxy: {settings: {}}       # optional, with engines: `whoseturn serve` in front of them
arms: [direct, proxy]       # with engines: the arms to run, in this order; or named arms,
  # each on fresh engines with its own extra engine flags and request priorities:
  # - {name: priority, via: direct, engine_args: "--scheduling-policy priority",
  #    priority: {chat: -10, batch: 0}}
  # ({engine_args} in engines.command is replaced by the arm's)
bars:                       # optional: verdicts on the warm figures, printed and kept
  - {figure: chat.ttft_p95, ratio: [direct, proxy], above: 5}   # direct / proxy > 5
  - {figure: batch.done_p95, ratio: [proxy, direct], at_most: 1.2}
  - {all_valid: true}       # every request sent after warm-up answered whole
```

With tenants, every record keeps its tenant, and with more than one tenant (the
top-level classes count as one, without a key) the report has a row per tenant
(:mod:`loadtests.harness.tenants`). A bar or an arm's ``priority`` names a tenant's
class as ``TENANT/CLASS``. The keys never reach ``result.json``: a tenant is written
there with the name the proxy gives a key it has no config for (``key-`` and the
first 8 hex digits of the key's SHA-256), so its rows can be found in ``/turn/log``.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from loadtests.harness.corpus import NEEDS_CHARS, SETS

ROUTES = ("chat", "batch", "batch-api")
APIS = ("chat", "completions")
PROCESSES = ("poisson", "gamma", "periodic", "closed", "trace")
ARMS = ("direct", "proxy")
SOURCES = tuple(SETS)
TENANT_NAME = re.compile(r"[A-Za-z0-9_-]+")


class WorkloadError(ValueError):
    """A workload file that cannot be run; the message names the key."""


@dataclass(frozen=True, kw_only=True)
class Arrival:
    process: str
    rate: float = 0.0
    burstiness: float = 1.0
    concurrency: int = 0
    trace: Path | None = None


@dataclass(frozen=True, kw_only=True)
class TrafficClass:
    name: str
    route: str
    api: str
    arrival: Arrival
    prompt_chars: int | None
    max_tokens: int
    temperature: float = 0.0
    prompt_source: str = "python-docs"
    job_lines: int = 0  # batch-api: requests per job
    poll_s: float = 1.0  # batch-api: how often a job is looked at
    tenant: str = ""  # the tenant that sends it ("" none: no key sent)
    model: str = ""  # the model it asks for ("": the workload's)


@dataclass(frozen=True, kw_only=True)
class Tenant:
    """A client of its own: its name and the API key it sends (``Authorization:
    Bearer``); its classes are the workload's classes that name it."""

    name: str
    key: str = field(repr=False)

    @property
    def proxy_name(self) -> str:
        """The tenant's name in a proxy that has no config for its key: ``key-`` and
        the first 8 hex digits of the key's SHA-256 (the key itself is never kept)."""
        return "key-" + hashlib.sha256(self.key.encode()).hexdigest()[:8]


@dataclass(frozen=True, kw_only=True)
class Plan:
    cold: bool = False
    warm_runs: int = 1
    duration_s: float = 40.0
    warmup_s: float = 8.0


@dataclass(frozen=True, kw_only=True)
class Engines:
    """How the harness starts the engines itself (:mod:`loadtests.harness.engines`)."""

    command: str
    count: int = 1
    health: str = "/health"
    ready_timeout_s: float = 120.0
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class ArmSpec:
    """One arm: where its requests go, and what it changes."""

    name: str
    via: str  # direct: the engines' /v1; proxy: a proxy in front of them
    engine_args: str = ""
    priority: dict[str, int] = field(default_factory=dict)  # class: request priority
    # the proxy's settings for each engine it is given (e.g. piecing), this arm only
    proxy_engine: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Bar:
    """A verdict: ``figure`` (``class.field`` of :class:`loadtests.harness.measures.ClassSummary`)
    of arm ``ratio[0]`` divided by arm ``ratio[1]`` (or of arm ``arm`` itself, in
    seconds), above ``above`` or at most ``at_most``; or, with ``all_valid``, every
    request of every arm valid."""

    figure: str = ""
    ratio: tuple[str, str] = ("", "")
    arm: str = ""
    above: float | None = None
    at_most: float | None = None
    all_valid: bool = False


@dataclass(frozen=True, kw_only=True)
class Workload:
    name: str
    model: str
    seed: int
    plan: Plan
    classes: tuple[TrafficClass, ...]
    engines: Engines | None = None
    proxy_settings: dict[str, Any] | None = None
    arms: tuple[ArmSpec, ...] = tuple(ArmSpec(name=a, via=a) for a in ARMS)
    bars: tuple[Bar, ...] = ()
    tenants: tuple[Tenant, ...] = ()

    @staticmethod
    def arms_default() -> tuple[ArmSpec, ...]:
        return tuple(ArmSpec(name=a, via=a) for a in ARMS)

    def tenant_names(self) -> list[str]:
        """The tenants that send something, in the file's order: "" first for the
        top-level classes (no key) if there are any, then each tenant with a class."""
        return list(dict.fromkeys(c.tenant for c in self.classes))

    def headers(self, cls: TrafficClass) -> dict[str, str]:
        """The headers every request of ``cls`` carries: its tenant's key, if any."""
        for tenant in self.tenants:
            if tenant.name == cls.tenant:
                return {"Authorization": f"Bearer {tenant.key}"}
        return {}

    def to_json(self) -> dict[str, Any]:
        """The workload as plain data, for ``result.json``: tenants by name and the
        proxy's name for their key (:attr:`Tenant.proxy_name`), never the key."""
        from dataclasses import asdict

        data = asdict(self)
        for c in data["classes"]:
            if c["arrival"]["trace"] is not None:
                c["arrival"]["trace"] = str(c["arrival"]["trace"])
        data["tenants"] = [{"name": t.name, "proxy_name": t.proxy_name} for t in self.tenants]
        return data


def load_workload(path: Path) -> Workload:
    """The workload in ``path``; :class:`WorkloadError` naming the key if it is bad."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise WorkloadError(f"{path}: {exc}") from exc
    try:
        return parse_workload(data, base=path.parent)
    except WorkloadError as exc:
        raise WorkloadError(f"{path}: {exc}") from None


def narrowed(
    workload: Workload, arms: list[str] | None = None, warm_runs: int | None = None
) -> tuple[Workload, list[Bar]]:
    """``workload`` with only the named ``arms`` (in the file's order) and
    ``warm_runs`` warm runs, and the bars left out because an arm they judge is not
    run. :class:`WorkloadError` for an arm the file does not name, or fewer than one
    warm run."""
    if warm_runs is not None and warm_runs < 1:
        raise WorkloadError(f"warm runs: at least 1, got {warm_runs}")
    plan = workload.plan if warm_runs is None else replace(workload.plan, warm_runs=warm_runs)
    if arms is None:
        return replace(workload, plan=plan), []
    known = [a.name for a in workload.arms]
    unknown = [a for a in arms if a not in known]
    if unknown:
        raise WorkloadError(f"arms: {unknown} not in the file's arms {known}")
    kept = tuple(a for a in workload.arms if a.name in arms)
    names = {a.name for a in kept}

    def judged(bar: Bar) -> bool:
        if bar.all_valid:
            return True
        return bar.arm in names if bar.arm else set(bar.ratio) <= names

    bars = tuple(b for b in workload.bars if judged(b))
    left_out = [b for b in workload.bars if not judged(b)]
    return replace(workload, plan=plan, arms=kept, bars=bars), left_out


def parse_workload(data: Any, *, base: Path) -> Workload:
    """The workload from parsed YAML; trace files are relative to ``base``."""
    top = _mapping(
        data,
        "",
        {"name", "model", "seed", "plan", "classes", "tenants", "engines", "proxy", "arms", "bars"},
    )
    plain = _mapping(top.get("classes", {}), "classes", None)
    tenants, theirs = _tenants(top.get("tenants", []), base)
    classes = (*(_class(str(k), v, base) for k, v in plain.items()), *theirs)
    if not classes:
        raise WorkloadError("classes: at least one traffic class is needed")
    names = {c.name for c in classes}
    if len(names) != len(classes):
        raise WorkloadError("classes: a top-level class is named as a tenant's (TENANT/CLASS)")
    servers = _servers(top, names)
    return Workload(
        name=_typed(top, "name", str, "", "workload"),
        model=_typed(top, "model", str, "", "tiny"),
        seed=_typed(top, "seed", int, "", 0),
        plan=_plan(top.get("plan", {})),
        classes=classes,
        **servers,
        bars=_bars(top.get("bars", []), names, servers.get("arms", Workload.arms_default())),
        tenants=tenants,
    )


def _tenants(data: Any, base: Path) -> tuple[tuple[Tenant, ...], list[TrafficClass]]:
    """The ``tenants`` list: each tenant, and its classes named ``TENANT/CLASS``."""
    if not isinstance(data, list):
        raise WorkloadError("tenants: must be a list")
    tenants: list[Tenant] = []
    classes: list[TrafficClass] = []
    for n, item in enumerate(data):
        at = f"tenants[{n}]"
        d = _mapping(item, at, {"name", "key", "key_env", "classes"})
        name = _typed(d, "name", str, at + ".", None)
        if not TENANT_NAME.fullmatch(name):
            raise WorkloadError(f"{at}.name: letters, digits, - and _ only, not {name!r}")
        if name in (t.name for t in tenants):
            raise WorkloadError(f"{at}.name: {name!r} is named twice")
        key = _key(d, at)
        for m, other in enumerate(tenants):
            if other.key == key:
                # the proxy tells tenants apart by key: these two would be one
                raise WorkloadError(f"{at}.key: the same key as tenants[{m}] ({other.name})")
        own = _mapping(d.get("classes"), f"{at}.classes", None)
        if not own:
            raise WorkloadError(f"{at}.classes: at least one traffic class is needed")
        tenants.append(Tenant(name=name, key=key))
        for cls, value in own.items():
            parsed = _class(f"{name}/{cls}", value, base, at=f"{at}.classes.{cls}.")
            classes.append(replace(parsed, tenant=name))
    return tuple(tenants), classes


def _key(d: dict[str, Any], at: str) -> str:
    """A tenant's key: ``key`` as written, or ``key_env``'s variable read now. An
    error names the key or the variable, never the secret."""
    if ("key" in d) == ("key_env" in d):
        raise WorkloadError(f"{at}.key: give key or key_env, one of them")
    if "key" in d:
        key = _typed(d, "key", str, at + ".", None)
    else:
        var = _typed(d, "key_env", str, at + ".", None)
        if var not in os.environ:
            raise WorkloadError(f"{at}.key_env: the variable {var} is not set")
        key = os.environ[var]
    if not key or any(c.isspace() for c in key):
        raise WorkloadError(f"{at}.key: empty, or with a space in it")
    return str(key)


def _servers(top: dict[str, Any], classes: set[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "engines" in top:
        d = _mapping(
            top["engines"], "engines", {"command", "count", "health", "ready_timeout_s", "env"}
        )
        env = _mapping(d.get("env", {}), "engines.env", None)
        timeout = float(_typed(d, "ready_timeout_s", (int, float), "engines.", 120.0))
        if timeout <= 0:
            raise WorkloadError("engines.ready_timeout_s: must be positive")
        command = _typed(d, "command", str, "engines.", None)
        if "{port}" not in command:
            raise WorkloadError("engines.command: must contain {port}")
        out["engines"] = Engines(
            command=command,
            count=_positive(d, "count", "engines.") if "count" in d else 1,
            health=_typed(d, "health", str, "engines.", "/health"),
            ready_timeout_s=timeout,
            env={str(k): str(v) for k, v in env.items()},
        )
    if "proxy" in top:
        if "engines" not in top:
            raise WorkloadError("proxy: only with engines (the proxy is started in front of them)")
        d = _mapping(top["proxy"], "proxy", {"settings"})
        out["proxy_settings"] = dict(_mapping(d.get("settings", {}), "proxy.settings", None))
    if "arms" in top:
        arms = top["arms"]
        if not isinstance(arms, list) or not arms:
            raise WorkloadError(f"arms: a list of arms, not {arms!r}")
        out["arms"] = tuple(_arm(a, n, top, classes) for n, a in enumerate(arms))
        names = [a.name for a in out["arms"]]
        if len(set(names)) != len(names):
            raise WorkloadError(f"arms: names must differ: {names}")
    elif "engines" in top and "proxy" not in top:
        out["arms"] = (ArmSpec(name="direct", via="direct"),)
    return out


def _plan(data: Any) -> Plan:
    d = _mapping(data, "plan", {"cold", "warm_runs", "duration_s", "warmup_s"})
    plan = Plan(
        cold=_typed(d, "cold", bool, "plan.", False),
        warm_runs=_typed(d, "warm_runs", int, "plan.", 1),
        duration_s=float(_typed(d, "duration_s", (int, float), "plan.", 40.0)),
        warmup_s=float(_typed(d, "warmup_s", (int, float), "plan.", 8.0)),
    )
    if plan.warm_runs < 1:
        raise WorkloadError("plan.warm_runs: must be at least 1")
    if not 0 <= plan.warmup_s < plan.duration_s:
        raise WorkloadError("plan.warmup_s: must be at least 0 and below plan.duration_s")
    return plan


def _class(name: str, data: Any, base: Path, *, at: str = "") -> TrafficClass:
    at = at or f"classes.{name}."
    keys = {"route", "api", "arrival", "prompt", "max_tokens", "temperature", "job_lines", "poll_s",
            "model"}  # fmt: skip
    d = _mapping(data, at.rstrip("."), keys)
    prompt = _mapping(d.get("prompt"), at + "prompt", {"source", "chars"})
    source = _typed(prompt, "source", str, at + "prompt.", "python-docs")
    if source not in SOURCES:
        raise WorkloadError(f"{at}prompt.source: one of {', '.join(SOURCES)}, not {source!r}")
    chars = _positive(prompt, "chars", at + "prompt.") if "chars" in prompt else None
    if chars is None and source in NEEDS_CHARS:
        raise WorkloadError(f"{at}prompt.chars: missing (source {source} needs it)")
    return TrafficClass(
        name=name,
        route=_choice(d, "route", ROUTES, at),
        api=_choice(d, "api", APIS, at),
        arrival=_arrival(d.get("arrival"), at + "arrival", base),
        prompt_chars=chars,
        prompt_source=source,
        max_tokens=_positive(d, "max_tokens", at),
        temperature=float(_typed(d, "temperature", (int, float), at, 0.0)),
        model=_typed(d, "model", str, at, ""),
        **_job(d, at),
    )


def _job(d: dict[str, Any], at: str) -> dict[str, Any]:
    if d.get("route") != "batch-api":
        for key in ("job_lines", "poll_s"):
            if key in d:
                raise WorkloadError(f"{at}{key}: only for route batch-api")
        return {}
    poll = float(_typed(d, "poll_s", (int, float), at, 1.0))
    if poll <= 0:
        raise WorkloadError(f"{at}poll_s: must be positive")
    return {"job_lines": _positive(d, "job_lines", at), "poll_s": poll}


def _arrival(data: Any, at: str, base: Path) -> Arrival:
    d = _mapping(data, at, {"process", "rate", "burstiness", "concurrency", "file"})
    process = _choice(d, "process", PROCESSES, at + ".")
    if process == "closed":
        return Arrival(process=process, concurrency=_positive(d, "concurrency", at + "."))
    if process == "periodic":
        rate = float(_typed(d, "rate", (int, float), at + ".", None))
        if rate <= 0:
            raise WorkloadError(f"{at}.rate: must be positive")
        if "burstiness" in d:
            raise WorkloadError(f"{at}.burstiness: a periodic process has none")
        return Arrival(process=process, rate=rate)
    if process == "trace":
        file = base / _typed(d, "file", str, at + ".", None)
        if not file.is_file():
            raise WorkloadError(f"{at}.file: no such file: {file}")
        return Arrival(process=process, trace=file)
    rate = float(_typed(d, "rate", (int, float), at + ".", None))
    burstiness = float(_typed(d, "burstiness", (int, float), at + ".", 1.0))
    if rate <= 0 or burstiness <= 0:
        raise WorkloadError(f"{at}.rate, {at}.burstiness: must be positive")
    return Arrival(process=process, rate=rate, burstiness=burstiness)


FIGURES = (
    "ttft_p50",
    "ttft_p95",
    "ttft_p99",
    "itl_p50",
    "itl_p95",
    "tpot_p50",
    "done_p50",
    "done_p95",
    "queue_p95",
    "valid_per_hour",
    "records_per_hour",
    "worst_gap_p50",
)


def _bars(data: Any, classes: set[str], arms: tuple[ArmSpec, ...]) -> tuple[Bar, ...]:
    if not isinstance(data, list):
        raise WorkloadError("bars: must be a list")
    names = {a.name for a in arms}
    out = []
    for n, item in enumerate(data):
        at = f"bars[{n}]."
        keys = {"figure", "ratio", "arm", "above", "at_most", "all_valid"}
        d = _mapping(item, at.rstrip("."), keys)
        if d.get("all_valid") is True and len(d) == 1:
            out.append(Bar(all_valid=True))
            continue
        figure = _typed(d, "figure", str, at, None)
        cls, _, name = figure.partition(".")
        if cls not in classes or name not in FIGURES:
            raise WorkloadError(f"{at}figure: CLASS.FIGURE, FIGURE one of {', '.join(FIGURES)}")
        if ("above" in d) == ("at_most" in d):
            raise WorkloadError(f"{at}above: give above or at_most, one of them")
        above = float(_typed(d, "above", (int, float), at, None)) if "above" in d else None
        at_most = float(_typed(d, "at_most", (int, float), at, None)) if "at_most" in d else None
        if "arm" in d:
            if "ratio" in d:
                raise WorkloadError(f"{at}arm: give ratio or arm, one of them")
            arm = _typed(d, "arm", str, at, None)
            if arm not in names:
                raise WorkloadError(f"{at}arm: one of {', '.join(sorted(names))}")
            out.append(Bar(figure=figure, arm=arm, above=above, at_most=at_most))
            continue
        ratio = d.get("ratio")
        if not isinstance(ratio, list) or len(ratio) != 2 or not set(ratio) <= names:
            raise WorkloadError(f"{at}ratio: two arms of {', '.join(sorted(names))}")
        out.append(Bar(figure=figure, ratio=(ratio[0], ratio[1]), above=above, at_most=at_most))
    return tuple(out)


def _arm(data: Any, n: int, top: dict[str, Any], classes: set[str]) -> ArmSpec:
    if isinstance(data, str):
        data = {"name": data, "via": data}
    d = _mapping(data, f"arms[{n}]", {"name", "via", "engine_args", "priority", "proxy_engine"})
    at = f"arms[{n}]."
    via = _choice(d, "via", ARMS, at)
    if via == "proxy" and "engines" in top and "proxy" not in top:
        raise WorkloadError(f"{at}via: the proxy arm needs a proxy key (settings may be empty)")
    priority = _mapping(d.get("priority", {}), at + "priority", None)
    for cls, value in priority.items():
        if cls not in classes:
            raise WorkloadError(f"{at}priority.{cls}: no such class")
        if not isinstance(value, int) or isinstance(value, bool):
            raise WorkloadError(f"{at}priority.{cls}: wrong type: {value!r}")
    proxy_engine = _mapping(d.get("proxy_engine", {}), at + "proxy_engine", None)
    if proxy_engine and via != "proxy":
        raise WorkloadError(f"{at}proxy_engine: only for an arm via the proxy")
    engine_args = _typed(d, "engine_args", str, at, "")
    if engine_args and "engines" not in top:
        raise WorkloadError(f"{at}engine_args: only with engines (the harness starts them)")
    return ArmSpec(
        name=_typed(d, "name", str, at, None),
        via=via,
        engine_args=engine_args,
        priority={str(k): int(v) for k, v in priority.items()},
        proxy_engine={str(k): v for k, v in proxy_engine.items()},
    )


def _mapping(data: Any, at: str, keys: set[str] | None) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise WorkloadError(f"{at or 'the file'}: must be a mapping")
    unknown = sorted(set(map(str, data)) - keys) if keys is not None else []
    if unknown:
        where = f"{at}." if at else ""
        raise WorkloadError(f"{where}{unknown[0]}: unknown key")
    return data


def _typed(d: dict[str, Any], key: str, kind: Any, at: str, default: Any) -> Any:
    if key not in d:
        if default is None:
            raise WorkloadError(f"{at}{key}: missing")
        return default
    value = d[key]
    if isinstance(value, bool) and kind is not bool:
        raise WorkloadError(f"{at}{key}: wrong type: {value!r}")
    if not isinstance(value, kind):
        raise WorkloadError(f"{at}{key}: wrong type: {value!r}")
    return value


def _positive(d: dict[str, Any], key: str, at: str) -> int:
    value = _typed(d, key, int, at, None)
    if value < 1:
        raise WorkloadError(f"{at}{key}: must be at least 1")
    return int(value)


def _choice(d: dict[str, Any], key: str, choices: tuple[str, ...], at: str) -> str:
    value = _typed(d, key, str, at, None)
    if value not in choices:
        raise WorkloadError(f"{at}{key}: one of {', '.join(choices)}, not {value!r}")
    return str(value)
