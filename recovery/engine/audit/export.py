"""The audit trail export for auditors (``export_audit``): one row per
``AuditEvent``, ordered by (``at``, ``id``), as CSV or JSON Lines.

Columns, in this order: ``at`` (ISO 8601, UTC, always with microseconds), ``workflow_id``,
``workflow`` (the run's workflow name), ``step``, ``actor``, ``action``, ``reason``, ``before``,
``after`` (the state before and after, as compact JSON with sorted keys), ``event_id``, and
``prev_hash`` and ``hash``, the event's link in its run's hash chain (recovery.engine.audit.chain:
an auditor verifies a JSON Lines export offline with ``verify_audit --file``). After the
events, a trailer says what the export holds, per run and in total (recovery.engine.audit.trailer),
whichever writer wrote the lines; it keeps one entry per exported run in memory.

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
result set, server-side cursor or transaction is held open while a slow client downloads. On
PostgreSQL the database writes the lines (see below) in batches of ``COPY_BATCH_SIZE`` events,
one ``COPY`` statement each, streamed as it comes: a statement stays open while its batch goes
out (a few seconds of the database's time; longer for a slow client), nothing between batches.
The export is not a snapshot: an event committed during the export appears if it sorts after the
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
from django.db import connection
from django.db.models import BooleanField, DateTimeField, F, Func, Q, QuerySet, TextField, Value

from recovery import clock
from recovery.actions import audited
from recovery.engine.audit.trailer import Tally, trailer_lines
from recovery.fields import canonical_json
from recovery.models import AuditEvent, WorkflowRun

BATCH_SIZE = 2000

COLUMNS = (
    "at",
    "workflow_id",
    "workflow",
    "step",
    "actor",
    "action",
    "reason",
    "before",
    "after",
    "event_id",
    "prev_hash",
    "hash",
)

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
    if filters.action is not None and not audited(filters.action):
        raise ValueError(
            f"no audit action {filters.action!r} (recovery.states.AuditAction, or an operator action's name)"
        )
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
    prev_hash: str = ""
    hash: str = ""


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
    "prev_hash",
    "hash",
)


def audit_events(filters: AuditFilters, *, batch_size: int = BATCH_SIZE) -> Iterator[AuditRow]:
    """The matching events in (``at``, ``id``) order, read ``batch_size`` at a time, as
    ``AuditRow`` tuples.

    Keyset pagination rather than one query: memory stays bounded by one batch whatever the
    number of events, it behaves the same on SQLite and PostgreSQL, and no query or
    transaction stays open between batches (a server-side cursor would need a transaction for
    the whole download). Each event comes with its run (``workflow_id``, ``workflow_name``).
    """
    events = _matching(filters)
    page = events
    make = AuditRow._make
    while True:
        batch = list(page.values_list(*_ROW_FIELDS)[:batch_size])
        yield from map(make, batch)
        if len(batch) < batch_size:
            return
        last = make(batch[-1])
        page = events.filter(_after(last.at, last.id))


def _matching(filters: AuditFilters) -> QuerySet[AuditEvent]:
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
    return AuditEvent.objects.filter(query).order_by("at", "id")


class _Key(Func):
    """``(at, id) <op> (key_at, key_id)``: an event against a key in the export's order. A row
    comparison, which the (at, id) index bounds on both sides and PostgreSQL estimates well;
    the same condition spelt with OR misleads its planner into joining every run."""

    conditional = True
    output_field = BooleanField()

    def __init__(self, op: str, at: datetime, pk: int):
        super().__init__(F("at"), F("id"), Value(at, output_field=DateTimeField()), Value(pk))
        self.op = op

    def as_sql(self, compiler, connection, **extra_context):
        sql, params = _compiled(compiler, self)
        return f"({sql[0]}, {sql[1]}) {self.op} ({sql[2]}, {sql[3]})", params


def _compiled(compiler, expression: Func) -> tuple[list[str], list[Any]]:
    """The SQL of each of ``expression``'s sources, and all their parameters in order."""
    sql, params = [], []
    for source in expression.get_source_expressions():
        part, part_params = compiler.compile(source)
        sql.append(part)
        params.extend(part_params)
    return sql, params


def _after(at: datetime, pk: int) -> _Key:
    return _Key(">", at, pk)


def _up_to(at: datetime, pk: int) -> _Key:
    return _Key("<=", at, pk)


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
        event.prev_hash,
        event.hash,
    )


def _at(value: datetime) -> str:
    return value.astimezone(UTC).isoformat(timespec="microseconds")


# Built once (json.dumps with options builds a new encoder at every call). Compact JSON, not
# ASCII-escaped; ``before`` and ``after`` are written canonical (keys sorted at every depth), as stored.
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
        at, workflow_id, workflow, step, actor, action, reason, before, after, event_id, prev, digest = _as_row(event)
        cells = [workflow_id, workflow, step, actor, action, reason, canonical_json(before), canonical_json(after)]
        # ``at`` starts with a digit (never a trigger); the rest as _neutralise_formula, inline.
        row = [_at(at)]
        row += [
            ("'" + cell if cell.startswith(triggers) else cell) if isinstance(cell, str) else cell for cell in cells
        ]
        row += [event_id, prev, digest]  # a number and hex digests: never formulas
        yield writerow(row)


def jsonl_lines(events: Iterable[AuditRow | AuditEvent]) -> Iterator[str]:
    """One compact JSON object per event and line, keys in column order, ``before`` and
    ``after`` as objects with sorted keys. Written piece by piece, byte for byte what
    ``json.dumps(row, separators=(",", ":"), ensure_ascii=False)`` of the row (with key-sorted
    ``before`` and ``after``) writes, without building the row."""
    for event in events:
        at, workflow_id, workflow, step, actor, action, reason, before, after, event_id, prev, digest = _as_row(event)
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
                canonical_json(before),
                ',"after":',
                canonical_json(after),
                ',"event_id":',
                _json(event_id),
                ',"prev_hash":"',
                prev,
                '","hash":"',
                digest,
                '"}\n',  # hex digests: nothing to escape
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


@dataclass
class ExportCount:
    """How many events an export wrote (filled in as it streams)."""

    events: int = 0


def export_chunks(
    filters: AuditFilters,
    *,
    events: Iterable[AuditRow | AuditEvent] | None = None,
    chunk_chars: int = 64 * 1024,
    count: ExportCount | None = None,
) -> Iterator[str]:
    """The whole export in the filters' format (of ``events``, by default
    ``audit_events(filters)``), as chunks of about ``chunk_chars`` characters: few enough
    writes for a socket or a file, small enough to keep memory flat. On PostgreSQL, without
    ``events``, the database writes the lines (``_copied_chunks``): the same bytes, several
    times faster. ``count`` learns how many events were written."""
    count = count if count is not None else ExportCount()
    tally = Tally()
    if events is None and connection.vendor == "postgresql":
        yield from _copied_chunks(filters, chunk_chars, count, tally)
        yield "".join(trailer_lines(filters.format == "csv", tally, trailer_filters(filters)))
        return
    buffer: list[str] = []
    size = 0
    rows = _counted(audit_events(filters) if events is None else events, count, tally, filters.format == "csv")
    for line in FORMATS[filters.format].lines(rows):
        buffer.append(line)
        size += len(line)
        if size >= chunk_chars:
            yield "".join(buffer)
            buffer, size = [], 0
    yield "".join([*buffer, *trailer_lines(filters.format == "csv", tally, trailer_filters(filters))])


def _counted(
    events: Iterable[AuditRow | AuditEvent], count: ExportCount, tally: Tally, csv_format: bool
) -> Iterator[AuditRow]:
    add = tally.add
    for event in events:
        count.events += 1
        row = _as_row(event)
        add(_neutralise_formula(row.workflow_id) if csv_format else row.workflow_id, row.hash)
        yield row


def trailer_filters(filters: AuditFilters) -> dict[str, str]:
    """The filters an export was made with, as its trailer states them (recovery.engine.audit.trailer)."""
    given = {name: getattr(filters, name) for name in ("run", "since", "until", "workflow", "actor", "action")}
    return {
        name: _at(value) if isinstance(value, datetime) else value for name, value in given.items() if value is not None
    }


# --- PostgreSQL: the database writes the lines -----------------------------------------
#
# Each batch of COPY_BATCH_SIZE events is one ``COPY (SELECT …) TO STDOUT`` whose rows are the
# export's lines, byte for byte what csv_lines and jsonl_lines write (the tests compare them on
# awkward values): ``before`` and ``after`` are stored as canonical JSON text in ``json``
# columns (recovery.fields), which PostgreSQL hands out as stored. An index-only query finds
# where each batch ends, so that, as in ``audit_events``, nothing stays open between batches.
# A batch is large because each one joins the events with the runs (a hash of every run, built
# again per batch) and sorts: at 100,000 events a batch that cost three times the export's
# own work on a million runs, at 1,000,000 it is a tenth.
#
# CSV: COPY's CSV writer quotes a cell exactly when Python's csv module does (a comma, a double
# quote, CR or LF; quotes doubled). Two differences are bridged: COPY writes a non-NULL empty
# string as "" where Python writes nothing (so empty cells are sent as NULL, which COPY writes as
# nothing), and COPY ends a row with LF where the export ends it with CRLF (each COPY message
# is one row: its final LF becomes CRLF; a LF inside a quoted cell stays, as Python writes it).
#
# JSON Lines: one text column, the line, which COPY ends with LF. It is written by COPY's CSV
# writer with a quote and a delimiter that a JSON line cannot contain raw (JSON text escapes
# every control character), so that it is never quoted; COPY's text format would escape
# backslashes.

COPY_BATCH_SIZE = 1_000_000
_CSV_COPY = "COPY ({}) TO STDOUT (FORMAT csv)"
_VERBATIM_COPY = r"COPY ({}) TO STDOUT (FORMAT csv, QUOTE E'\x01', DELIMITER E'\x02')"
_AT_SQL = """to_char({0} AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"')"""  # as _at()
# A cell starting with a formula trigger, by the code of its first character (0 when empty):
# integer comparisons cost PostgreSQL a fraction of comparing left(cell, 1) with strings.
_TRIGGERS_SQL = ", ".join(str(ord(c)) for c in FORMULA_TRIGGERS)
_CSV_CELL_SQL = "CASE WHEN ascii({0}) IN (" + _TRIGGERS_SQL + ") THEN '''' || {0} ELSE NULLIF({0}, '') END"


class _Sql(Func):
    """Text from an SQL ``template`` in which ``{0}``, ``{1}``… stand for the compiled
    expressions (columns: they carry no parameters, so each may appear more than once)."""

    def __init__(self, template: str, *expressions: Any):
        super().__init__(*expressions, output_field=TextField())
        self.sql_template = template

    def as_sql(self, compiler, connection, **extra_context):
        sql, params = _compiled(compiler, self)
        assert not params, "an _Sql expression takes columns only"
        return self.sql_template.format(*sql), []


def _csv_cells() -> dict[str, Any]:
    """The CSV columns, in COLUMNS order: formula-like cells prefixed as csv_lines does, empty
    cells as NULL."""
    cells: dict[str, Any] = {"csv_at": _Sql(_AT_SQL, F("at"))}
    for column, field in zip(COLUMNS[1:7], _ROW_FIELDS[1:7], strict=True):
        cells[f"csv_{column}"] = _Sql(_CSV_CELL_SQL, F(field))
    for column in ("before", "after"):
        cells[f"csv_{column}"] = _Sql(_CSV_CELL_SQL.replace("{0}", "CAST({0} AS text)"), F(column))
    cells["csv_event_id"] = F("id")
    for column in ("prev_hash", "hash"):
        cells[f"csv_{column}"] = _Sql("NULLIF({0}, '')", F(column))  # hex: never a formula
    return cells


def _literal(text: str) -> str:
    """An SQL string literal of ``text``, escaped for an _Sql template."""
    return "'" + text.replace("'", "''").replace("{", "{{").replace("}", "}}") + "'"


def _jsonl_line() -> _Sql:
    """A line as jsonl_lines writes it, but its LF; ``{i}`` is _ROW_FIELDS[i]."""
    values = {
        "at": f"""'"' || {_AT_SQL} || '"'""",
        "before": "CAST({0} AS text)",
        "after": "CAST({0} AS text)",
        "event_id": "CAST({0} AS text)",
    }
    pieces = []
    for index, column in enumerate(COLUMNS):
        pieces.append(_literal(("{" if index == 0 else ",") + _json(column) + ":"))
        pieces.append(values.get(column, "to_json({0})::text").replace("{0}", f"{{{index}}}"))
    pieces.append(_literal("}"))  # and COPY ends the row with LF
    return _Sql(" || ".join(pieces), *map(F, _ROW_FIELDS))


def _copied_chunks(filters: AuditFilters, chunk_chars: int, count: ExportCount, tally: Tally) -> Iterator[str]:
    events = _matching(filters)
    csv_format = filters.format == "csv"
    if csv_format:
        cells, statement = _csv_cells(), _CSV_COPY
        yield csv.writer(_Echo()).writerow(COLUMNS)
    else:
        cells, statement = {"line": _jsonl_line()}, _VERBATIM_COPY
    page = events
    while True:
        end = page.values_list("at", "id")[COPY_BATCH_SIZE - 1 : COPY_BATCH_SIZE].first()
        batch = page if end is None else page.filter(_up_to(*end))
        sql = connection.ops.compose_sql(*batch.annotate(**cells).values_list(*cells).query.sql_with_params())
        # Streamed as COPY sends the rows: PostgreSQL writes the next ones while these go out.
        with connection.cursor() as cursor, cursor.copy(statement.format(sql)) as copy:  # COPY takes no parameters
            rows: list[Any] = []
            size = 0
            for row in copy:
                rows.append(row)
                size += len(row)
                if size >= chunk_chars:
                    yield _copied_text(rows, csv_format, count, tally)
                    rows, size = [], 0
            if rows:
                yield _copied_text(rows, csv_format, count, tally)
        if end is None:
            return
        page = events.filter(_after(*end))


def _copied_text(rows: list[Any], csv_format: bool, count: ExportCount, tally: Tally) -> str:
    """COPY's rows (one message each, LF-terminated) as the export's text."""
    count.events += len(rows)
    data = b"".join(rows)
    tally.add_copied(data, rows, csv_format)
    if csv_format and data.count(b"\n") != len(rows):
        data = b"".join(bytes(row[:-1]) + b"\r\n" for row in rows)  # a cell holds a LF
    elif csv_format:
        data = data.replace(b"\n", b"\r\n")  # every LF ends a row
    return data.decode()


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
