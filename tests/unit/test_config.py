"""Settings: defaults < YAML file < ``WHOSETURN_*`` environment < flags, and validation
errors that name the key at fault."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

from proxy.config import (
    DEFAULT_CONFIG_FILE,
    BudgetConfig,
    ConfigError,
    EngineConfig,
    Settings,
    Tenant,
    TenantLimits,
    key_tenant_name,
    load_settings,
    settings_from_dict,
)

URL = "http://127.0.0.1:8000"


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def load(tmp_path: Path, env: dict[str, str] | None = None, **kwargs: Any) -> Settings:
    """``load_settings`` with a controlled environment and working directory."""
    return load_settings(env=env or {}, cwd=tmp_path, **kwargs)


def from_env(tmp_path: Path, **variables: str) -> Settings:
    """:func:`load` from an environment naming ``URL`` as the engine and holding
    ``WHOSETURN_NAME`` for each ``NAME`` of ``variables``."""
    env = {f"WHOSETURN_{name}": value for name, value in variables.items()}
    return load(tmp_path, {"WHOSETURN_ENGINES": URL, **env})


# -- defaults and shapes ------------------------------------------------------------------


def test_defaults_for_a_bare_url() -> None:
    s = settings_from_dict({"engines": [URL + "/"]})
    assert s.engines == (EngineConfig(url=URL, name="engine-0"),)
    assert s.engines[0].budget == BudgetConfig()
    assert (s.serving.host, s.serving.port, s.access.class_override, s.access.api_keys) == (
        "127.0.0.1",
        8080,
        None,
        (),
    )


def test_engine_mapping_in_full() -> None:
    s = settings_from_dict(
        {
            "engines": [
                {
                    "url": URL,
                    "name": "a",
                    "models": ["tiny", "other"],
                    "scheduling_policy": "priority",
                    "max_inflight": 8,
                    "batch_max_inflight": 2,
                    "kv_high_watermark": 0.5,
                    "budget": {"initial_tokens": 1000, "min_tokens": 100, "max_tokens": 2000},
                },
                "http://10.0.0.2:8000",
            ],
            "class_override": ["k1", "k2"],
            "api_keys": ["k1"],
        }
    )
    a, b = s.engines
    assert a.models == ("tiny", "other")
    assert a.scheduling_policy == "priority"
    assert a.budget == BudgetConfig(initial_tokens=1000, min_tokens=100, max_tokens=2000)
    assert b.name == "engine-1"
    assert s.access.class_override == ("k1", "k2")
    assert s.access.api_keys == ("k1",)


# -- precedence ---------------------------------------------------------------------------


def test_file_then_env_then_overrides(tmp_path: Path) -> None:
    config = write(
        tmp_path / "c.yaml",
        f"host: 0.0.0.0\nport: 9000\nttft_target_s: 0.5\ngap_target_s: 0.2\nengines: [{URL}]\n",
    )
    env = {"WHOSETURN_PORT": "9100", "WHOSETURN_TTFT_TARGET_S": "0.4"}
    s = load(tmp_path, env, config_file=str(config), overrides={"port": 9200, "host": None})
    assert s.serving.port == 9200  # flag beats env beats file
    assert s.serving.ttft_target_s == 0.4  # env beats file
    assert s.serving.gap_target_s == 0.2  # file alone
    assert s.serving.host == "0.0.0.0"  # a flag left unset (None) does not override


def test_env_engines_replace_file_engines(tmp_path: Path) -> None:
    config = write(tmp_path / "c.yaml", f"engines: [{URL}]\n")
    env = {"WHOSETURN_ENGINES": "http://x:1, http://y:2/,"}
    s = load(tmp_path, env, config_file=str(config))
    assert [e.url for e in s.engines] == ["http://x:1", "http://y:2"]


def test_flag_engines_replace_env_engines(tmp_path: Path) -> None:
    env = {"WHOSETURN_ENGINES": "http://x:1"}
    s = load(tmp_path, env, overrides={"engines": [{"url": "http://z:3"}]})
    assert [e.url for e in s.engines] == ["http://z:3"]


def test_default_file_in_cwd_is_picked_up(tmp_path: Path) -> None:
    write(tmp_path / DEFAULT_CONFIG_FILE, f"port: 8181\nengines: [{URL}]\n")
    assert load(tmp_path).serving.port == 8181


def test_whoseturn_config_env_names_the_file(tmp_path: Path) -> None:
    write(tmp_path / DEFAULT_CONFIG_FILE, f"port: 8181\nengines: [{URL}]\n")
    other = write(tmp_path / "other.yaml", f"port: 8282\nengines: [{URL}]\n")
    assert load(tmp_path, {"WHOSETURN_CONFIG": str(other)}).serving.port == 8282


def test_no_file_and_no_engines_says_how_to_give_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^engines: .*--engine URL"):
        load(tmp_path)


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.yaml: cannot read"):
        load(tmp_path, config_file=str(tmp_path / "nope.yaml"))


@pytest.mark.parametrize(
    ("text", "why"),
    [("port: [1\n", "not valid YAML"), ("- a\n- b\n", "expected a mapping at top level")],
)
def test_bad_config_file(tmp_path: Path, text: str, why: str) -> None:
    config = write(tmp_path / "c.yaml", text)
    with pytest.raises(ConfigError, match=rf"c\.yaml: {why}"):
        load(tmp_path, config_file=str(config))


# -- validation: every error names its key ------------------------------------------------


def engine(**fields: Any) -> dict[str, Any]:
    return {"engines": [{"url": URL, **fields}]}


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"engines": [URL], "prot": 80}, r"settings: unknown key 'prot'"),
        (engine(modles=["x"]), r"engines\[0\]: unknown key 'modles'"),
        (engine(budget={"initial": 1}), r"engines\[0\]\.budget: unknown key 'initial'"),
        ({"engines": ["localhost:8000"]}, r"engines\[0\]\.url: expected http\(s\)"),
        ({"engines": ["ftp://h:1"]}, r"engines\[0\]\.url"),
        ({"engines": ["http://"]}, r"engines\[0\]\.url"),
        ({"engines": [{"name": "a"}]}, r"engines\[0\]\.url"),
        ({"engines": [42]}, r"engines\[0\]: expected a URL or a mapping"),
        ({"engines": "http://h:1"}, r"engines: expected a list"),
        ({"engines": []}, r"engines: at least one engine"),
        (
            {"engines": [{"url": URL, "name": "a"}, {"url": "http://h:2", "name": "a"}]},
            r"engines: names must be unique",
        ),
        (
            {"engines": [{"url": URL, "name": "engine-1"}, "http://h:2"]},
            r"engines: names must be unique",
        ),
        (engine(budget={"min_tokens": 0}), r"engines\[0\]\.budget: need 0 < min_tokens"),
        (engine(budget={"min_tokens": 9000}), r"engines\[0\]\.budget: need"),
        (engine(budget={"initial_tokens": 70000}), r"engines\[0\]\.budget: need"),
        (engine(budget=[1, 2]), r"engines\[0\]\.budget: expected a mapping"),
        (engine(models="tiny"), r"engines\[0\]\.models: expected a list"),
        (engine(scheduling_policy="lifo"), r"engines\[0\]\.scheduling_policy: expected fcfs"),
        (engine(max_inflight=0), r"engines\[0\]: max_inflight"),
        (engine(batch_max_inflight=0), r"engines\[0\]: max_inflight"),
        (engine(kv_high_watermark=1.5), r"engines\[0\]\.kv_high_watermark"),
        (engine(kv_high_watermark=0), r"engines\[0\]\.kv_high_watermark"),
        (engine(piecing="sometimes"), r"engines\[0\]\.piecing: expected off, on or auto"),
        (engine(piece_tokens=0), r"engines\[0\]\.piece_tokens: must be at least 1"),
        ({"engines": [URL], "port": 0}, r"^port: expected 1\.\.65535"),
        ({"engines": [URL], "port": 65536}, r"^port: expected 1\.\.65535"),
        ({"engines": [URL], "ttft_target_s": 0}, r"^targets: .*ttft_target_s"),
        ({"engines": [URL], "gap_target_s": -1}, r"^targets: .*gap_target_s"),
        ({"engines": [URL], "health_interval_s": 0}, r"^health_interval_s: must be positive"),
        ({"engines": [URL], "class_override": "yes"}, r"^class_override: expected true"),
        ({"engines": [URL], "idle_timeout_s": 0}, r"^(idle_timeout_s|timeouts):"),
        ({"engines": [URL], "first_byte_timeout_s": -1}, r"^(first_byte_timeout_s|timeouts):"),
        (
            {"engines": [URL], "outlier_consecutive_errors": 0},
            r"^(outlier_consecutive_errors|timeouts):",
        ),
        ({"engines": [URL], "batch_min_share": 1.0}, r"^batch_min_share:"),
        ({"engines": [URL], "batch_min_share": -0.1}, r"^batch_min_share:"),
        ({"engines": [URL], "hold_timeout_s": 0}, r"^hold_timeout_s:"),
        ({"engines": [URL], "batch_abort": "sometimes"}, r"^batch_abort:"),
        ({"engines": [URL], "batch_abort_max": 0}, r"^batch_abort_max:"),
        ({"engines": [URL], "batch_abort_max": 1.5}, r"^batch_abort_max:"),
    ],
)
def test_validation_names_the_key(data: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        settings_from_dict(data)


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"engines": [URL], "port": "http"}, r"^port: expected an integer"),
        ({"engines": [URL], "port": True}, r"^port: expected an integer"),
        ({"engines": [URL], "ttft_target_s": "fast"}, r"^ttft_target_s: expected a number"),
        ({"engines": [URL], "host": 5}, r"^host: expected a string"),
        (engine(max_inflight="many"), r"engines\[0\]\.max_inflight: expected an integer"),
        (engine(kv_high_watermark="0.9"), r"engines\[0\]\.kv_high_watermark: expected a num"),
        (engine(budget={"min_tokens": 1.5}), r"engines\[0\]\.budget\.min_tokens: expected an"),
    ],
)
def test_wrongly_typed_values_name_the_key(data: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        settings_from_dict(data)


def test_piecing_in_yaml_reads_a_bare_off_or_on(tmp_path: Path) -> None:
    text = f"engines:\n  - {{url: {URL}, piecing: off}}\n  - {{url: {URL}, piecing: on}}\n"
    text += f"  - {{url: {URL}, piecing: auto, piece_tokens: 256}}\n  - {URL}\n"
    settings = load(tmp_path, config_file=str(write(tmp_path / "w.yaml", text)))
    assert [e.piecing for e in settings.engines] == [
        "off",
        "on",
        "auto",
        "auto",
    ]  # auto: the default
    assert [e.piece_tokens for e in settings.engines] == [512, 512, 256, 512]


def test_integral_float_targets_accepted() -> None:
    s = settings_from_dict({"engines": [URL], "ttft_target_s": 1, "gap_target_s": 0.05})
    assert s.serving.ttft_target_s == 1.0
    assert isinstance(s.serving.ttft_target_s, float)


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("WHOSETURN_PORT", "eighty"),
        ("WHOSETURN_TTFT_TARGET_S", "fast"),
        ("WHOSETURN_GAP_TARGET_S", ""),
    ],
)
def test_bad_env_value_names_the_variable(tmp_path: Path, var: str, value: str) -> None:
    env = {"WHOSETURN_ENGINES": URL, var: value}
    with pytest.raises(ConfigError, match=f"^{var}: cannot read"):
        load(tmp_path, env)


def test_env_value_is_validated_like_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^port:"):
        load(tmp_path, {"WHOSETURN_ENGINES": URL, "WHOSETURN_PORT": "70000"})


def test_config_error_is_a_value_error() -> None:
    # The CLI turns ValueError into "whoseturn: error: ..." and exit status 2.
    assert issubclass(ConfigError, ValueError)


# -- limits and timeouts ----------------------------------------------------------------


def test_max_body_bytes_defaults_to_8_mib_and_reads_the_env(tmp_path: Path) -> None:
    assert load(tmp_path, {"WHOSETURN_ENGINES": URL}).edge.max_body_bytes == 8 * 1024 * 1024
    env = {"WHOSETURN_ENGINES": URL, "WHOSETURN_MAX_BODY_BYTES": "65536"}
    assert load(tmp_path, env).edge.max_body_bytes == 65536


@pytest.mark.parametrize("value", [0, 1023, "big", 1.5])
def test_max_body_bytes_refuses_nonsense(value: object) -> None:
    with pytest.raises(ConfigError, match=r"^max_body_bytes:"):
        settings_from_dict({"engines": [URL], "max_body_bytes": value})


def test_read_timeouts_from_the_env(tmp_path: Path) -> None:
    s = from_env(tmp_path, FIRST_BYTE_TIMEOUT_S="12.5", IDLE_TIMEOUT_S="3")
    assert (s.upstream.first_byte_timeout_s, s.upstream.idle_timeout_s) == (12.5, 3.0)


def test_drain_timeout_from_the_env_and_never_negative(tmp_path: Path) -> None:
    env = {"WHOSETURN_ENGINES": URL, "WHOSETURN_DRAIN_TIMEOUT_S": "7"}
    assert load(tmp_path, env).serving.drain_timeout_s == 7.0
    with pytest.raises(ConfigError, match=r"^drain_timeout_s:"):
        settings_from_dict({"engines": [URL], "drain_timeout_s": -1})


def test_hold_rules_from_the_file_and_the_env(tmp_path: Path) -> None:
    s = settings_from_dict({"engines": [URL]})
    assert (s.sharing.batch_min_share, s.sharing.hold_timeout_s) == (0.05, 10.0)
    s = settings_from_dict({"engines": [URL], "batch_min_share": 0.2, "hold_timeout_s": 3})
    assert (s.sharing.batch_min_share, s.sharing.hold_timeout_s) == (0.2, 3.0)
    s = from_env(tmp_path, BATCH_MIN_SHARE="0.1", HOLD_TIMEOUT_S="2.5")
    assert (s.sharing.batch_min_share, s.sharing.hold_timeout_s) == (0.1, 2.5)


def test_batch_abort_from_the_file_and_the_env(tmp_path: Path) -> None:
    s = settings_from_dict({"engines": [URL]})
    assert (s.sharing.batch_abort, s.sharing.batch_abort_max) == ("auto", 3)
    text = f"engines: [{URL}]\nbatch_abort: off\nbatch_abort_max: 5\n"  # a bare off: a bool
    s = load(tmp_path, config_file=str(write(tmp_path / "w.yaml", text)))
    assert (s.sharing.batch_abort, s.sharing.batch_abort_max) == ("off", 5)
    env = {"WHOSETURN_ENGINES": URL, "WHOSETURN_BATCH_ABORT": "on"}
    s = load(tmp_path, env | {"WHOSETURN_BATCH_ABORT_MAX": "1"})
    assert (s.sharing.batch_abort, s.sharing.batch_abort_max) == ("on", 1)


def test_dns_engine_groups_and_their_interval() -> None:
    settings = settings_from_dict(
        {"dns_interval_s": 2, "engines": ["dns+http://vllm-headless.ns.svc:8000", "http://b:1"]}
    )
    assert settings.upstream.dns_interval_s == 2.0
    assert [e.by_dns for e in settings.engines] == [True, False]
    with pytest.raises(ConfigError, match=r"engines\[0\].url: expected http\(s\)://host:port or"):
        settings_from_dict({"engines": ["dns+ftp://x:1"]})
    with pytest.raises(ConfigError, match="dns_interval_s: must be positive"):
        settings_from_dict({"engines": ["http://b:1"], "dns_interval_s": 0})


# -- worker processes -------------------------------------------------------------------

DSN = "postgresql://ledger@127.0.0.1/whoseturn"


def test_workers_default_to_one_and_read_the_env(tmp_path: Path) -> None:
    assert settings_from_dict({"engines": [URL]}).replicas.workers == 1
    env = {"WHOSETURN_ENGINES": URL, "WHOSETURN_WORKERS": "3", "WHOSETURN_LEDGER_DSN": DSN}
    assert load(tmp_path, env).replicas.workers == 3


def test_several_workers_without_a_dsn_share_a_ledger_file_in_the_data_dir(
    tmp_path: Path,
) -> None:
    data = {"engines": [URL], "workers": 2, "data_dir": str(tmp_path)}
    settings = settings_from_dict(data)
    assert settings.replicas.ledger_path == str(tmp_path / "ledger.sqlite3")
    assert not settings.replicas.ledger_dsn
    assert settings_from_dict({**data, "ledger_path": "/l.db"}).replicas.ledger_path == "/l.db"
    with_dsn = settings_from_dict({**data, "ledger_dsn": DSN}).replicas
    assert (with_dsn.ledger_dsn, with_dsn.ledger_path) == (DSN, "")
    alone = settings_from_dict({"engines": [URL], "data_dir": str(tmp_path)})
    assert alone.replicas.ledger_path == "", "one process shares nothing"


def test_a_ledger_in_two_places_is_refused() -> None:
    with pytest.raises(ConfigError) as caught:
        settings_from_dict({"engines": [URL], "ledger_dsn": DSN, "ledger_path": "/l.db"})
    assert caught.value.where == "ledger_path"
    assert "set one of them" in caught.value.why


@pytest.mark.parametrize("value", [0, -1])
def test_workers_must_be_at_least_one(value: int) -> None:
    with pytest.raises(ConfigError, match="workers: must be at least 1"):
        settings_from_dict({"engines": [URL], "workers": value, "ledger_dsn": DSN})


def test_several_workers_share_the_sqlite_batch_store() -> None:
    data = {"engines": [URL], "workers": 2, "batch_store_path": "/tmp/b.db"}
    settings = settings_from_dict(data)
    assert settings.batch.on and settings.batch.store_path == "/tmp/b.db"


# -- tenants: keys with a policy, secrets from a file or the environment ---------------------


def keys(*entries: Any, env: dict[str, str] | None = None) -> Settings:
    return settings_from_dict({"engines": [URL], "api_keys": list(entries)}, env=env or {})


def test_a_key_without_a_tenant_is_its_own_tenant_of_weight_one() -> None:
    s = keys("sk-one", {"key": "sk-two"})
    one, two = s.access.key_policies()
    digest = hashlib.sha256(b"sk-one").hexdigest()[:8]
    assert one.tenant == f"key-{digest}" == key_tenant_name("sk-one")
    assert two.tenant != one.tenant
    assert (one.weight, one.tier, one.limits) == (1.0, "standard", TenantLimits())
    assert s.access.tenant_names() == (one.tenant, two.tenant)
    assert s.access.tenant(one.tenant) == Tenant(name=one.tenant, configured=True)


def test_a_tenants_policy_from_its_keys() -> None:
    limits = {"requests_per_minute": 60, "tokens_per_minute": 1000, "streams": 4}
    policy = {"tenant": "team-a", "weight": 2, "tier": "critical", "limits": limits}
    s = keys({"key": "sk-a1", **policy}, {"key": "sk-a2", **policy}, "sk-other")
    expected = Tenant(
        name="team-a",
        weight=2.0,
        tier="critical",
        limits=TenantLimits(requests_per_minute=60, tokens_per_minute=1000, streams=4),
        configured=True,
    )
    assert s.access.tenant("team-a") == expected
    assert s.access.tenant_names() == ("team-a", key_tenant_name("sk-other"))
    assert s.access.tenant("addr-10.0.0.7") == Tenant(name="addr-10.0.0.7")  # not configured
    assert "team-a" in repr(s.access.key_policies())
    for secret in ("sk-a1", "sk-other"):
        assert secret not in repr(s) and secret not in repr(s.access.key_policies())


def test_keys_of_one_tenant_must_agree() -> None:
    a = {"tenant": "team-a", "weight": 2}
    for other, field in (
        ({"tenant": "team-a", "weight": 3}, "weight"),
        ({"tenant": "team-a", "weight": 2, "tier": "sheddable"}, "tier"),
        ({"tenant": "team-a", "weight": 2, "limits": {"streams": 1}}, "limits"),
    ):
        with pytest.raises(ConfigError, match=rf"^api_keys\[2\]\.{field}: tenant 'team-a'"):
            keys({"key": "k1", **a}, "k2", {"key": "k3", **other})


def test_the_secret_from_a_file_or_the_environment(tmp_path: Path) -> None:
    secret = write(tmp_path / "key", "sk-from-file\n")
    s = keys({"key_file": str(secret)}, {"key_env": "TEAM_KEY"}, env={"TEAM_KEY": "sk-from-env"})
    assert [k.key for k in s.access.key_policies()] == ["sk-from-file", "sk-from-env"]


def test_the_secret_from_the_environment_through_load_settings(tmp_path: Path) -> None:
    config = write(tmp_path / "w.yaml", f"engines: [{URL}]\napi_keys: [{{key_env: K}}]\n")
    s = load(tmp_path, {"K": "sk-loaded"}, config_file=str(config))
    assert s.access.key_policies()[0].key == "sk-loaded"


@pytest.mark.parametrize(
    ("entry", "where"),
    [
        ({"key_file": "/no/such/file"}, r"^api_keys\[1\]\.key_file: cannot read /no/such/file"),
        ({"key_env": "UNSET_KEY"}, r"^api_keys\[1\]\.key_env: environment variable UNSET_KEY"),
        ({"key": "sk-x", "key_env": "K"}, r"^api_keys\[1\]: give one of key, key_file"),
        ({"role": "user"}, r"^api_keys\[1\]\.key: required"),
        ({"key": "sk-x", "weight": 0}, r"^api_keys\[1\]\.weight: expected a positive number"),
        ({"key": "sk-x", "weight": "heavy"}, r"^api_keys\[1\]\.weight"),
        ({"key": "sk-x", "tier": "gold"}, r"^api_keys\[1\]\.tier: expected one of"),
        ({"key": "sk-x", "limits": {"streams": 0}}, r"^api_keys\[1\]\.limits\.streams: expected"),
        ({"key": "sk-x", "limits": {"streams": 1.5}}, r"^api_keys\[1\]\.limits\.streams"),
        ({"key": "sk-x", "limits": {"rpm": 5}}, r"^api_keys\[1\]\.limits: unknown key 'rpm'"),
        ({"key": "sk-x", "limits": [5]}, r"^api_keys\[1\]\.limits: expected a mapping"),
        ({"key": "sk-x", "tenant": 7}, r"^api_keys\[1\]\.tenant: expected a name"),
    ],
)
def test_bad_tenant_entries_name_the_key_never_the_secret(
    entry: dict[str, Any], where: str, tmp_path: Path
) -> None:
    empty = write(tmp_path / "empty", "\n")
    with pytest.raises(ConfigError, match=where) as caught:
        keys("sk-first", entry, env={"K": "sk-secret-env", "EMPTY": ""})
    assert "sk-x" not in str(caught.value) and "sk-secret" not in str(caught.value)
    with pytest.raises(ConfigError, match=r"^api_keys\[0\]\.key_file: .* is empty"):
        keys({"key_file": str(empty)})


def test_fair_share_is_on_by_default_and_reads_the_file_and_the_env(tmp_path: Path) -> None:
    assert settings_from_dict({"engines": [URL]}).serving.fair_share is True
    assert settings_from_dict({"engines": [URL], "fair_share": False}).serving.fair_share is False
    assert from_env(tmp_path, FAIR_SHARE="false").serving.fair_share is False
    assert from_env(tmp_path, FAIR_SHARE="on").serving.fair_share is True
    with pytest.raises(ConfigError, match=r"^WHOSETURN_FAIR_SHARE: cannot read 'maybe'"):
        from_env(tmp_path, FAIR_SHARE="maybe")
    with pytest.raises(ConfigError, match=r"^fair_share: expected true or false"):
        settings_from_dict({"engines": [URL], "fair_share": "yes"})


# -- every error at once, with "did you mean" ----------------------------------------------


def test_every_error_is_reported_at_once_each_naming_its_key() -> None:
    data = {
        "engines": [{"url": URL, "max_inflight": 0, "piecing": "sometimes"}, "ftp://h:1"],
        "prot": 8080,
        "port": "eighty",
        "batch_min_share": 2,
        "api_keys": [{"key": "sk-x", "tier": "gold"}],
    }
    with pytest.raises(ConfigError) as caught:
        settings_from_dict(data, env={})
    wheres = [e.where for e in caught.value.errors]
    assert sorted(wheres) == sorted(
        [
            "settings",
            "engines[0]",
            "engines[0].piecing",
            "engines[1].url",
            "port",
            "batch_min_share",
            "api_keys[0].tier",
        ]
    )
    text = str(caught.value)
    assert text.startswith("7 errors in the settings:\n")
    for error in caught.value.errors:
        assert f"\n  - {error.where}: {error.why}" in text
    assert "sk-x" not in text


def test_one_error_reads_as_itself() -> None:
    with pytest.raises(ConfigError) as caught:
        settings_from_dict({"engines": [URL], "port": 0})
    assert (caught.value.where, caught.value.why, str(caught.value)) == (
        "port",
        "expected 1..65535",
        "port: expected 1..65535",
    )
    assert caught.value.errors == (caught.value,)


@pytest.mark.parametrize(
    ("data", "said"),
    [
        ({"engines": [URL], "prot": 80}, "settings: unknown key 'prot': did you mean 'port'?"),
        (
            {"engines": [URL], "batch_store_pth": "/x"},
            "settings: unknown key 'batch_store_pth': did you mean 'batch_store_path'?",
        ),
        (engine(modles=["x"]), "engines[0]: unknown key 'modles': did you mean 'models'?"),
        (
            engine(budget={"max_token": 9}),
            "engines[0].budget: unknown key 'max_token': did you mean 'max_tokens'?",
        ),
    ],
)
def test_an_unknown_key_names_the_nearest_known_one(data: dict[str, Any], said: str) -> None:
    with pytest.raises(ConfigError) as caught:
        settings_from_dict(data)
    assert str(caught.value) == said


def test_an_unknown_key_like_no_known_one_lists_them() -> None:
    with pytest.raises(
        ConfigError, match=r"^settings: unknown key 'zzz'; known: api_keys, batch_abort, "
    ):
        settings_from_dict({"engines": [URL], "zzz": 1})


def test_the_environments_errors_come_with_the_files(tmp_path: Path) -> None:
    config = write(tmp_path / "w.yaml", f"engines: [{URL}]\nhold_timout_s: 3\n")
    env = {"WHOSETURN_PORT": "eighty", "WHOSETURN_WORKERS": "many"}
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, env, config_file=str(config))
    assert [e.where for e in caught.value.errors] == [
        "WHOSETURN_PORT",
        "WHOSETURN_WORKERS",
        "settings",
    ]
    assert "did you mean 'hold_timeout_s'?" in str(caught.value)


# -- engine URLs ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "fix"),
    [
        ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000"),
        ("http://127.0.0.1:8000/v1/", "http://127.0.0.1:8000"),
        ("https://gateway/vllm-a/v1", "https://gateway/vllm-a"),
        ("dns+http://vllm-headless:8000/v1", "dns+http://vllm-headless:8000"),
    ],
)
def test_an_engine_url_ending_in_v1_is_refused_with_the_url_to_give(given: str, fix: str) -> None:
    with pytest.raises(ConfigError) as caught:
        settings_from_dict({"engines": [given]})
    assert caught.value.where == "engines[0].url"
    assert caught.value.why == (
        f"{given!r} ends in /v1: drop /v1: the proxy adds the routes itself; use {fix}"
    )
    assert settings_from_dict({"engines": [fix]}).engines[0].url == fix  # the fix loads


def test_an_engine_url_with_another_path_is_kept() -> None:
    settings = settings_from_dict({"engines": ["https://gateway/vllm-a/", "http://h:1/v1beta"]})
    assert [e.url for e in settings.engines] == ["https://gateway/vllm-a", "http://h:1/v1beta"]


# -- the Batch API on by default, in the data directory ---------------------------------------


def test_the_batch_store_defaults_to_sqlite_in_the_xdg_data_home(tmp_path: Path) -> None:
    s = settings_from_dict({"engines": [URL]}, env={"XDG_DATA_HOME": str(tmp_path)})
    assert s.serving.data_dir == str(tmp_path / "whoseturn")
    assert s.batch.store == "sqlite"
    assert s.batch.store_path == str(tmp_path / "whoseturn" / "batch.sqlite3")
    assert s.batch.on


def test_without_xdg_data_home_the_data_dir_is_under_the_home(tmp_path: Path) -> None:
    for env in ({"HOME": str(tmp_path)}, {"HOME": str(tmp_path), "XDG_DATA_HOME": "rel"}):
        s = settings_from_dict({"engines": [URL]}, env=env)  # a relative XDG path: ignored
        assert s.batch.store_path == str(tmp_path / ".local/share/whoseturn/batch.sqlite3")


def test_data_dir_from_the_file_the_environment_and_the_flag(tmp_path: Path) -> None:
    config = write(tmp_path / "w.yaml", f"engines: [{URL}]\ndata_dir: {tmp_path / 'file'}\n")
    xdg = {"XDG_DATA_HOME": str(tmp_path / "xdg")}
    s = load(tmp_path, xdg, config_file=str(config))
    assert s.batch.store_path == str(tmp_path / "file" / "batch.sqlite3")
    s = load(
        tmp_path, {**xdg, "WHOSETURN_DATA_DIR": str(tmp_path / "env")}, config_file=str(config)
    )
    assert s.batch.store_path == str(tmp_path / "env" / "batch.sqlite3")
    flag = {"data_dir": str(tmp_path / "flag")}
    s = load(tmp_path, xdg, config_file=str(config), overrides=flag)
    assert (s.serving.data_dir, s.batch.store_path) == (
        str(tmp_path / "flag"),
        str(tmp_path / "flag" / "batch.sqlite3"),
    )


def test_a_given_store_path_wins_over_the_data_dir(tmp_path: Path) -> None:
    data = {"engines": [URL], "data_dir": str(tmp_path), "batch_store_path": "/srv/jobs.db"}
    assert settings_from_dict(data).batch.store_path == "/srv/jobs.db"


def test_batch_store_off_turns_the_batch_api_off(tmp_path: Path) -> None:
    config = write(tmp_path / "w.yaml", f"engines: [{URL}]\nbatch_store: off\n")  # a bool
    for s in (
        load(tmp_path, {"XDG_DATA_HOME": str(tmp_path)}, config_file=str(config)),
        from_env(tmp_path, BATCH_STORE="off"),
    ):
        assert (s.batch.store, s.batch.store_path, s.batch.on) == ("off", "", False)


def test_several_workers_share_the_default_store(data_home: Path) -> None:
    s = settings_from_dict({"engines": [URL], "workers": 2, "ledger_dsn": DSN})
    default = str(data_home / "whoseturn" / "batch.sqlite3")
    assert (s.batch.store, s.batch.store_path, s.batch.on) == ("sqlite", default, True)


def test_the_tests_default_data_dir_is_a_temporary_one(data_home: Path) -> None:
    # tests/conftest.py: no test writes a batch store into the user's home
    store = Path(settings_from_dict({"engines": [URL]}).batch.store_path)
    assert store == data_home / "whoseturn" / "batch.sqlite3"
    assert not store.is_relative_to(Path.home() / ".local")
