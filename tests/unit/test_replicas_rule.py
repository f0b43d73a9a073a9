"""The rule a shared-budget reservation is judged by (proxy.replicas.granted)."""

from __future__ import annotations

import pytest

from proxy.replicas import granted
from proxy.scheduler import ReplicaLoad, Reservation


def reservation(in_prefill: int, budget: int = 1000, *, beside: bool = False) -> Reservation:
    return Reservation("j", "a", tokens=100, in_prefill=in_prefill, budget=budget,
                       beside_interactive=beside)  # fmt: skip


@pytest.mark.parametrize(
    ("in_prefill", "others", "hold", "beside", "ok"),
    [
        (100, 0, False, False, True),  # alone
        (5000, 0, False, False, True),  # the one-request rule: the others have nothing
        (600, 400, False, False, True),  # exactly the budget
        (601, 400, False, False, False),  # one token over
        (100, 950, False, False, False),
        (100, 0, True, False, False),  # another replica's chat holds the engine
        (100, 0, True, True, True),  # ... unless the job runs on starvation credit
        (700, 400, True, True, False),  # which never lifts the budget
    ],
)
def test_granted(in_prefill: int, others: int, hold: bool, beside: bool, ok: bool) -> None:
    load = ReplicaLoad(batch_prefill_tokens=others, hold_for_interactive=hold)
    assert granted(reservation(in_prefill, beside=beside), load) is ok
