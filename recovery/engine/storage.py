"""Single-row writes for the executor's hot path, one level below the ORM.

An executor checkpoints twice per step. Through ``Model.save()`` or ``QuerySet.update()`` each
of those writes costs a few hundred microseconds of Python (query compilation, signals) —
more than the database round trip. These functions build the same statement once per model
and column set, and adapt every value with its field's own ``get_db_prep_save`` (a start's
steps go as one JSON document of the same values, ``_step_rows``), so a row ends up exactly as
the ORM would have written it, on SQLite as on PostgreSQL. Only ``recovery.engine.transitions``
calls them, on the default database.

On PostgreSQL they run as prepared statements (unless ``RECOVERY_PREPARED_STATEMENTS=0``):
the executor runs the same few statements thousands of times, and planning a claim or a
checkpoint costs PostgreSQL about as much as running it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from typing import Any

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, connections, models

from recovery.models import AuditEvent, StepExecution, WorkflowPause, WorkflowRun
from recovery.states import AuditAction

Fields = tuple[models.Field, ...]
# Fields written by a statement, in its parameters' order, each with whether it is JSON.
Columns = tuple[tuple[models.Field, bool], ...]


@dataclass(frozen=True)
class Unpaused:
    """A fence item (``fence["unpaused"]``): no pause of ``workflow``, nor of one of ``steps``,
    is in force (WorkflowPause) as the statement runs — but the one the run was released from as
    a canary. The write of a new attempt carries it, so a supervisor's pause stops every attempt
    not begun before it was committed, with no read of its own on the executor's path."""

    workflow: str
    steps: tuple[str, ...]


def update(model: type[models.Model], pk: int, values: dict[str, Any], **fence: Any) -> int:
    """``UPDATE … SET values WHERE id = pk`` and, for each ``fence`` item, ``column = value``
    (a frozenset value: ``column IN (…)``). Returns the number of rows changed."""
    connection = connections[DEFAULT_DB_ALIAS]
    names = tuple(sorted(values))
    shape, fence_params = _fence(fence)
    sql, fields = _update_sql(connection.vendor, model, names, shape)
    params = [*_params(connection, names, fields, values), pk, *fence_params]
    with _cursor(connection) as cursor:
        cursor.execute(sql, params)
        return cursor.rowcount


def insert(model: type[models.Model], values: dict[str, Any]) -> None:
    """``INSERT INTO … (values)``: one row, its id not read back."""
    connection = connections[DEFAULT_DB_ALIAS]
    names = tuple(sorted(values))
    sql, fields = _insert_sql(connection.vendor, model, names)
    with _cursor(connection) as cursor:
        cursor.execute(sql, _params(connection, names, fields, values))


@contextmanager
def _cursor(connection) -> Iterator[Any]:
    """Django's cursor (its execute wrappers, its query log and its error translation), on
    PostgreSQL over a psycopg cursor that binds parameters on the server and prepares each
    statement the first time this connection runs it. Django itself prepares nothing (its
    cursors bind on the client): ``prepare_threshold`` in the settings only lets psycopg
    prepare what is asked for."""
    if connection.vendor != "postgresql" or not settings.RECOVERY_PREPARED_STATEMENTS:
        with connection.cursor() as cursor:
            yield cursor
        return
    connection.close_if_health_check_failed()
    connection.ensure_connection()
    with connection.wrap_database_errors:
        cursor = connection._prepare_cursor(_preparing_cursor_class()(connection.connection))
    with cursor:
        yield cursor


@cache
def _preparing_cursor_class() -> type:
    from django.db.backends.postgresql.base import ServerBindingCursor  # imports psycopg: PostgreSQL only

    class PreparingCursor(ServerBindingCursor):
        def execute(self, query, params=None, *, prepare=None, binary=None):
            return super().execute(query, params, prepare=True, binary=binary)

    return PreparingCursor


def _fence(fence: dict[str, Any]) -> tuple[tuple[tuple[str, int], ...], list[Any]]:
    """The fence's shape (column, members of its ``IN`` or 0 for ``=``; for ``Unpaused``, its
    steps), by column, and its parameters in that order."""
    shape = tuple(sorted((name, _members(value)) for name, value in fence.items()))
    params: list[Any] = []
    for name, members in shape:
        value = fence[name]
        if isinstance(value, Unpaused):
            params.extend([value.workflow, *value.steps])
        else:
            params.extend(sorted(value) if members else [value])
    return shape, params


def _members(value: Any) -> int:
    if isinstance(value, Unpaused):
        return len(value.steps)
    return len(value) if isinstance(value, frozenset) else 0


_PLAIN = (str, int, bool, type(None))


def _params(connection, names: tuple[str, ...], columns: Columns, values: dict[str, Any]) -> list[Any]:
    params = []
    # On PostgreSQL the ORM passes an aware datetime through as it is (adapt_datetimefield_value).
    aware_as_is = connection.vendor == "postgresql"
    for name, (field, is_json) in zip(names, columns, strict=True):
        value = values[name]
        # A string, a number or None goes to any column but JSON as it is; the rest (dates,
        # JSON documents) is adapted by the field, as the ORM would.
        plain = type(value) in _PLAIN or (aware_as_is and type(value) is datetime and value.tzinfo is not None)
        params.append(value if plain and not is_json else field.get_db_prep_save(value, connection))
    return params


def _columns(model: type[models.Model], names: tuple[str, ...]) -> Columns:
    fields = (model._meta.get_field(name) for name in names)
    return tuple((field, isinstance(field, models.JSONField)) for field in fields)


@cache
def _update_sql(
    vendor: str, model: type[models.Model], names: tuple[str, ...], fence: tuple[tuple[str, int], ...]
) -> tuple[str, Columns]:
    quote = connections[DEFAULT_DB_ALIAS].ops.quote_name
    meta = model._meta
    columns = _columns(model, names)
    sets = ", ".join(f"{quote(field.column)} = %s" for field, _ in columns)
    where = [f"{quote(meta.pk.column)} = %s"]
    for name, members in fence:
        if name == "unpaused":
            where.append(_unpaused_sql(members))
            continue
        column = quote(meta.get_field(name).column)
        where.append(f"{column} IN ({', '.join(['%s'] * members)})" if members else f"{column} = %s")
    return f"UPDATE {quote(meta.db_table)} SET {sets} WHERE {' AND '.join(where)}", columns


def _unpaused_sql(steps: int) -> str:
    quote = connections[DEFAULT_DB_ALIAS].ops.quote_name
    table = quote(WorkflowPause._meta.db_table)
    names = ", ".join(["''", *["%s"] * steps])
    # A run released from a pause in force (a canary: its workflow_pause names it) passes it.
    run = f"{quote(WorkflowRun._meta.db_table)}.{quote('workflow_pause_id')}"
    return (
        f"NOT EXISTS (SELECT 1 FROM {table} AS p WHERE p.{quote('workflow_name')} = %s"
        f" AND p.{quote('step_name')} IN ({names}) AND p.{quote('released_at')} IS NULL"
        f" AND ({run} IS NULL OR p.{quote('id')} <> {run}))"
    )


@cache
def _insert_sql(vendor: str, model: type[models.Model], names: tuple[str, ...]) -> tuple[str, Columns]:
    quote = connections[DEFAULT_DB_ALIAS].ops.quote_name
    columns = _columns(model, names)
    names_sql = ", ".join(quote(field.column) for field, _ in columns)
    placeholders = ", ".join(["%s"] * len(columns))
    return f"INSERT INTO {quote(model._meta.db_table)} ({names_sql}) VALUES ({placeholders})", columns


def checkpoint(
    run_pk: int,
    run_values: dict[str, Any],
    fence: dict[str, Any],
    step_pk: int,
    step_values: dict[str, Any],
    audit_values: dict[str, Any],
) -> bool:
    """PostgreSQL only: a whole step transition as one statement (one round trip, its own
    transaction in autocommit) — the fenced UPDATE of the run, the UPDATE of the step and the
    INSERT of the audit event, each only if the one before matched. False if the fence did not
    match; then nothing was written."""
    connection = connections[DEFAULT_DB_ALIAS]
    run_names, step_names, audit_names = (tuple(sorted(values)) for values in (run_values, step_values, audit_values))
    shape, fence_params = _fence(fence)
    sql, run_fields, step_fields, audit_fields = _checkpoint_sql(run_names, shape, step_names, audit_names)
    params = [*_params(connection, run_names, run_fields, run_values), run_pk, *fence_params]
    params.extend(_params(connection, step_names, step_fields, step_values))
    params.append(step_pk)
    params.extend(_params(connection, audit_names, audit_fields, audit_values))
    with _cursor(connection) as cursor:
        cursor.execute(sql, params)
        return cursor.rowcount == 1


def checkpoint_many(
    run_pk: int,
    run_values: dict[str, Any],
    fence: dict[str, Any],
    steps: dict[int, dict[str, Any]],
    events: list[dict[str, Any]],
) -> bool:
    """PostgreSQL only: ``checkpoint`` for any number of steps of one run at once (none
    included), as one statement — the fenced UPDATE of the run, the UPDATE of each step
    (``steps``: its id to its values, the same columns for each; all as one JSON parameter, as
    a start's steps) and the INSERT of the audit events (all with the same columns; chained in
    this order), each only if the one before matched. False if the fence did not match; then
    nothing was written."""
    sql, params = _many(run_pk, run_values, fence, steps, events, ())
    with _cursor(connections[DEFAULT_DB_ALIAS]) as cursor:
        cursor.execute(sql, params)
        return cursor.rowcount == len(events)


def checkpoint_adding(
    run_pk: int,
    run_values: dict[str, Any],
    fence: dict[str, Any],
    steps: dict[int, dict[str, Any]],
    events: list[dict[str, Any]],
    new: list[models.Model],
) -> dict[str, int] | None:
    """PostgreSQL only: ``checkpoint_many`` that also inserts ``new`` step rows of the run (an
    agent's journal rows; at least one), as one statement: the rows go as one JSON parameter (as
    a start's steps), inserted in their order only if the fence matched. Returns their ids by
    step name, or None if the fence did not match; then nothing was written."""
    assert new, "checkpoint_many writes a checkpoint without new rows"
    sql, params = _many(run_pk, run_values, fence, steps, events, new)
    with _cursor(connections[DEFAULT_DB_ALIAS]) as cursor:
        cursor.execute(sql, params)
        found = cursor.fetchall()
    return {name: pk for pk, name in found} if len(found) == len(new) else None


def _many(
    run_pk: int,
    run_values: dict[str, Any],
    fence: dict[str, Any],
    steps: dict[int, dict[str, Any]],
    events: list[dict[str, Any]],
    new: Iterable[models.Model],
) -> tuple[str, list[Any]]:
    """The statement of ``checkpoint_many`` (``new`` empty) or ``checkpoint_adding``, with its
    parameters: whatever the number of steps or new rows, one text per shape."""
    connection = connections[DEFAULT_DB_ALIAS]
    run_names = tuple(sorted(run_values))
    step_names = tuple(sorted(next(iter(steps.values())))) if steps else ()
    audit_names = tuple(sorted(events[0]))
    shape, fence_params = _fence(fence)
    sql, run_fields, step_fields, audit_fields, new_fields = _checkpoint_many_sql(
        run_names, shape, step_names, audit_names, len(events), bool(new)
    )
    params = [*_params(connection, run_names, run_fields, run_values), run_pk, *fence_params]
    if steps:
        rows = [{"id": pk, **values} for pk, values in steps.items()]
        params.append(_step_rows(((StepExecution._meta.pk, False), *step_fields), rows))
    for event in events:
        params.extend(_params(connection, audit_names, audit_fields, event))
    if new_fields:
        params.append(_step_rows(new_fields, (vars(row) for row in new)))  # with run_id: the ORM's row
    return sql, params


@cache
def _checkpoint_many_sql(
    run_names: tuple[str, ...],
    fence: tuple[tuple[str, int], ...],
    step_names: tuple[str, ...],
    audit_names: tuple[str, ...],
    events: int,
    adding: bool,
) -> tuple[str, Columns, Columns, Columns, Columns]:

    quote = connections[DEFAULT_DB_ALIAS].ops.quote_name
    fenced, run_fields, insert, typed, audit_fields = _checkpoint_parts(run_names, fence, audit_names)
    step_fields = _columns(StepExecution, step_names)
    step_table = quote(StepExecution._meta.db_table)
    rows = f"json_populate_recordset(NULL::{step_table}, CAST(%s AS json))"
    sql = fenced
    if step_names:
        sets = ", ".join(f"{quote(field.column)} = v.{quote(field.column)}" for field, _ in step_fields)
        sql += f', stepped AS (UPDATE {step_table} AS s SET {sets} FROM {rows} AS v WHERE s."id" = v."id" '
        sql += "AND EXISTS (SELECT FROM fenced) RETURNING 1)"
    # As in a start: the events are chained in the order of their VALUES rows.
    logged = f"{insert} SELECT e.* FROM (VALUES {', '.join([f'({typed})'] * events)}) AS e"
    logged += f" WHERE EXISTS (SELECT FROM {'stepped' if step_names else 'fenced'})"
    if not adding:  # every data-modifying CTE runs, read or not: the main statement writes the events
        return f"{sql} {logged}", run_fields, step_fields, audit_fields, ()
    # The new rows, in the document's order (their ids in that order, as one save() after the
    # other gives them), read back: none if the fence did not match. The steps' document holds
    # their run_id, as each instance does.
    new_fields = _document_columns(StepExecution)
    names = ", ".join(quote(field.column) for field, _ in new_fields)
    sql += (
        f", logged AS ({logged}), inserted AS (INSERT INTO {step_table} ({names}) "
        f"SELECT {', '.join(f'v.{quote(field.column)}' for field, _ in new_fields)} "
        f"FROM {rows} WITH ORDINALITY AS v WHERE EXISTS (SELECT FROM fenced) ORDER BY v.ordinality "
        f'RETURNING "id", "step_name") SELECT "id", "step_name" FROM inserted'
    )
    return sql, run_fields, step_fields, audit_fields, new_fields


@cache
def _checkpoint_sql(
    run_names: tuple[str, ...],
    fence: tuple[tuple[str, int], ...],
    step_names: tuple[str, ...],
    audit_names: tuple[str, ...],
) -> tuple[str, Columns, Columns, Columns]:

    fenced, run_fields, insert, typed, audit_fields = _checkpoint_parts(run_names, fence, audit_names)
    step_sql, step_fields = _update_sql(connections[DEFAULT_DB_ALIAS].vendor, StepExecution, step_names, ())
    sql = (
        f"{fenced}, stepped AS ({step_sql} AND EXISTS (SELECT FROM fenced) RETURNING 1) "
        f"{insert} SELECT {typed} FROM stepped"
    )
    return sql, run_fields, step_fields, audit_fields


def _checkpoint_parts(
    run_names: tuple[str, ...], fence: tuple[tuple[str, int], ...], audit_names: tuple[str, ...]
) -> tuple[str, Columns, str, str, Columns]:
    """What a checkpoint statement of one step or several begins and ends with: the fenced
    UPDATE of the run (``WITH fenced AS (…)``), and the INSERT of audit events with one row's
    typed placeholders."""
    connection = connections[DEFAULT_DB_ALIAS]
    quote = connection.ops.quote_name
    run_sql, run_fields = _update_sql(connection.vendor, WorkflowRun, run_names, fence)
    audit_fields = _columns(AuditEvent, audit_names)
    columns = ", ".join(quote(field.column) for field, _ in audit_fields)
    # Typed placeholders: in INSERT … SELECT, an untyped literal would be taken as text.
    typed = ", ".join(f"CAST(%s AS {field.db_type(connection)})" for field, _ in audit_fields)
    insert = f"INSERT INTO {quote(AuditEvent._meta.db_table)} ({columns})"
    return f"WITH fenced AS ({run_sql} RETURNING 1)", run_fields, insert, typed, audit_fields


def claim(
    pick_sql: str,
    pick_params: list[Any],
    moves: tuple[tuple[tuple[str, ...], str], ...],
    owner: str,
    lease_until: Any,
    now: Any,
) -> tuple[models.Model, list[models.Model], bool, Any] | None:
    """PostgreSQL only: a whole claim as one statement — lock the run ``pick_sql`` selects
    (its id, state, lease owner, wake time, lease expiry and last update; ``FOR UPDATE SKIP
    LOCKED``), move it to the state ``moves`` gives for its state (``((from states), to), …``:
    the transitions' table, passed in, never written here), give it a new lease generation,
    write the ``claim`` (or ``lease_takeover``) audit event, and read the run and its steps
    back, with whether it was taken over from another owner and when it became due (its wake
    time, else its expired lease's end, else its last update). None if nothing was picked. The
    same transition as ``transitions.leases._claim_in_transaction``, which
    tests/engine/test_claim_paths.py compares field by field."""
    connection = connections[DEFAULT_DB_ALIAS]
    sql, run_fields, step_fields = _claim_sql(pick_sql, tuple(len(sources) for sources, _ in moves))
    at = WorkflowRun._meta.get_field("updated_at")
    params = [
        *pick_params,
        *(value for sources, target in moves for value in (*sources, target)),
        owner,
        at.get_db_prep_save(lease_until, connection),
        at.get_db_prep_save(now, connection),
        AuditEvent._meta.get_field("at").get_db_prep_save(now, connection),
    ]
    with _cursor(connection) as cursor:
        cursor.execute(sql, params)
        found = cursor.fetchall()
    if not found:
        return None
    split = len(run_fields)
    run = _instance(connection, WorkflowRun, found[0][:split])
    taken_over, due_at = found[0][split : split + 2]
    split += 2
    steps = [_instance(connection, StepExecution, row[split:]) for row in found if row[split] is not None]
    return run, steps, taken_over, due_at


def _instance(connection, model: type[models.Model], values: tuple[Any, ...]) -> models.Model:
    """A model instance from a row of all its concrete columns, in order, with the values
    converted as the ORM's own reads would."""
    attnames, converters = _reader(connection.vendor, model)
    converted = list(values)
    for index, col, functions in converters:
        for function in functions:
            converted[index] = function(converted[index], col, connection)
    return model.from_db(DEFAULT_DB_ALIAS, attnames, converted)


@cache
def _reader(vendor: str, model: type[models.Model]) -> tuple[list[str], list[tuple[int, Any, list[Any]]]]:
    """The attribute names of ``model``'s concrete fields and, by position, the converters of
    those whose values need one (keyed by model: hashing its fields at every read cost more
    than the conversion)."""
    connection = connections[DEFAULT_DB_ALIAS]
    converters = []
    for index, field in enumerate(model._meta.concrete_fields):
        col = field.get_col(model._meta.db_table)
        functions = [*connection.ops.get_db_converters(col), *col.get_db_converters(connection)]
        if functions:
            converters.append((index, col, functions))
    return [field.attname for field in model._meta.concrete_fields], converters


def _json_object(members: dict[str, str]) -> str:
    """SQL for the ``json`` object of these keys and text-valued SQL expressions, as the
    canonical text ``recovery.fields.canonical_json`` writes (the audit columns' format)."""
    pairs = " || ',' || ".join(
        f"'{json.dumps(key)}:' || to_json({expression})::text" for key, expression in sorted(members.items())
    )
    return f"CAST('{{' || {pairs} || '}}' AS json)"


@cache
def _claim_sql(pick_sql: str, moves: tuple[int, ...]) -> tuple[str, Fields, Fields]:
    """The claim statement for ``pick_sql``; ``moves`` counts each move's source states."""
    connection = connections[DEFAULT_DB_ALIAS]
    quote = connection.ops.quote_name
    run_table, step_table = quote(WorkflowRun._meta.db_table), quote(StepExecution._meta.db_table)
    run_fields, step_fields = WorkflowRun._meta.concrete_fields, StepExecution._meta.concrete_fields
    run_columns = ", ".join(f"claimed.{quote(f.column)}" for f in run_fields)
    step_columns = ", ".join(f"s.{quote(f.column)}" for f in step_fields)
    sql = f"""
        WITH picked AS ({pick_sql}),
        claimed AS (
            UPDATE {run_table} AS r SET
                "state" = CASE {" ".join(f'WHEN p."state" IN ({", ".join(["%s"] * n)}) THEN %s' for n in moves)} END,
                "lease_owner" = %s,
                "lease_generation" = r."lease_generation" + 1,
                "next_wake_at" = NULL,
                "dispatched_at" = NULL,
                "lease_expires_at" = %s,
                "updated_at" = %s,
                "revision" = r."revision" + 1
            FROM picked AS p WHERE r."id" = p."id"
            RETURNING r.*, p."state" AS before_state, p."lease_owner" AS before_owner,
                COALESCE(p."next_wake_at", p."lease_expires_at", p."updated_at") AS due_at
        ),
        logged AS (
            INSERT INTO {quote(AuditEvent._meta.db_table)}
                ("run_id", "step_name", "action", "reason", "before", "after", "at", "actor", "actor_user_id")
            SELECT "id", '',
                CASE WHEN before_owner <> '' THEN '{AuditAction.LEASE_TAKEOVER.value}'
                    ELSE '{AuditAction.CLAIM.value}' END, '',
                CASE WHEN before_owner <> ''
                    THEN {_json_object({"run": "before_state", "lease_owner": "before_owner"})}
                    ELSE {_json_object({"run": "before_state"})} END,
                {_json_object({"run": '"state"', "lease_owner": '"lease_owner"'})},
                CAST(%s AS timestamp with time zone), 'executor', NULL
            FROM claimed
        )
        SELECT {run_columns}, claimed.before_owner <> '', claimed.due_at, {step_columns}
        FROM claimed LEFT JOIN {step_table} AS s ON s."run_id" = claimed."id"
        ORDER BY s."position", s."id"
    """
    return sql, tuple(run_fields), tuple(step_fields)


def start(
    run: models.Model, steps: list[models.Model], events: list[dict[str, Any]], *, unless_paused: bool = False
) -> tuple[int, dict[int, int]] | None:
    """PostgreSQL only: a run's start as one statement (one round trip, its own transaction in
    autocommit) — the run (unless one with its workflow id exists), its steps and its audit
    events (each without ``run``, all with the same columns; chained in this order), each
    written only with the one before. Returns the new run's id and its steps' ids by position,
    or None if the workflow id was taken (or, ``unless_paused``, a pause of the run's workflow
    or of one of its steps is in force: a claimed start): then nothing was written.

    The steps go as one parameter, a JSON document of their rows (``_step_rows``) that
    PostgreSQL expands with ``json_populate_recordset``: the statement's text does not depend on
    how many steps the workflow has, and it stays within psycopg's limits for caching its
    conversion of a statement (50 parameters, 4096 bytes), so psycopg parses it once per process
    instead of at every start. The run and its events keep one typed parameter per column (the
    chain trigger hashes the events' ``before`` and ``after`` as they are written)."""
    connection = connections[DEFAULT_DB_ALIAS]
    audit_names = tuple(sorted(events[0]))
    sql, run_fields, step_fields, audit_fields = _start_sql(len(events), audit_names, unless_paused)
    params = _row(connection, run, run_fields)  # in the statement's order: the run, its events, its steps
    if unless_paused:
        params.append(run.workflow_name)
    for event in events:
        params.extend(_params(connection, audit_names, audit_fields, event))
    params.append(_step_rows(step_fields, (vars(step) for step in steps)))  # a model keeps its values by attname
    with _cursor(connection) as cursor:
        cursor.execute(sql, params)
        found = cursor.fetchall()
    if not found:
        return None
    return found[0][0], {position: pk for _, pk, position in found}


def _row(connection, obj: models.Model, columns: Columns) -> list[Any]:
    names = tuple(field.attname for field, _ in columns)
    return _params(connection, names, columns, {name: getattr(obj, name) for name in names})


# Compact; non-ASCII characters kept as they are (PostgreSQL reads the document as UTF-8 text).
_encode_rows = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def _step_rows(columns: Columns, rows: Iterable[Mapping[str, Any]]) -> str:
    """``rows`` (each field's attribute name to its value) as a JSON array of objects, column
    name to value, for ``json_populate_recordset``, which reads each value as its column's type
    would read its text: the values the ORM would have written. A string, an integer (choices included), a
    boolean or None goes as it is (a JSON null is read as SQL NULL, which is also what the ORM
    writes for a JSON field's None); an aware datetime as its ISO text, microseconds kept; a JSON
    field's value as the nested document, through the field's encoder if it has one. Any other
    value raises TypeError rather than be written in a form the ORM might not have given it."""
    written = []
    for values in rows:
        row = {}
        for field, is_json in columns:
            value = values[field.attname]
            if is_json:
                if value is not None and field.encoder is not None:
                    value = json.loads(json.dumps(value, cls=field.encoder))
            elif value is not None and not isinstance(value, (str, int)):
                if not isinstance(value, datetime) or value.utcoffset() is None:
                    raise TypeError(f"{field.model.__name__}.{field.name}: no JSON form for {value!r}")
                value = value.isoformat()
            row[field.column] = value
        written.append(row)
    return _encode_rows(written)


def _written(model: type[models.Model], *, without: str = "") -> Columns:
    """The columns an insert of ``model`` writes: every concrete field but its id, ``without``
    and those the database fills in."""
    fields = [
        f for f in model._meta.concrete_fields if not f.primary_key and f.name != without and not f.has_db_default()
    ]
    return tuple((field, isinstance(field, models.JSONField)) for field in fields)


def _document_columns(model: type[models.Model], *, without: str = "") -> Columns:
    """``_written``, for rows written from a JSON document (``_step_rows``)."""
    columns = _written(model, without=without)
    # A json column would keep the document's text as _step_rows wrote it, not as the field would.
    if any(field.db_type(connections[DEFAULT_DB_ALIAS]) == "json" for field, _ in columns):
        raise TypeError(f"a {model.__name__}'s json column cannot be written from a JSON document")
    return columns


@cache
def _start_sql(
    events: int, audit_names: tuple[str, ...], unless_paused: bool = False
) -> tuple[str, Columns, Columns, Columns]:
    """The start statement for ``events`` audit events of these columns, for any number of steps;
    ``unless_paused``: its run is written only while no pause of its workflow is in force."""
    connection = connections[DEFAULT_DB_ALIAS]
    quote = connection.ops.quote_name
    run_fields = _written(WorkflowRun)
    step_fields = _document_columns(StepExecution, without="run")
    audit_fields = _columns(AuditEvent, audit_names)

    def names(columns: Columns, prefix: str = "") -> str:
        return ", ".join(prefix + quote(field.column) for field, _ in columns)

    # Typed placeholders: in INSERT … SELECT, an untyped literal would be taken as text.
    typed = ", ".join(f"CAST(%s AS {field.db_type(connection)})" for field, _ in audit_fields)
    step_table = quote(StepExecution._meta.db_table)
    # The events are chained in the order the database inserts them (the chain trigger reads the
    # run's last event), which is the order of their VALUES rows: there is one new run. The steps
    # are inserted in the order of the document's rows.
    values = f"VALUES ({', '.join(['%s'] * len(run_fields))})"
    if unless_paused:  # typed: in INSERT … SELECT an untyped parameter would be taken as text
        typed_run = ", ".join(f"CAST(%s AS {field.db_type(connection)})" for field, _ in run_fields)
        pauses = quote(WorkflowPause._meta.db_table)
        values = (
            f"SELECT {typed_run} WHERE NOT EXISTS (SELECT 1 FROM {pauses} WHERE {quote('workflow_name')} = "
            f"CAST(%s AS varchar) AND {quote('released_at')} IS NULL)"
        )
    sql = (
        f"WITH new_run AS (INSERT INTO {quote(WorkflowRun._meta.db_table)} ({names(run_fields)}) {values} "
        f'ON CONFLICT ("workflow_id") DO NOTHING RETURNING "id"), '
        f"new_events AS (INSERT INTO {quote(AuditEvent._meta.db_table)} "
        f'("run_id", {names(audit_fields)}) SELECT new_run."id", e.* '
        f"FROM new_run, (VALUES {', '.join([f'({typed})'] * events)}) AS e) "
        f'INSERT INTO {step_table} ("run_id", {names(step_fields)}) SELECT new_run."id", {names(step_fields, "v.")} '
        f"FROM new_run, json_populate_recordset(NULL::{step_table}, CAST(%s AS json)) AS v "
        f'RETURNING "run_id", "id", "position"'
    )
    return sql, run_fields, step_fields, audit_fields
