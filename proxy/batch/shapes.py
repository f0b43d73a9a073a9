"""The Files and Batch API's JSON objects, as OpenAI writes them."""

from __future__ import annotations

from collections.abc import Sequence

from proxy.batch.estimate import Estimate
from proxy.batch.store import BatchRecord, FileRecord, Json, LineError

TIMES = (
    "in_progress_at", "finalizing_at", "completed_at", "failed_at",
    "expired_at", "cancelling_at", "cancelled_at",
)  # fmt: skip


def file_object(record: FileRecord) -> Json:
    return {
        "id": record.id,
        "object": "file",
        "bytes": record.bytes,
        "created_at": record.created_at,
        "filename": record.filename,
        "purpose": record.purpose,
        "status": "processed",
        "status_details": None,
    }


def batch_object(record: BatchRecord, estimate: Estimate | None = None) -> Json:
    """OpenAI's batch object; ``request_counts`` also carries ``valid`` and
    ``invalid`` (the completed lines' answers judged, :mod:`proxy.batch.quality`),
    beside OpenAI's three counts, and ``whoseturn`` the estimate of an active job
    (else None)."""
    body: Json = {
        "id": record.id,
        "object": "batch",
        "endpoint": record.endpoint,
        "errors": {"object": "list", "data": record.errors} if record.errors else None,
        "input_file_id": record.input_file_id,
        "completion_window": record.completion_window,
        "status": record.status,
        "output_file_id": record.output_file_id,
        "error_file_id": record.error_file_id,
        "created_at": record.created_at,
        "expires_at": record.expires_at,
        "request_counts": {
            "total": record.total,
            "completed": record.completed,
            "failed": record.failed,
            "valid": record.valid,
            "invalid": record.invalid,
        },
        "metadata": dict(record.metadata) if record.metadata else None,
    }
    body.update({name: record.times.get(name) for name in TIMES})
    body["whoseturn"] = estimate.body() if estimate is not None else None
    return body


def line_errors(error: LineError) -> list[Json]:
    """OpenAI's ``errors.data`` for a job whose input file failed validation."""
    code = "invalid_line" if error.line else "invalid_file"
    return [
        {"code": code, "message": str(error), "param": "input_file_id", "line": error.line or None}
    ]


def page(data: Sequence[Json], limit: int) -> Json:
    """A list page; ``data`` holds up to ``limit + 1`` items (the extra says more)."""
    shown = list(data[:limit])
    return {
        "object": "list",
        "data": shown,
        "first_id": shown[0]["id"] if shown else None,
        "last_id": shown[-1]["id"] if shown else None,
        "has_more": len(data) > limit,
    }
