"""Workload files: the shipped ones load; a bad file gets an error naming the key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from loadtests.harness.traffic import body, direct_route, proxy_route, send_times
from loadtests.harness.workload_file import WorkloadError, load_workload, narrowed, parse_workload
from tests.support.workloads import batch_class, chat_class

WORKLOADS = Path(__file__).parents[2] / "loadtests" / "workloads"


def _good() -> dict[str, Any]:
    return {
        "name": "w",
        "classes": {
            "chat": chat_class({"process": "poisson", "rate": 2}, chars=100, max_tokens=8),
            "batch": batch_class(concurrency=4, chars=1000, max_tokens=4),
        },
    }


@pytest.mark.parametrize("path", sorted(WORKLOADS.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_workloads_load(path: Path) -> None:
    workload = load_workload(path)
    assert workload.classes
    assert all(c.temperature == 0 for c in workload.classes)


def test_defaults() -> None:
    w = parse_workload(_good(), base=Path())
    assert w.model == "tiny" and w.seed == 0
    assert (w.plan.cold, w.plan.warm_runs, w.plan.duration_s) == (False, 1, 40.0)
    chat = w.classes[0]
    assert chat.temperature == 0.0 and chat.arrival.burstiness == 1.0


def _set(data: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for key in parents:
        data = data[key]
    if value is KeyError:
        del data[last]
    else:
        data[last] = value


@pytest.mark.parametrize(
    ("dotted", "value", "named"),
    [
        ("classes.chat.route", "fast", "classes.chat.route: one of chat, batch"),
        ("classes.chat.arrival.process", "burst", "classes.chat.arrival.process"),
        ("classes.chat.arrival.rate", KeyError, "classes.chat.arrival.rate: missing"),
        ("classes.chat.arrival.rate", -1, "classes.chat.arrival.rate"),
        ("classes.batch.arrival.concurrency", 0, "classes.batch.arrival.concurrency"),
        ("classes.chat.max_tokens", "many", "classes.chat.max_tokens: wrong type"),
        ("classes.chat.max_tokens", True, "classes.chat.max_tokens: wrong type"),
        ("classes.chat.prompt.chars", KeyError, "classes.chat.prompt.chars: missing"),
        ("classes.chat.prompt.source", "wiki", "classes.chat.prompt.source"),
        ("classes.chat.temprature", 0, "classes.chat.temprature: unknown key"),
        ("plan", {"warm_runs": 0}, "plan.warm_runs"),
        ("plan", {"duration_s": 5, "warmup_s": 9}, "plan.warmup_s"),
        ("plan", {"cold": "yes"}, "plan.cold: wrong type"),
        ("classes", {}, "classes: at least one"),
        ("extra", 1, "extra: unknown key"),
        ("engines", {"command": "whoseturn sim"}, "engines.command: must contain {port}"),
        ("engines", {"comand": "x {port}"}, "engines.comand: unknown key"),
        ("engines", {"command": "x {port}", "count": 0}, "engines.count: must be at least 1"),
        ("proxy", {"settings": {}}, "proxy: only with engines"),
        ("arms", ["direct", "both"], "1].via: one of direct, proxy, not 'both'"),
        ("classes.chat.prompt", {"source": "rfcs"}, "classes.chat.prompt.source: one of"),
        ("classes.chat.job_lines", 5, "classes.chat.job_lines: only for route batch-api"),
        ("classes.batch.route", "batch-api", "classes.batch.job_lines: missing"),
    ],
)
def test_a_bad_file_names_the_key(dotted: str, value: Any, named: str) -> None:
    data = _good()
    _set(data, dotted, value)
    with pytest.raises(WorkloadError, match=named.replace(".", r"\.")):
        parse_workload(data, base=Path())


def test_the_error_names_the_file_too(tmp_path: Path) -> None:
    data = _good()
    data["classes"]["chat"]["arrival"] = {"process": "trace", "file": "missing.txt"}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(WorkloadError, match=r"bad\.yaml: classes\.chat\.arrival\.file: no such"):
        load_workload(path)


def test_trace_file_is_relative_to_the_workload(tmp_path: Path) -> None:
    (tmp_path / "times.txt").write_text("0.1\n0.2\n5\n")
    data = _good()
    data["classes"]["chat"]["arrival"] = {"process": "trace", "file": "times.txt"}
    data["plan"] = {"duration_s": 3, "warmup_s": 0}
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump(data))
    w = load_workload(path)
    (chat,) = [c for c in w.classes if c.name == "chat"]
    assert send_times(w, chat) == [0.1, 0.2]


def test_routes_and_bodies() -> None:
    w = parse_workload(_good(), base=Path())
    chat, batch = w.classes
    route = direct_route(["http://a", "http://b"])
    assert [route(chat), route(batch), route(chat)] == [
        "http://a/v1/chat/completions",
        "http://b/v1/completions",
        "http://a/v1/chat/completions",
    ]
    via = proxy_route("http://p")
    assert via(chat) == "http://p/v1/chat/completions"
    assert via(batch) == "http://p/batch/v1/completions"
    assert body(w, chat, 3) == body(w, chat, 3)
    assert body(w, chat, 3)["messages"][0]["content"].startswith("chat 3:")
    assert body(w, batch, 3)["prompt"] != body(w, batch, 4)["prompt"]
    assert body(w, batch, 3)["temperature"] == 0
    # a later run of the arm sends the same passage under a header of its own, so an
    # engine that caches prefixes cannot answer it from the earlier run's blocks
    first, again = body(w, batch, 3)["prompt"], body(w, batch, 3, run=1)["prompt"]
    assert again.startswith("batch 3 (run 1)") and not first.startswith("batch 3 (run")
    assert first.split("\n\n", 1)[1] == again.split("\n\n", 1)[1]
    assert body(w, batch, 3, run=1) == body(w, batch, 3, run=1)


def test_loadtest_refuses_a_bad_file_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from loadtests import cli

    data = _good()
    data["classes"]["batch"]["route"] = "bulk"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    out = tmp_path / "out"
    argv = [str(path), "--target", "http://127.0.0.1:9", "--out", str(out)]
    assert cli.main("loadtest", argv) == 2
    message = "classes.batch.route: one of chat, batch, batch-api, not 'bulk'"
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_engines_proxy_and_arms() -> None:
    data = _good()
    data["engines"] = {"command": "whoseturn sim --port {port}", "count": 2}
    w = parse_workload(data, base=Path())
    assert w.engines is not None and w.engines.count == 2 and w.engines.health == "/health"
    assert [a.name for a in w.arms] == [
        "direct"
    ]  # no proxy key: nothing to put in front of the engines
    data["proxy"] = {"settings": {"scrape_interval_s": 0.5}}
    w = parse_workload(data, base=Path())
    assert [a.via for a in w.arms] == ["direct", "proxy"] and w.proxy_settings == {
        "scrape_interval_s": 0.5
    }
    del data["proxy"]
    data["arms"] = ["proxy"]
    with pytest.raises(WorkloadError, match=r"arms\[0\]\.via: the proxy arm needs a proxy key"):
        parse_workload(data, base=Path())
    data["arms"] = [
        "direct",
        {
            "name": "prio",
            "via": "direct",
            "engine_args": "--scheduling-policy priority",
            "priority": {"chat": -10, "batch": 0},
        },
    ]
    w = parse_workload(data, base=Path())
    assert w.arms[1].engine_args == "--scheduling-policy priority"
    assert w.arms[1].priority == {"chat": -10, "batch": 0}


@pytest.mark.parametrize(
    ("arm", "named"),
    [
        ({"name": "a", "via": "sideways"}, r"arms\[0\]\.via: one of direct, proxy"),
        (
            {"name": "a", "via": "direct", "priority": {"bulk": 1}},
            r"arms\[0\]\.priority\.bulk: no such",
        ),
        (
            {"name": "a", "via": "direct", "priority": {"chat": "hi"}},
            r"arms\[0\]\.priority\.chat: wrong",
        ),
        ({"via": "direct"}, r"arms\[0\]\.name: missing"),
        ({"name": "a", "via": "direct", "flags": "x"}, r"arms\[0\]\.flags: unknown key"),
        (
            {"name": "a", "via": "direct", "proxy_engine": {"piecing": "on"}},
            r"arms\[0\]\.proxy_engine: only for an arm via the proxy",
        ),
    ],
)
def test_a_bad_arm_names_the_key(arm: dict[str, Any], named: str) -> None:
    data = _good()
    data["engines"] = {"command": "whoseturn sim --port {port}"}
    data["arms"] = [arm]
    with pytest.raises(WorkloadError, match=named):
        parse_workload(data, base=Path())


def test_an_arm_sets_the_proxys_engine_settings_and_a_bar_judges_one_arm() -> None:
    data = _good()
    data["engines"] = {"command": "whoseturn sim --port {port}"}
    data["proxy"] = {"settings": {}}
    data["arms"] = ["direct", {"name": "auto", "via": "proxy", "proxy_engine": {"piecing": "auto"}}]
    data["bars"] = [{"figure": "chat.ttft_p95", "arm": "auto", "at_most": 0.5}]
    w = parse_workload(data, base=Path())
    assert w.arms[1].proxy_engine == {"piecing": "auto"} and w.arms[0].proxy_engine == {}
    assert w.bars[0].arm == "auto" and w.bars[0].at_most == 0.5
    data["bars"] = [{"figure": "chat.ttft_p95", "arm": "sideways", "at_most": 0.5}]
    with pytest.raises(WorkloadError, match=r"bars\[0\]\.arm: one of auto, direct"):
        parse_workload(data, base=Path())
    bar = {"figure": "chat.ttft_p95", "arm": "auto", "ratio": ["auto", "direct"], "above": 1}
    data["bars"] = [bar]
    with pytest.raises(WorkloadError, match=r"bars\[0\]\.arm: give ratio or arm"):
        parse_workload(data, base=Path())


def test_sources_without_chars_give_whole_items() -> None:
    data = _good()
    data["classes"]["chat"]["prompt"] = {"source": "conversations"}
    w = parse_workload(data, base=Path())
    chat = w.classes[0]
    assert chat.prompt_chars is None and chat.prompt_source == "conversations"
    messages = body(w, chat, 0)["messages"]
    assert len(messages) > 1 and messages[0]["content"].startswith("chat 0.")


def test_narrowed_runs_only_the_named_arms_and_leaves_out_their_bars() -> None:
    path = Path(__file__).parents[2] / "loadtests" / "workloads" / "compare.yaml"
    full = load_workload(path)
    w, left_out = narrowed(full, ["fcfs", "proxy", "proxy-auto"], warm_runs=1)
    assert [a.name for a in w.arms] == ["fcfs", "proxy", "proxy-auto"]
    assert w.plan.warm_runs == 1 and w.plan.cold == full.plan.cold
    judged = {b.arm or tuple(b.ratio) for b in w.bars if not b.all_valid}
    assert ("priority", "proxy") not in judged and ("fcfs", "proxy") in judged
    assert "proxy-auto" in judged
    assert any(b.all_valid for b in w.bars)
    assert len(w.bars) + len(left_out) == len(full.bars)
    assert {"priority", "budget512"} & {a for b in left_out for a in b.ratio}
    assert narrowed(full) == (full, [])
    with pytest.raises(WorkloadError, match="'sideways'"):
        narrowed(full, ["fcfs", "sideways"])
    with pytest.raises(WorkloadError, match="at least 1"):
        narrowed(full, None, warm_runs=0)


# -- tenants -------------------------------------------------------------------------


def _tenants() -> dict[str, Any]:
    data = _good()
    data["tenants"] = [
        {
            "name": "quiet",
            "key": "k-quiet",
            "classes": {
                "chat": chat_class({"process": "periodic", "rate": 2}, chars=100, max_tokens=8)
            },
        },
        {
            "name": "noisy",
            "key_env": "NOISY_KEY",
            "classes": {"chat": batch_class(concurrency=32, chars=8000, max_tokens=16)},
        },
    ]
    return data


def test_tenants_name_their_classes_and_carry_their_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    import hashlib

    monkeypatch.setenv("NOISY_KEY", "k-noisy")
    w = parse_workload(_tenants(), base=Path())
    assert [(c.name, c.tenant) for c in w.classes] == [
        ("chat", ""),
        ("batch", ""),
        ("quiet/chat", "quiet"),
        ("noisy/chat", "noisy"),
    ]
    assert w.tenant_names() == ["", "quiet", "noisy"]
    quiet, noisy = w.classes[2], w.classes[3]
    assert w.headers(quiet) == {"Authorization": "Bearer k-quiet"}
    assert w.headers(noisy) == {"Authorization": "Bearer k-noisy"}
    assert w.headers(w.classes[0]) == {}
    assert quiet.arrival.process == "periodic" and send_times(w, quiet)[:3] == [0.5, 1.0, 1.5]
    assert noisy.arrival.concurrency == 32
    # the proxy's name for a key it has no config for; the key itself is never written
    assert w.tenants[0].proxy_name == "key-" + hashlib.sha256(b"k-quiet").hexdigest()[:8]
    written = w.to_json()
    assert written["tenants"] == [
        {"name": "quiet", "proxy_name": w.tenants[0].proxy_name},
        {"name": "noisy", "proxy_name": w.tenants[1].proxy_name},
    ]
    assert "k-quiet" not in repr(written) and "k-noisy" not in repr(w)
    # the prompt's header names the tenant's class, so no two tenants share a prefix
    assert body(w, quiet, 0)["messages"][0]["content"].startswith("quiet/chat 0")


def test_a_tenants_class_is_judged_and_prioritised_by_its_full_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("NOISY_KEY", "k-noisy")
    data = _tenants()
    data["engines"] = {"command": "whoseturn sim --port {port}"}
    data["proxy"] = {"settings": {}}
    data["arms"] = [{"name": "p", "via": "proxy", "priority": {"quiet/chat": -10}}]
    data["bars"] = [{"figure": "quiet/chat.ttft_p95", "arm": "p", "at_most": 0.1}]
    w = parse_workload(data, base=Path())
    assert w.arms[0].priority == {"quiet/chat": -10} and w.bars[0].figure == "quiet/chat.ttft_p95"
    data["bars"] = [{"figure": "chat/quiet.ttft_p95", "arm": "p", "at_most": 0.1}]
    with pytest.raises(WorkloadError, match=r"bars\[0\]\.figure: CLASS\.FIGURE"):
        parse_workload(data, base=Path())


def test_tenants_alone_need_no_top_level_classes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOISY_KEY", "k-noisy")
    data = _tenants()
    del data["classes"]
    w = parse_workload(data, base=Path())
    assert w.tenant_names() == ["quiet", "noisy"]


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"name": "qu iet"}, r"tenants\[0\]\.name: letters, digits, - and _ only"),
        ({"name": "noisy"}, r"tenants\[1\]\.name: 'noisy' is named twice"),
        ({"key": "k-noisy", "key_env": "NOISY_KEY"}, r"tenants\[0\]\.key: give key or key_env"),
        ({"key": None}, r"tenants\[0\]\.key: give key or key_env"),
        ({"key": "k-noisy"}, r"tenants\[1\]\.key: the same key as tenants\[0\] \(quiet\)"),
        ({"key": ""}, r"tenants\[0\]\.key: empty, or with a space"),
        ({"key": 12}, r"tenants\[0\]\.key: wrong type"),
        ({"classes": {}}, r"tenants\[0\]\.classes: at least one traffic class"),
        ({"limits": {}}, r"tenants\[0\]\.limits: unknown key"),
        (
            {"classes": {"chat": {**chat_class({}, chars=9, max_tokens=1), "route": "fast"}}},
            r"tenants\[0\]\.classes\.chat\.route: one of chat",
        ),
        (
            {
                "classes": {
                    "c": chat_class({"process": "periodic", "rate": 0}, chars=9, max_tokens=1)
                }
            },
            r"tenants\[0\]\.classes\.c\.arrival\.rate: must be positive",
        ),
    ],
)
def test_a_bad_tenant_names_the_key(
    monkeypatch: pytest.MonkeyPatch, change: dict[str, Any], named: str
) -> None:
    monkeypatch.setenv("NOISY_KEY", "k-noisy")
    data = _tenants()
    quiet = data["tenants"][0]
    for key, value in change.items():
        if value is None:
            del quiet[key]
        else:
            quiet[key] = value
    with pytest.raises(WorkloadError, match=named):
        parse_workload(data, base=Path())


def test_a_tenants_key_from_an_unset_variable_names_the_variable_not_a_secret(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("NOISY_KEY", raising=False)
    with pytest.raises(WorkloadError, match=r"tenants\[1\]\.key_env: the variable NOISY_KEY"):
        parse_workload(_tenants(), base=Path())


def test_a_periodic_arrival_has_no_burstiness() -> None:
    data = _good()
    data["classes"]["chat"]["arrival"] = {"process": "periodic", "rate": 4, "burstiness": 2}
    with pytest.raises(WorkloadError, match=r"classes\.chat\.arrival\.burstiness: .* has none"):
        parse_workload(data, base=Path())
    data["classes"]["chat"]["arrival"] = {"process": "periodic", "rate": 4}
    w = parse_workload(data, base=Path())
    assert send_times(w, w.classes[0]) == [k / 4 for k in range(1, 160)]  # 40 s, not at 40


def test_a_class_may_ask_for_a_model_of_its_own() -> None:
    data = _good()
    data["classes"]["batch"]["model"] = "tiny-2l"
    w = parse_workload(data, base=Path())
    chat, batch = w.classes
    assert body(w, chat, 0)["model"] == "tiny" and body(w, batch, 0)["model"] == "tiny-2l"
    data["classes"]["batch"]["model"] = 7
    with pytest.raises(WorkloadError, match=r"classes\.batch\.model"):
        parse_workload(data, base=Path())
