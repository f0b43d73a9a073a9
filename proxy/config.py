"""The proxy's settings: YAML file, then ``WHOSETURN_*`` environment, then flags.

Everything is validated when loaded, with an error that names the bad key, so a
typo stops the proxy at start rather than at the first request. Example file::

    port: 8080
    ttft_target_s: 0.3            # interactive TTFT target (the budget loop aims below)
    gap_target_s: 0.1             # interactive inter-token gap target (p95)
    class_override: true          # honour X-Whoseturn-Class (or a list of API keys)
    engines:
      - url: http://127.0.0.1:8000
        name: engine-a            # default: engine-0, engine-1, ...
        models: [tiny]            # default: discovered from the engine's /v1/models
        scheduling_policy: fcfs   # the engine's --scheduling-policy
        max_inflight: 256
        batch_max_inflight: 64
        kv_high_watermark: 0.9
        budget: {initial_tokens: 8192, min_tokens: 512, max_tokens: 65536}

Environment: ``WHOSETURN_CONFIG``, ``WHOSETURN_HOST``, ``WHOSETURN_PORT``,
``WHOSETURN_ENGINES`` (comma-separated URLs), ``WHOSETURN_TTFT_TARGET_S``,
``WHOSETURN_GAP_TARGET_S``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

DEFAULT_CONFIG_FILE = "whoseturn.yaml"


class ConfigError(ValueError):
    """The settings are invalid; the message says which key and why."""


@dataclass(frozen=True, kw_only=True)
class BudgetConfig:
    initial_tokens: int = 8192
    min_tokens: int = 512
    max_tokens: int = 65536


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    url: str
    name: str
    models: tuple[str, ...] = ()
    scheduling_policy: str = "fcfs"
    max_inflight: int = 256
    batch_max_inflight: int = 64
    kv_high_watermark: float = 0.9
    budget: BudgetConfig = field(default_factory=BudgetConfig)


@dataclass(frozen=True, kw_only=True)
class Settings:
    engines: tuple[EngineConfig, ...]
    host: str = "127.0.0.1"
    port: int = 8080
    ttft_target_s: float = 0.300
    gap_target_s: float = 0.100
    class_override: bool | tuple[str, ...] = True
    api_keys: tuple[str, ...] = ()
    health_interval_s: float = 1.0
    scrape_interval_s: float = 1.0
    unhealthy_after: int = 2
    connect_timeout_s: float = 2.0
    decision_log_size: int = 1000


def _check(cond: bool, where: str, why: str) -> None:
    if not cond:
        raise ConfigError(f"{where}: {why}")


def _known(cls: type[Any], data: Mapping[str, Any], where: str) -> None:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    _check(not unknown, where, f"unknown keys {unknown}; known: {sorted(names)}")


_NOUNS = {"int": "an integer", "float": "a number", "str": "a string"}


def _typed(cls: type[Any], data: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """``data`` with its scalar fields checked against ``cls`` (ints pass as floats),
    so that ``port: "80"`` is an error naming ``port``, not a TypeError later."""
    out = dict(data)
    for f in dataclasses.fields(cls):
        kind = str(f.type)  # a name: annotations are postponed
        if f.name not in out or kind not in _NOUNS:
            continue
        value = out[f.name]
        if kind == "str":
            ok = isinstance(value, str)
        else:
            number = isinstance(value, int | float) and not isinstance(value, bool)
            ok = number and (kind == "float" or isinstance(value, int))
        _check(ok, prefix + f.name, f"expected {_NOUNS[kind]}, got {value!r}")
        if kind == "float":
            out[f.name] = float(value)
    return out


def _engine(data: Any, index: int) -> EngineConfig:
    where = f"engines[{index}]"
    if isinstance(data, str):
        data = {"url": data}
    _check(isinstance(data, Mapping), where, "expected a URL or a mapping")
    _known(EngineConfig, data, where)
    body = dict(data)
    url = str(body.get("url", "")).rstrip("/")
    parts = urlsplit(url)
    _check(
        parts.scheme in ("http", "https") and bool(parts.netloc),
        f"{where}.url",
        f"expected http(s)://host:port, got {url!r}",
    )
    budget_data = body.pop("budget", {}) or {}
    _check(isinstance(budget_data, Mapping), f"{where}.budget", "expected a mapping")
    _known(BudgetConfig, budget_data, f"{where}.budget")
    budget = BudgetConfig(**_typed(BudgetConfig, budget_data, f"{where}.budget."))
    _check(
        0 < budget.min_tokens <= budget.initial_tokens <= budget.max_tokens,
        f"{where}.budget",
        "need 0 < min_tokens <= initial_tokens <= max_tokens",
    )
    models = body.pop("models", ()) or ()
    _check(
        isinstance(models, list | tuple) and all(isinstance(m, str) for m in models),
        f"{where}.models",
        "expected a list of model names",
    )
    body.update(url=url, name=str(body.get("name") or f"engine-{index}"))
    cfg = EngineConfig(
        **_typed(EngineConfig, body, f"{where}."), models=tuple(models), budget=budget
    )
    _check(
        cfg.scheduling_policy in ("fcfs", "priority"),
        f"{where}.scheduling_policy",
        "expected fcfs or priority",
    )
    _check(
        cfg.max_inflight >= 1 and cfg.batch_max_inflight >= 1,
        where,
        "max_inflight and batch_max_inflight must be at least 1",
    )
    _check(0 < cfg.kv_high_watermark <= 1, f"{where}.kv_high_watermark", "expected (0, 1]")
    return cfg


def settings_from_dict(data: Mapping[str, Any]) -> Settings:
    """Validate a settings document (the merged YAML, environment and flags)."""
    _known(Settings, data, "settings")
    body = dict(data)
    engines = body.pop("engines", None) or []
    _check(isinstance(engines, list | tuple), "engines", "expected a list")
    _check(len(engines) > 0, "engines", "at least one engine is needed (--engine URL)")
    parsed = tuple(_engine(e, i) for i, e in enumerate(engines))
    names = [e.name for e in parsed]
    _check(len(set(names)) == len(names), "engines", f"names must be unique, got {names}")
    override = body.pop("class_override", True)
    if isinstance(override, list | tuple):
        override = tuple(str(k) for k in override)
    _check(
        isinstance(override, bool | tuple),
        "class_override",
        "expected true, false or a list of API keys",
    )
    keys = tuple(str(k) for k in body.pop("api_keys", ()) or ())
    try:
        settings = Settings(
            engines=parsed, class_override=override, api_keys=keys, **_typed(Settings, body, "")
        )
    except TypeError as exc:
        raise ConfigError(f"settings: {exc}") from exc
    _check(1 <= settings.port <= 65535, "port", "expected 1..65535")
    _check(
        settings.ttft_target_s > 0 and settings.gap_target_s > 0,
        "targets",
        "ttft_target_s and gap_target_s must be positive",
    )
    _check(
        settings.health_interval_s > 0 and settings.scrape_interval_s > 0,
        "intervals",
        "health_interval_s and scrape_interval_s must be positive",
    )
    _check(settings.unhealthy_after >= 1, "unhealthy_after", "must be at least 1")
    _check(settings.decision_log_size >= 1, "decision_log_size", "must be at least 1")
    _check(settings.connect_timeout_s > 0, "connect_timeout_s", "must be positive")
    return settings


_ENV: dict[str, tuple[str, type]] = {
    "WHOSETURN_HOST": ("host", str),
    "WHOSETURN_PORT": ("port", int),
    "WHOSETURN_TTFT_TARGET_S": ("ttft_target_s", float),
    "WHOSETURN_GAP_TARGET_S": ("gap_target_s", float),
}


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for var, (key, kind) in _ENV.items():
        if var in env:
            try:
                out[key] = kind(env[var])
            except ValueError as exc:
                raise ConfigError(f"{var}: cannot read {env[var]!r} as {kind.__name__}") from exc
    if env.get("WHOSETURN_ENGINES"):
        out["engines"] = [u.strip() for u in env["WHOSETURN_ENGINES"].split(",") if u.strip()]
    return out


def _from_file(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
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
    in ``cwd`` if it exists.
    """
    env = os.environ if env is None else env
    merged: dict[str, Any] = {}
    name = config_file or env.get("WHOSETURN_CONFIG")
    default = (cwd or Path.cwd()) / DEFAULT_CONFIG_FILE
    if name:
        merged.update(_from_file(Path(name)))
    elif default.exists():
        merged.update(_from_file(default))
    merged.update(_from_env(env))
    merged.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return settings_from_dict(merged)
