"""Cards in the settings: several engines' models sharing one card's memory, each
saying how it is woken; what cannot work is refused at load, naming the key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from proxy.config import Activation, CardConfig, ConfigError, load_settings, settings_from_dict


def engine(name: str, footprint: float = 40, **extra: Any) -> dict[str, Any]:
    return {
        "url": f"http://127.0.0.1:{8000 + len(name)}",
        "name": name,
        "models": [name],
        "card": "gpu0",
        "footprint_gib": footprint,
        "activation": {"sleep_level": 1},
        **extra,
    }


def settings(*engines: dict[str, Any], **top: Any) -> Any:
    cards = top.pop("cards", [{"name": "gpu0", "memory_gib": 80}])
    return settings_from_dict({"cards": cards, "engines": list(engines), **top})


def test_a_card_and_its_engines_read_in_full() -> None:
    s = settings(
        engine("chat"),
        engine("batchy", 60, activation={"start": "vllm serve x", "stop": "pkill x", "wake_s": 90}),
        cards=[{"name": "gpu0", "memory_gib": 80, "min_awake_s": 120, "chat_quiet_s": 10}],
    )
    assert s.cards == (CardConfig(name="gpu0", memory_gib=80, min_awake_s=120, chat_quiet_s=10),)
    assert s.engines[0].activation == Activation(sleep_level=1)
    assert s.engines[1].activation == Activation(start="vllm serve x", stop="pkill x", wake_s=90)
    assert s.engines[1].activation.by_command and s.engines[1].footprint_gib == 60


def test_a_model_that_fits_on_no_card_is_an_error_at_load() -> None:
    with pytest.raises(ConfigError, match=r"engines\[1\]\.footprint_gib: 90 GiB fits on no card"):
        settings(engine("chat"), engine("big", 90))


@pytest.mark.parametrize(
    ("change", "key", "why"),
    [
        ({"card": "gpu9"}, "engines[0].card", "no card named 'gpu9'"),
        ({"models": []}, "engines[0].models", "names its one model"),
        ({"activation": None}, "engines[0].activation", "says how it is woken"),
        ({"footprint_gib": 0}, "engines[0].footprint_gib", "states the memory"),
        ({"activation": {"sleep_level": 3}}, "engines[0].activation", "sleep_level"),
        ({"activation": {"stop": "x"}}, "engines[0].activation", "sleep_level"),
        ({"activation": {"sleep_level": 1, "wake": 3}}, "engines[0].activation", "wake_s"),
        ({"url": "dns+http://vllm:8000"}, "engines[0].url", "not a DNS group"),
    ],
)
def test_an_engine_on_a_card_that_cannot_work_names_its_key(
    change: dict[str, Any], key: str, why: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        settings({**engine("chat"), **change}, engine("other"))
    found = [(e.where, e.why) for e in raised.value.errors]
    assert any(where.startswith(key) and why in text for where, text in found), found


def test_activation_without_a_card_and_a_card_without_engines_are_errors() -> None:
    bare = {"url": "http://127.0.0.1:8000", "activation": {"sleep_level": 1}}
    with pytest.raises(ConfigError, match="only goes with card"):
        settings_from_dict({"engines": [bare]})
    with pytest.raises(ConfigError, match="card spare holds no engine"):
        settings(engine("chat"), cards=[{"name": "gpu0", "memory_gib": 80},
                                        {"name": "spare", "memory_gib": 8}])  # fmt: skip


@pytest.mark.parametrize("top", [{"workers": 2}, {"ledger_dsn": "postgresql://x/y"}])
def test_a_card_is_kept_by_one_proxy_process(top: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="kept by one proxy process"):
        settings(engine("chat"), **top)


def test_a_card_needs_its_memory_and_known_keys() -> None:
    with pytest.raises(ConfigError) as raised:
        settings(engine("chat"), cards=[{"name": "gpu0"}, {"name": "x", "memory": 3}])
    text = str(raised.value)
    assert "cards[0].memory_gib" in text and "did you mean 'memory_gib'" in text


def test_the_shipped_card_config_for_real_vllm_loads() -> None:
    path = Path(__file__).parents[2] / "loadtests" / "workloads" / "proxies" / "cards-cpu.yaml"
    s = load_settings(str(path), env={})
    assert [c.name for c in s.cards] == ["cpu"]
    assert [(e.card, e.activation is not None and e.activation.by_command) for e in s.engines] == [
        ("cpu", True),
        ("cpu", True),
    ]
    assert sum(e.footprint_gib for e in s.engines) > s.cards[0].memory_gib  # they take turns
