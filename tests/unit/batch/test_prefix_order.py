"""A page of batch lines is fed in the order of their leading text."""

from __future__ import annotations

from proxy.batch.runner import prefix_key
from proxy.batch.store import PendingLine


def line(idx: int, document: str, question: str) -> PendingLine:
    messages = [{"role": "user", "content": f"{document}\n\n{question}"}]
    return PendingLine(idx, f"c{idx}", {"model": "m", "messages": messages})


def test_lines_that_share_a_document_are_fed_together_in_their_own_order() -> None:
    a, b = "A" * 3000, "B" * 3000
    page = [line(0, b, "q1"), line(1, a, "q1"), line(2, b, "q2"), line(3, a, "q2")]
    order = [x.idx for x in sorted(page, key=prefix_key)]
    assert order == [1, 3, 0, 2]  # a's lines, then b's; each document's in file order


def test_short_prompts_order_by_their_whole_text() -> None:
    page = [PendingLine(0, "x", {"prompt": "zeta"}), PendingLine(1, "y", {"prompt": "alpha"})]
    assert [x.idx for x in sorted(page, key=prefix_key)] == [1, 0]
