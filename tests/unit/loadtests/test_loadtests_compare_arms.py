"""The comparison's extra arms and workloads (loadtests.compare.arms): each proxy arm's
settings reach the proxy's configuration, and the small-documents workload sizes
every batch prompt to its own length."""

from __future__ import annotations

import httpx
import pytest

from loadtests.compare.arms import ALL_ARMS, WORKLOADS, proxy_config
from loadtests.compare.baseline import Workload, prepare
from loadtests.harness.corpus import Tokenizer
from proxy.config import Settings, settings_from_dict

ARM = {a.key: a for a in ALL_ARMS}


class CharTokenizer(Tokenizer):
    """One token per four characters, without an engine."""

    def __init__(self) -> None:
        super().__init__(httpx.Client(), "tiny")

    def count_prompt(self, text: str) -> int:
        return len(text) // 4

    def count_messages(self, messages: list[dict[str, str]]) -> int:
        return sum(len(m["content"]) for m in messages) // 4


def _settings(key: str) -> Settings:
    engine, top = proxy_config("http://127.0.0.1:9", ARM[key])
    return settings_from_dict({"port": 1, **top, "engines": [engine]})


@pytest.mark.parametrize(
    ("key", "piecing", "min_share"),
    [
        ("proxy", "off", 0.05),
        ("proxy_share0", "off", 0.0),
        ("proxy_details", "off", 0.05),
        ("proxy_piecing", "on", 0.05),
        ("proxy_auto", "auto", 0.05),
    ],
)
def test_each_proxy_arm_configures_the_proxy_it_names(
    key: str, piecing: str, min_share: float
) -> None:
    settings = _settings(key)
    assert settings.engines[0].piecing == piecing
    assert settings.sharing.batch_min_share == min_share


def test_the_default_flag_arms_ask_vllm_for_cached_token_counts() -> None:
    for key in ("fcfs_details", "proxy_details", "proxy_piecing"):
        assert "--enable-prompt-tokens-details" in ARM[key].flags
        assert "--long-prefill-token-threshold" not in ARM[key].flags


def test_small_docs_sizes_each_batch_prompt_to_its_own_length() -> None:
    workload = WORKLOADS["small-docs"]
    sizes = workload.batch_prompt_sizes
    assert min(sizes) >= 500 and max(sizes) <= 2000 and len(sizes) > 8
    prompts = prepare(CharTokenizer(), workload, 0)
    assert [p.tokens for p in prompts.batch] == pytest.approx(list(sizes), rel=0.005)
    assert len({p.text for p in prompts.batch}) == len(sizes)


def test_without_sizes_every_batch_prompt_has_the_one_length() -> None:
    prompts = prepare(CharTokenizer(), Workload(batch_prompts=3, batch_prompt_tokens=700), 1)
    assert [p.tokens for p in prompts.batch] == pytest.approx([700] * 3, rel=0.005)
