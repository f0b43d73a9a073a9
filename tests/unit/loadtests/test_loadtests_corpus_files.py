"""The corpus files (loadtests/corpus/): every one listed with its source, licence and
hash; every prompt source a workload file can name gives real messages from them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from loadtests.harness.corpus import (
    CORPUS_DIR,
    SETS,
    as_prompt,
    manifest_problems,
    messages,
    set_files,
)


def test_every_corpus_file_is_listed_with_its_source_licence_and_hash() -> None:
    assert manifest_problems() == []


def test_a_changed_or_unlisted_file_is_reported(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    shutil.copytree(CORPUS_DIR, root)
    (root / "licences" / "mit.txt").write_text("changed\n")
    (root / "book" / "new.txt").write_text("unlisted\n")
    (root / "rfc" / "rfc3339.txt").unlink()
    assert manifest_problems(root) == [
        "book/new.txt: not in manifest.yaml",
        "rfc/rfc3339.txt: listed but missing",
        "licences/mit.txt: differs from its manifest entry (size or sha256)",
    ]


@pytest.mark.parametrize("name", [n for n in SETS if n != "python-docs"])
def test_every_named_source_has_files(name: str) -> None:
    assert set_files(name), name


def test_the_long_document_is_ten_pages_or_more() -> None:
    (path,) = set_files("long-document")
    assert path.read_text().count("[Page ") >= 10


def test_whole_documents_come_in_turn_and_passages_are_cut() -> None:
    docs = [
        messages("licences", i, 0, None)[0]["content"] for i in range(len(set_files("licences")))
    ]
    assert docs == [p.read_text() for p in set_files("licences")]
    passage = messages("rfc", 0, 123, 500)[0]["content"]
    assert len(passage) == 500


def test_questions_are_one_line() -> None:
    for i in range(20):
        (m,) = messages("questions", i, 7, None)
        assert m["role"] == "user" and "\n" not in m["content"] and m["content"].endswith("?")


def test_conversations_have_several_lengths_and_end_with_the_user() -> None:
    chats = [messages("conversations", i, 0, None) for i in range(3)]
    assert len({len(c) for c in chats}) == 3
    assert all(c[-1]["role"] == "user" for c in chats)
    assert as_prompt(chats[0]).endswith("assistant:")


def test_extraction_prompts_carry_a_json_schema_and_their_document() -> None:
    (m,) = messages("extraction", 0, 0, None)
    schema_line = m["content"].split("\n")[2]
    assert json.loads(schema_line)["type"] == "object"
    assert "Permission is hereby granted" in m["content"]  # licences/mit.txt, whole
    (cut,) = messages("extraction", 0, 0, 40)
    assert len(cut["content"]) < len(m["content"])
