"""SimTokenizer: deterministic ids, chat template, generated tokens that re-tokenize."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadtests.sim.tokenizer import NUM_SPECIAL, SimTokenizer, message_text, prompt_seed

TOK = SimTokenizer()


def test_encode_splits_words_and_punctuation_and_ignores_whitespace() -> None:
    ids = TOK.encode("Hello,  world!\n")
    assert len(ids) == 4
    assert ids == TOK.encode("Hello , world !")
    assert TOK.encode("") == []
    assert TOK.encode("   \n\t") == []


def test_equal_pieces_get_equal_ids_and_different_ones_differ() -> None:
    a, b, c = TOK.encode("cat dog cat")
    assert a == c
    assert a != b


def test_encode_is_deterministic_across_instances() -> None:
    text = "The quick brown fox, 42 times."
    assert SimTokenizer().encode(text) == SimTokenizer().encode(text) == TOK.encode(text)


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=200))
def test_ids_stay_in_the_vocabulary_and_concatenation_adds_counts(text: str) -> None:
    ids = TOK.encode(text)
    assert all(NUM_SPECIAL <= i < TOK.vocab_size for i in ids)
    # Joining two texts with a space never merges or splits their pieces.
    assert len(TOK.encode(text + " " + text)) == 2 * len(ids)


def test_small_vocabulary_is_refused() -> None:
    with pytest.raises(ValueError):
        SimTokenizer(vocab_size=NUM_SPECIAL + 10)


def test_chat_template_renders_every_message_and_ends_with_the_assistant_turn() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
    ]
    text = TOK.apply_chat_template(messages)
    assert text.endswith("<|assistant|>\n")
    assert text.index("Be brief.") < text.index("Hi there")
    assert "<|system|>" in text and "<|user|>" in text
    assert TOK.apply_chat_template([]) == "<|assistant|>\n"


def test_chat_template_is_deterministic_and_counts_its_markup() -> None:
    messages = [{"role": "user", "content": "one two three"}]
    prompt = TOK.encode(TOK.apply_chat_template(messages))
    assert prompt == TOK.encode(TOK.apply_chat_template(messages))
    assert len(prompt) > 3


def test_message_text_accepts_strings_parts_and_none() -> None:
    assert message_text({"content": "plain"}) == "plain"
    assert message_text({"content": [{"type": "text", "text": "a"}, {"text": "b"}]}) == "a\nb"
    assert message_text({"content": None}) == ""
    assert message_text({}) == ""
    with pytest.raises(TypeError):
        message_text({"content": 42})


def test_sampling_depends_only_on_seed_and_position() -> None:
    first = [TOK.sample(7, i) for i in range(50)]
    assert first == [SimTokenizer().sample(7, i) for i in range(50)]
    assert first != [TOK.sample(8, i) for i in range(50)]
    assert len(set(first)) > 1


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 40))
def test_generated_text_re_tokenizes_to_the_generated_token_count(seed: int, n: int) -> None:
    tokens = [TOK.sample(seed, i) for i in range(n)]
    text = "".join(TOK.decode_token(t) for t in tokens)
    assert text.startswith(" ")
    assert TOK.encode(text) == tokens


def test_decode_of_an_unknown_id_is_marked() -> None:
    assert TOK.decode_token(5) == " <5>"


def test_prompt_seed_depends_on_the_prompt_and_the_request_seed() -> None:
    prompt = TOK.encode("tell me a story")
    assert prompt_seed(prompt) == prompt_seed(list(prompt))
    assert prompt_seed(prompt) == prompt_seed(prompt, 0)
    assert prompt_seed(prompt, 1) != prompt_seed(prompt)
    assert prompt_seed(prompt) != prompt_seed(TOK.encode("tell me a joke"))
