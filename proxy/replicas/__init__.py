"""Several proxy replicas in front of the same engines, one prefill budget per engine.

Each replica publishes its own load on every engine in a shared ledger and reads the
others' (:class:`SharedBudget`, a background loop); before it sends batch work to an
engine it reserves the prompt tokens there in one short transaction
(:meth:`SharedBudget.reserve`). Interactive work never touches the ledger. While
the ledger is down, batch runs on a local share of each engine's budget
(:func:`local_share`) until it answers again. The ledger is :class:`Ledger`;
:class:`proxy.replicas.postgres.PostgresLedger` keeps it in PostgreSQL (import it
where used: it loads psycopg). The mechanism and its failure modes: docs/replicas.md.
"""

from proxy.replicas._ledger import Ledger, LedgerError, Others, Verdict, granted
from proxy.replicas._shared import LocalShare, SharedBudget, local_share

__all__ = [
    "Ledger",
    "LedgerError",
    "LocalShare",
    "Others",
    "SharedBudget",
    "Verdict",
    "granted",
    "local_share",
]
