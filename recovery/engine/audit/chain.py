"""Tamper evidence for the audit trail: each run's events form a hash chain.

Every audit event carries ``hash``, a SHA-256 over its content and the ``hash`` of the event
before it in the same run (``prev_hash``, empty for a run's first event); the chain follows
the events' ids, the order in which they were written (every writer of a run's events holds
the run's row lock, so no two write at once). Change, remove or reorder one event and its
hash, or the next event's ``prev_hash``, no longer matches. ``verify_audit`` walks every
chain and reports the first broken link; the export carries both hashes, so an auditor can
verify a JSON Lines export with no access to the database (``verify_audit --file``).

Version 1 of the hashed text, as UTF-8: ``prev_hash``, a line feed, then for each of the
export's columns ``at`` (ISO 8601 UTC with microseconds, as exported), ``workflow_id``,
``workflow``, ``step``, ``actor``, ``action``, ``reason``, ``before`` and ``after`` (the
canonical JSON text stored and exported): its length in UTF-8 bytes in decimal, ``:``, the
value and a line feed. Lengths make the encoding unambiguous whatever a value contains.

The database computes the hashes as it inserts the row, whoever inserts it (the executor's
one-statement checkpoints, the ORM, a COPY): on PostgreSQL a ``BEFORE INSERT`` trigger in
PL/pgSQL, on SQLite an ``AFTER INSERT`` trigger that calls ``recovery_audit_hash``, which
``register_sqlite_functions`` installs on each of the application's connections (another
SQLite client cannot write audit events at all). Other triggers refuse every ``UPDATE``,
``DELETE`` and (PostgreSQL) ``TRUNCATE`` of events (append-only in the database, not only in
the code).

What the links do not show by themselves: a run whose events were all removed, or cut at
its start or its end. ``verify_stored`` also checks each run's trail is whole (``run_problem``:
it has events, begins with its ``start``, and its last state-recording event agrees with its
state); events cut from the end past that, or a chain rewritten from the start by someone who can
disable triggers (the database's owner), show against head anchors kept outside the database
(recovery.engine.audit.anchors). ``setup_db_roles`` keeps the application's role from owning the
tables.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.db import connection as default_connection

from recovery.fields import canonical_json
from recovery.states import AuditAction

TABLE = "recovery_auditevent"
RUN_TABLE = "recovery_workflowrun"

# The export's columns that are hashed, in order (recovery.engine.audit.export.COLUMNS).
HASHED = ("at", "workflow_id", "workflow", "step", "actor", "action", "reason", "before", "after")


def event_hash(prev_hash: str, values: Sequence[str]) -> str:
    """The hash of an event whose HASHED column values (as exported) are ``values``."""
    parts = [prev_hash, "\n"]
    for value in values:
        parts += [str(len(value.encode())), ":", value, "\n"]
    return hashlib.sha256("".join(parts).encode()).hexdigest()


def at_text(value: datetime | str) -> str:
    """``at`` as the export writes it (ISO 8601, UTC, microseconds); a naive value (SQLite's
    stored text) is UTC."""
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.astimezone(UTC).isoformat(timespec="microseconds")


# --- the database's side ---------------------------------------------------------------


def _sqlite_hash(prev_hash, at, *values) -> str:
    return event_hash(prev_hash or "", [at_text(at), *(value or "" for value in values)])


def register_sqlite_functions(sender, connection, **kwargs) -> None:
    """``connection_created`` receiver: SQLite's chain trigger calls ``recovery_audit_hash``."""
    if connection.vendor == "sqlite":
        connection.connection.create_function("recovery_audit_hash", 1 + len(HASHED), _sqlite_hash, deterministic=True)


def _pg_field(expression: str) -> str:
    return f"octet_length({expression})::text || ':' || {expression} || E'\\n'"


_PG_AT = """to_char(NEW."at" AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"')"""
_PG_VALUES = (
    _PG_AT,
    "run.workflow_id",
    "run.workflow_name",
    'NEW."step_name"',
    'NEW."actor"',
    'NEW."action"',
    'NEW."reason"',
    'NEW."before"::text',
    'NEW."after"::text',
)
_PREVIOUS = f'SELECT "hash" FROM {TABLE} WHERE "run_id" = NEW."run_id" {{}} ORDER BY "id" DESC LIMIT 1'

# A TRUNCATE is no row's UPDATE or DELETE: it needs its own statement trigger (migration 0029).
# It fires for a TRUNCATE … CASCADE of the runs' table too.
NO_TRUNCATE = f"""CREATE TRIGGER recovery_audit_no_truncate BEFORE TRUNCATE ON {TABLE}
    FOR EACH STATEMENT EXECUTE FUNCTION recovery_audit_append_only()"""

POSTGRESQL_INSTALL = [
    f"""
CREATE FUNCTION recovery_audit_chain() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    run record;
BEGIN
    SELECT "workflow_id", "workflow_name" INTO STRICT run FROM {RUN_TABLE} WHERE "id" = NEW."run_id";
    NEW."prev_hash" := coalesce(({_PREVIOUS.format("")}), '');
    NEW."hash" := encode(sha256(convert_to(
        NEW."prev_hash" || E'\\n' || {" || ".join(map(_pg_field, _PG_VALUES))}, 'UTF8')), 'hex');
    RETURN NEW;
END
$$""",
    f"""CREATE TRIGGER recovery_audit_chain BEFORE INSERT ON {TABLE}
    FOR EACH ROW EXECUTE FUNCTION recovery_audit_chain()""",
    """
CREATE FUNCTION recovery_audit_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'audit events are append-only: % refused', TG_OP USING ERRCODE = 'insufficient_privilege';
END
$$""",
    f"""CREATE TRIGGER recovery_audit_append_only BEFORE UPDATE OR DELETE ON {TABLE}
    FOR EACH STATEMENT EXECUTE FUNCTION recovery_audit_append_only()""",
    NO_TRUNCATE,
]
POSTGRESQL_UNINSTALL = [
    f"DROP TRIGGER IF EXISTS recovery_audit_no_truncate ON {TABLE}",
    f"DROP TRIGGER IF EXISTS recovery_audit_append_only ON {TABLE}",
    "DROP FUNCTION IF EXISTS recovery_audit_append_only()",
    f"DROP TRIGGER IF EXISTS recovery_audit_chain ON {TABLE}",
    "DROP FUNCTION IF EXISTS recovery_audit_chain()",
]

_SQLITE_PREVIOUS = f"coalesce(({_PREVIOUS.format('AND "id" < NEW."id"')}), '')"
_SQLITE_RUN = f'(SELECT {{}} FROM {RUN_TABLE} WHERE "id" = NEW."run_id")'
# The row is inserted with empty hashes, then given its own by this trigger: an UPDATE of a
# row that has no hash yet, the only one SQLITE_NO_UPDATE lets through.
SQLITE_CHAIN = f"""CREATE TRIGGER recovery_audit_chain AFTER INSERT ON {TABLE}
BEGIN
    UPDATE {TABLE} SET
        "prev_hash" = {_SQLITE_PREVIOUS},
        "hash" = recovery_audit_hash(
            {_SQLITE_PREVIOUS}, NEW."at",
            {_SQLITE_RUN.format('"workflow_id"')}, {_SQLITE_RUN.format('"workflow_name"')},
            NEW."step_name", NEW."actor", NEW."action", NEW."reason", NEW."before", NEW."after")
    WHERE "id" = NEW."id";
END"""
SQLITE_NO_UPDATE = f"""CREATE TRIGGER recovery_audit_no_update BEFORE UPDATE ON {TABLE} WHEN OLD."hash" <> ''
BEGIN
    SELECT RAISE(ABORT, 'audit events are append-only: UPDATE refused');
END"""
SQLITE_NO_DELETE = f"""CREATE TRIGGER recovery_audit_no_delete BEFORE DELETE ON {TABLE}
BEGIN
    SELECT RAISE(ABORT, 'audit events are append-only: DELETE refused');
END"""
SQLITE_INSTALL = [SQLITE_CHAIN, SQLITE_NO_UPDATE, SQLITE_NO_DELETE]
SQLITE_UNINSTALL = [
    "DROP TRIGGER IF EXISTS recovery_audit_no_delete",
    "DROP TRIGGER IF EXISTS recovery_audit_no_update",
    "DROP TRIGGER IF EXISTS recovery_audit_chain",
]


def install_statements(vendor: str) -> list[str]:
    return POSTGRESQL_INSTALL if vendor == "postgresql" else SQLITE_INSTALL


def uninstall_statements(vendor: str) -> list[str]:
    return POSTGRESQL_UNINSTALL if vendor == "postgresql" else SQLITE_UNINSTALL


# --- reading and verifying chains ------------------------------------------------------


@dataclass(frozen=True)
class Event:
    """One stored (or exported) event, as its chain sees it: the HASHED values as text."""

    id: int
    values: tuple[str, ...]
    prev_hash: str
    hash: str

    @property
    def workflow_id(self) -> str:
        return self.values[1]

    @property
    def action(self) -> str:
        return self.values[5]

    def describe(self) -> str:
        return f"event {self.id} of run {self.workflow_id} ({self.action} at {self.values[0]})"


@dataclass(frozen=True)
class StoredRun:
    """A run as ``verify_audit`` checks it: its state and its events in chain (id) order,
    read in one statement (one snapshot: a transition changes a run and writes its event in
    one transaction, so the two always agree here)."""

    workflow_id: str
    state: str
    events: list[Event]


def run_batches(*, run: str | None = None, runs_per_batch: int = 1000, connection=None) -> Iterator[list[int]]:
    """The ids of every run (or of the one named ``run``), in id order, a batch at a time."""
    connection = connection or default_connection
    where = "r.workflow_id = %s" if run is not None else "r.id > %s"
    last = 0
    while True:
        with connection.cursor() as cursor:
            cursor.execute(
                f"SELECT r.id FROM {connection.ops.quote_name(RUN_TABLE)} AS r WHERE {where} ORDER BY r.id LIMIT %s",
                [run if run is not None else last, runs_per_batch],
            )
            ids = [row[0] for row in cursor.fetchall()]
        if ids:
            yield ids
        if not ids or run is not None or len(ids) < runs_per_batch:
            return
        last = ids[-1]


def stored_runs(*, run: str | None = None, runs_per_batch: int = 1000, connection=None) -> Iterator[StoredRun]:
    """Every run (or one) with its events in chain order, runs without events included, a
    batch of runs at a time (memory stays flat; each batch reads its runs' events through the
    (run, id) index)."""
    connection = connection or default_connection
    quote = connection.ops.quote_name
    for ids in run_batches(run=run, runs_per_batch=runs_per_batch, connection=connection):
        with connection.cursor() as cursor:
            cursor.execute(
                f"""SELECT r.id, r.state, e.id, e.at, r.workflow_id, r.workflow_name, e.step_name, e.actor, e.action,
                    e.reason, CAST(e.before AS text), CAST(e.after AS text), e.prev_hash, e.hash
                FROM {quote(RUN_TABLE)} AS r LEFT JOIN {quote(TABLE)} AS e ON e.run_id = r.id
                WHERE r.id IN ({", ".join(["%s"] * len(ids))}) ORDER BY r.id, e.id""",
                ids,
            )
            rows = cursor.fetchall()
        runs: dict[int, StoredRun] = {}
        for run_id, state, pk, at, workflow_id, *values, prev_hash, hash_ in rows:
            stored = runs.get(run_id)
            if stored is None:
                stored = runs[run_id] = StoredRun(workflow_id, state, [])
            if pk is not None:
                stored.events.append(Event(pk, (at_text(at), workflow_id, *values), prev_hash, hash_))
        yield from runs.values()


def stored_chains(*, run: str | None = None, runs_per_batch: int = 1000, connection=None) -> Iterator[list[Event]]:
    """Each run's events in chain (id) order (runs without events left out)."""
    for stored in stored_runs(run=run, runs_per_batch=runs_per_batch, connection=connection):
        if stored.events:
            yield stored.events


def exported_chains(lines: Iterable[str]) -> Iterator[list[Event]]:
    """Each run's events in chain order, from the lines of a JSON Lines export."""
    chains: dict[str, list[Event]] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            values = tuple(_exported_value(row, column) for column in HASHED)
            event = Event(int(row["event_id"]), values, row["prev_hash"], row["hash"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"line {number} is not an event of a JSON Lines audit export ({exc})") from None
        chains.setdefault(event.workflow_id, []).append(event)
    for chain in chains.values():
        yield sorted(chain, key=lambda event: event.id)


def _exported_value(row: dict[str, Any], column: str) -> str:
    value = row[column]
    if column in ("before", "after"):
        return canonical_json(value)
    if not isinstance(value, str):
        raise TypeError(f"{column} is not a string")
    return value


@dataclass(frozen=True)
class Break:
    """The first broken link of a chain."""

    event: Event
    problem: str

    def __str__(self) -> str:
        return f"{self.event.describe()}: {self.problem}"


def first_break(chain: Sequence[Event], *, complete: bool = True) -> Break | None:
    """The first event whose link is broken, or None. ``complete``: the chain must start at
    the run's first event (a stored chain; an export filtered by time may start later, and
    then its first ``prev_hash`` is taken as given)."""
    previous: Event | None = None
    for event in chain:
        if previous is not None and event.prev_hash != previous.hash:
            return Break(
                event,
                f"its prev_hash does not match the hash of event {previous.id} before it "
                "(an event was removed, added or reordered)",
            )
        if previous is None and complete and event.prev_hash:
            return Break(event, "the run's first event has a prev_hash: the events before it are missing")
        if event_hash(event.prev_hash, event.values) != event.hash:
            return Break(event, "its content does not match its hash (it was changed after it was written)")
        previous = event
    return None


@dataclass(frozen=True)
class RunProblem:
    """A run whose trail is incomplete although its chain links hold."""

    workflow_id: str
    problem: str

    def __str__(self) -> str:
        return f"run {self.workflow_id}: {self.problem}"


def recorded_state(events: Sequence[Event]) -> tuple[Event, str] | None:
    """The last event that records the run's state (``after`` holds ``run``: every transition
    that changes a run's state writes one; an outbox delivery, which does not, records none),
    and that state."""
    for event in reversed(events):
        after = event.values[8]
        if '"run":' not in after:  # most events: no JSON to parse
            continue
        document = json.loads(after)
        if isinstance(document, dict) and isinstance(document.get("run"), str):
            return event, document["run"]
    return None


def run_problem(run: StoredRun) -> RunProblem | None:
    """What a stored run's trail lacks: any event (emptied), its start (first events cut), or
    the events that brought it to its state (last events cut)."""
    if not run.events:
        return RunProblem(run.workflow_id, f"it has no audit events (it is {run.state}): its trail was emptied")
    first = run.events[0]
    if first.action != AuditAction.START:
        return RunProblem(
            run.workflow_id, f"its first event is {first.describe()}, not its start: the events before it are missing"
        )
    recorded = recorded_state(run.events)
    if recorded is None:
        return RunProblem(run.workflow_id, "no event records its state")
    event, state = recorded
    if state != run.state:
        return RunProblem(
            run.workflow_id,
            f"it is {run.state} but its last event recording its state, {event.describe()}, says {state}: "
            "the events after it are missing",
        )
    return None


@dataclass
class Verification:
    events: int = 0
    runs: int = 0
    broken_runs: int = 0
    first: Break | RunProblem | None = None

    def failure(self) -> str | None:
        """The one line a failed verification prints, or None."""
        if self.first is None:
            return None
        what = "first broken link" if isinstance(self.first, Break) else "first problem"
        return f"audit chain broken in {self.broken_runs} of {self.runs} runs; {what}: {self.first}"

    def add(self, problem: Break | RunProblem | None) -> None:
        if problem is not None:
            self.broken_runs += 1
            self.first = self.first or problem


def verify(chains: Iterable[Sequence[Event]], *, complete: bool = True) -> Verification:
    """The chains' links (a stored trail: also ``verify_stored``)."""
    result = Verification()
    for chain in chains:
        result.runs += 1
        result.events += len(chain)
        result.add(first_break(chain, complete=complete))
    return result


def verify_stored(*, run: str | None = None, connection=None) -> Verification:
    """Every stored run (or one): its chain's links, then that its trail is whole (``run_problem``)."""
    result = Verification()
    for stored in stored_runs(run=run, connection=connection):
        result.runs += 1
        result.events += len(stored.events)
        result.add(first_break(stored.events) or run_problem(stored))
    return result
