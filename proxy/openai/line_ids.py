"""The scheduler's id for a try of a Batch API line, ``<batch id>/<custom_id>/<try>``:
the batch runner makes it (:func:`job_id`) and ``/turn/log`` reads it back
(:func:`job_line`) to name the job and line a decision's work belongs to."""

from __future__ import annotations


def job_id(batch_id: str, custom_id: str, attempt: int) -> str:
    """The scheduler's id for a try of a job's line: ``<batch id>/<custom_id>/<try>``."""
    return f"{batch_id}/{custom_id}/{attempt}"


def job_line(job: str) -> tuple[str, str, int] | None:
    """(batch id, custom_id, try) of an id made by :func:`job_id`, else None."""
    batch_id, _, rest = job.partition("/")
    custom_id, _, attempt = rest.rpartition("/")
    if not batch_id.startswith("batch_") or not custom_id or not attempt.isdigit():
        return None
    return batch_id, custom_id, int(attempt)
