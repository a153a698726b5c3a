"""The audit trail export for auditors (SPEC §1, §6 ``export_audit``): one row per
``AuditEvent``, ordered by (``at``, ``id``), as CSV or JSON Lines.

Columns, in this order: ``at`` (ISO 8601, UTC, always with microseconds), ``workflow_id``,
``workflow`` (the run's workflow name), ``step``, ``actor``, ``action``, ``reason``, ``before``,
``after`` (the state before and after, as compact JSON with sorted keys) and ``event_id``.

Filters (all optional, combined with AND): ``run`` (one workflow id), ``since`` (inclusive) and
``until`` (exclusive), each an ISO 8601 date or datetime (a date means midnight UTC, a datetime
without an offset is UTC), ``workflow`` (workflow name), ``actor`` and ``action`` (exact matches).

CSV formula injection: a spreadsheet evaluates a cell that starts with ``=``, ``+``, ``-`` or
``@`` as a formula, and some strip a leading tab or carriage return first. Every CSV cell that
starts with one of those six characters gets a leading ``'``, which spreadsheets display as text
and which an auditor strips to recover the stored value. ``before`` and ``after`` are JSON objects (they start with
``{``), ``at`` starts with a digit and ``event_id`` is a number, so those columns are never
prefixed and parse back as they are. JSON Lines is not meant for spreadsheets and is never
prefixed: ``before`` and ``after`` are objects there, not strings.

Memory is constant in the number of events: ``audit_events`` reads batches of
``BATCH_SIZE`` rows by keyset pagination over (``at``, ``id``), one short query per batch, so no
result set, server-side cursor or transaction is held open while a slow client downloads. The
export is not a snapshot: an event committed during the export appears if it sorts after the
rows already read. Events are append-only and ordered, so no row is ever repeated or reordered;
for a stable, complete export of a period, give an ``until`` in the (recent) past.
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, NamedTuple

from asgiref.sync import sync_to_async
from django.db.models import Q

from . import clock
from .models import AuditEvent, WorkflowRun

BATCH_SIZE = 2000

COLUMNS = ("at", "workflow_id", "workflow", "step", "actor", "action", "reason", "before", "after", "event_id")

# Cells starting with these are formulas (or become formulas once a spreadsheet strips them).
FORMULA_TRIGGERS = ("=", "+", "-", "@", "\t", "\r")

# The query parameters (and command options) parse_filters reads; anything else is ignored.
PARAMETERS = ("format", "run", "since", "until", "workflow", "actor", "action")


@dataclass(frozen=True)
class AuditFilters:
    """Which audit events to export, and how. Datetimes are aware; ``since`` is inclusive and
    ``until`` exclusive; ``None`` means "no filter"."""

    format: str = "csv"
    run: str | None = None
    """A workflow id."""
    since: datetime | None = None
    until: datetime | None = None
    workflow: str | None = None
    """A workflow name."""
    actor: str | None = None
    action: str | None = None

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"unknown format {self.format!r} (expected one of: {', '.join(FORMATS)})")
        for name in ("since", "until"):
            value = getattr(self, name)
            if value is not None and value.tzinfo is None:
                raise ValueError(f"{name} must be an aware datetime")
        if self.since is not None and self.until is not None and self.since >= self.until:
            raise ValueError(f"since ({self.since.isoformat()}) must be earlier than until ({self.until.isoformat()})")


def parse_filters(params: Mapping[str, str]) -> AuditFilters:
    """Filters from query parameters or command options (see ``PARAMETERS``; empty values
    count as absent, other keys are ignored). Raises ``ValueError`` with a one-line message for
    a bad date, ``since >= until``, an unknown format or a run that does not exist — before
    anything is exported, so that a bad request writes nothing."""
    values = {name: (params.get(name) or "").strip() or None for name in PARAMETERS}
    filters = AuditFilters(
        format=(values["format"] or "csv").lower(),
        run=values["run"],
        since=_parse_instant("since", values["since"]),
        until=_parse_instant("until", values["until"]),
        workflow=values["workflow"],
        actor=values["actor"],
        action=values["action"],
    )
    if filters.run is not None and not WorkflowRun.objects.filter(workflow_id=filters.run).exists():
        raise ValueError(f"no run {filters.run!r}")
    return filters


def _parse_instant(name: str, value: str | None) -> datetime | None:
    if value is None:
        return None
    try:
        parsed = datetime.fromisoformat(value)  # a date alone gives midnight
    except ValueError:
        hint = " (in a URL, write '+' in an offset as %2B)" if " " in value else ""
        raise ValueError(f"{name}: {value!r} is not an ISO 8601 date or datetime{hint}") from None
    if parsed.tzinfo is None:
        return parsed.replace(tzinfo=UTC)
    try:
        return parsed.astimezone(UTC)
    except OverflowError:
        raise ValueError(f"{name}: {value!r} is out of range") from None


class AuditRow(NamedTuple):
    """One exported event as the export reads it: plain values from ``values_list`` in column
    order, not a model instance (building instances was nearly half of an export's time).
    The names are the model's (``id``, ``step_name``) and the run's (``workflow_id``,
    ``workflow_name``)."""

    at: datetime
    workflow_id: str
    workflow_name: str
    step_name: str
    actor: str
    action: str
    reason: str
    before: Any
    after: Any
    id: int


_ROW_FIELDS = (
    "at",
    "run__workflow_id",
    "run__workflow_name",
    "step_name",
    "actor",
    "action",
    "reason",
    "before",
    "after",
    "id",
)


def audit_events(filters: AuditFilters, *, batch_size: int = BATCH_SIZE) -> Iterator[AuditRow]:
    """The matching events in (``at``, ``id``) order, read ``batch_size`` at a time, as
    ``AuditRow`` tuples.

    Keyset pagination rather than one query: memory stays bounded by one batch whatever the
    number of events, it behaves the same on SQLite and PostgreSQL, and no query or
    transaction stays open between batches (a server-side cursor would need a transaction for
    the whole download). Each event comes with its run (``workflow_id``, ``workflow_name``).
    """
    query = Q()
    if filters.run is not None:
        query &= Q(run__workflow_id=filters.run)
    if filters.workflow is not None:
        query &= Q(run__workflow_name=filters.workflow)
    if filters.since is not None:
        query &= Q(at__gte=filters.since)
    if filters.until is not None:
        query &= Q(at__lt=filters.until)
    if filters.actor is not None:
        query &= Q(actor=filters.actor)
    if filters.action is not None:
        query &= Q(action=filters.action)
    events = AuditEvent.objects.filter(query).order_by("at", "id")
    page = events
    make = AuditRow._make
    while True:
        batch = list(page.values_list(*_ROW_FIELDS)[:batch_size])
        yield from map(make, batch)
        if len(batch) < batch_size:
            return
        last = make(batch[-1])
        # (at, id) > (last.at, last.id), written so that the `at` index bounds the scan.
        page = events.filter(at__gte=last.at).filter(Q(at__gt=last.at) | Q(id__gt=last.id))


def _as_row(event: AuditRow | AuditEvent) -> AuditRow:
    """An ``AuditRow`` as it is; a model instance (with its run) as one."""
    if isinstance(event, AuditRow):
        return event
    return AuditRow(
        event.at,
        event.run.workflow_id,
        event.run.workflow_name,
        event.step_name,
        event.actor,
        event.action,
        event.reason,
        event.before,
        event.after,
        event.id,
    )


def _at(value: datetime) -> str:
    return value.astimezone(UTC).isoformat(timespec="microseconds")


# Built once (json.dumps with options builds a new encoder at every call). Compact JSON, not
# ASCII-escaped; ``_compact_json`` also sorts keys at every depth (``before`` and ``after``).
_compact_json = json.JSONEncoder(separators=(",", ":"), sort_keys=True, ensure_ascii=False).encode
_json = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def _neutralise_formula(cell: str) -> str:
    return "'" + cell if cell.startswith(FORMULA_TRIGGERS) else cell


class _Echo:
    """A file-like object whose ``write`` returns what it is given: ``csv.writer.writerow``
    then returns the formatted line."""

    def write(self, value: str) -> str:
        return value


def csv_lines(events: Iterable[AuditRow | AuditEvent]) -> Iterator[str]:
    """The header, then one CSV record (RFC 4180, ``\\r\\n``-terminated) per event, with
    formula-like cells neutralised (see the module docstring)."""
    writerow = csv.writer(_Echo()).writerow
    triggers = FORMULA_TRIGGERS
    yield writerow(COLUMNS)
    for event in events:
        at, workflow_id, workflow, step, actor, action, reason, before, after, event_id = _as_row(event)
        cells = [workflow_id, workflow, step, actor, action, reason, _compact_json(before), _compact_json(after)]
        # ``at`` starts with a digit (never a trigger); the rest as _neutralise_formula, inline.
        row = [_at(at)]
        row += [
            ("'" + cell if cell.startswith(triggers) else cell) if isinstance(cell, str) else cell for cell in cells
        ]
        row.append(event_id)
        yield writerow(row)


def jsonl_lines(events: Iterable[AuditRow | AuditEvent]) -> Iterator[str]:
    """One compact JSON object per event and line, keys in column order, ``before`` and
    ``after`` as objects with sorted keys. Written piece by piece, byte for byte what
    ``json.dumps(row, separators=(",", ":"), ensure_ascii=False)`` of the row (with key-sorted
    ``before`` and ``after``) writes, without building the row."""
    for event in events:
        at, workflow_id, workflow, step, actor, action, reason, before, after, event_id = _as_row(event)
        yield "".join(
            (
                '{"at":',
                _json(_at(at)),
                ',"workflow_id":',
                _json(workflow_id),
                ',"workflow":',
                _json(workflow),
                ',"step":',
                _json(step),
                ',"actor":',
                _json(actor),
                ',"action":',
                _json(action),
                ',"reason":',
                _json(reason),
                ',"before":',
                _compact_json(before),
                ',"after":',
                _compact_json(after),
                ',"event_id":',
                _json(event_id),
                "}\n",
            )
        )


@dataclass(frozen=True)
class ExportFormat:
    lines: Callable[[Iterable[AuditRow | AuditEvent]], Iterator[str]]
    content_type: str
    extension: str


FORMATS: dict[str, ExportFormat] = {
    "csv": ExportFormat(csv_lines, "text/csv; charset=utf-8", "csv"),
    "jsonl": ExportFormat(jsonl_lines, "application/x-ndjson", "jsonl"),
}


def export_chunks(
    filters: AuditFilters, *, events: Iterable[AuditRow | AuditEvent] | None = None, chunk_chars: int = 64 * 1024
) -> Iterator[str]:
    """The whole export in the filters' format (of ``events``, by default
    ``audit_events(filters)``), as chunks of about ``chunk_chars`` characters: few enough
    writes for a socket or a file, small enough to keep memory flat."""
    buffer: list[str] = []
    size = 0
    for line in FORMATS[filters.format].lines(audit_events(filters) if events is None else events):
        buffer.append(line)
        size += len(line)
        if size >= chunk_chars:
            yield "".join(buffer)
            buffer, size = [], 0
    if buffer:
        yield "".join(buffer)


async def aexport_chunks(filters: AuditFilters, **kwargs: Any) -> AsyncIterator[str]:
    """``export_chunks`` for an ASGI server, which would otherwise read a synchronous
    iterator to its end before sending anything: each chunk is produced in Django's
    synchronous thread, one at a time, so memory stays flat there too."""
    chunks = export_chunks(filters, **kwargs)
    next_chunk = sync_to_async(next, thread_sensitive=True)
    try:
        while (chunk := await next_chunk(chunks, None)) is not None:
            yield chunk
    finally:
        await sync_to_async(chunks.close, thread_sensitive=True)()


def export_filename(filters: AuditFilters, *, now: datetime | None = None) -> str:
    """``audit-<scope>-<UTC timestamp>.<ext>``; scope is the run id reduced to
    ``[A-Za-z0-9_.-]``, or ``all``."""
    scope = re.sub(r"[^A-Za-z0-9_.-]", "_", filters.run) if filters.run else "all"
    stamp = (now or clock.now()).astimezone(UTC).strftime("%Y%m%dT%H%M%SZ")
    return f"audit-{scope}-{stamp}.{FORMATS[filters.format].extension}"
