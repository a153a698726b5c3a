"""Single-row writes for the executor's hot path, one level below the ORM.

An executor checkpoints twice per step. Through ``Model.save()`` or ``QuerySet.update()`` each
of those writes costs a few hundred microseconds of Python (query compilation, signals) —
more than the database round trip. These functions build the same statement once per model
and column set, and adapt every value with its field's own ``get_db_prep_save``, so a row
ends up exactly as the ORM would have written it, on SQLite as on PostgreSQL. Only
``recovery.transitions`` calls them, on the default database.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections, models

Fields = tuple[models.Field, ...]


def update(model: type[models.Model], pk: int, values: dict[str, Any], **fence: Any) -> int:
    """``UPDATE … SET values WHERE id = pk`` and, for each ``fence`` item, ``column = value``
    (a frozenset value: ``column IN (…)``). Returns the number of rows changed."""
    connection = connections[DEFAULT_DB_ALIAS]
    names = tuple(sorted(values))
    fenced = tuple(sorted((name, len(value) if isinstance(value, frozenset) else 0) for name, value in fence.items()))
    sql, fields = _update_sql(connection.vendor, model, names, fenced)
    params = _params(connection, names, fields, values)
    params.append(pk)
    for name, _ in fenced:
        value = fence[name]
        params.extend(sorted(value) if isinstance(value, frozenset) else [value])
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.rowcount


def insert(model: type[models.Model], values: dict[str, Any]) -> None:
    """``INSERT INTO … (values)``: one row, its id not read back."""
    connection = connections[DEFAULT_DB_ALIAS]
    names = tuple(sorted(values))
    sql, fields = _insert_sql(connection.vendor, model, names)
    with connection.cursor() as cursor:
        cursor.execute(sql, _params(connection, names, fields, values))


def _params(connection, names: tuple[str, ...], fields: Fields, values: dict[str, Any]) -> list[Any]:
    return [field.get_db_prep_save(values[name], connection) for name, field in zip(names, fields, strict=True)]


@cache
def _update_sql(
    vendor: str, model: type[models.Model], names: tuple[str, ...], fence: tuple[tuple[str, int], ...]
) -> tuple[str, Fields]:
    quote = connections[DEFAULT_DB_ALIAS].ops.quote_name
    meta = model._meta
    fields = tuple(meta.get_field(name) for name in names)
    sets = ", ".join(f"{quote(field.column)} = %s" for field in fields)
    where = [f"{quote(meta.pk.column)} = %s"]
    for name, members in fence:
        column = quote(meta.get_field(name).column)
        where.append(f"{column} IN ({', '.join(['%s'] * members)})" if members else f"{column} = %s")
    return f"UPDATE {quote(meta.db_table)} SET {sets} WHERE {' AND '.join(where)}", fields


@cache
def _insert_sql(vendor: str, model: type[models.Model], names: tuple[str, ...]) -> tuple[str, Fields]:
    quote = connections[DEFAULT_DB_ALIAS].ops.quote_name
    fields = tuple(model._meta.get_field(name) for name in names)
    columns = ", ".join(quote(field.column) for field in fields)
    placeholders = ", ".join(["%s"] * len(fields))
    return f"INSERT INTO {quote(model._meta.db_table)} ({columns}) VALUES ({placeholders})", fields


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
    fenced = tuple(sorted((name, len(value) if isinstance(value, frozenset) else 0) for name, value in fence.items()))
    sql, run_fields, step_fields, audit_fields = _checkpoint_sql(run_names, fenced, step_names, audit_names)
    params = _params(connection, run_names, run_fields, run_values)
    params.append(run_pk)
    for name, _ in fenced:
        value = fence[name]
        params.extend(sorted(value) if isinstance(value, frozenset) else [value])
    params.extend(_params(connection, step_names, step_fields, step_values))
    params.append(step_pk)
    params.extend(_params(connection, audit_names, audit_fields, audit_values))
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.rowcount == 1


@cache
def _checkpoint_sql(
    run_names: tuple[str, ...],
    fence: tuple[tuple[str, int], ...],
    step_names: tuple[str, ...],
    audit_names: tuple[str, ...],
) -> tuple[str, Fields, Fields, Fields]:
    from .models import AuditEvent, StepExecution, WorkflowRun

    connection = connections[DEFAULT_DB_ALIAS]
    quote = connection.ops.quote_name
    run_sql, run_fields = _update_sql(connection.vendor, WorkflowRun, run_names, fence)
    step_sql, step_fields = _update_sql(connection.vendor, StepExecution, step_names, ())
    audit_fields = tuple(AuditEvent._meta.get_field(name) for name in audit_names)
    columns = ", ".join(quote(field.column) for field in audit_fields)
    # Typed placeholders: in INSERT … SELECT, an untyped literal would be taken as text.
    values = ", ".join(f"CAST(%s AS {field.db_type(connection)})" for field in audit_fields)
    sql = (
        f"WITH fenced AS ({run_sql} RETURNING 1), "
        f"stepped AS ({step_sql} AND EXISTS (SELECT FROM fenced) RETURNING 1) "
        f"INSERT INTO {quote(AuditEvent._meta.db_table)} ({columns}) SELECT {values} FROM stepped"
    )
    return sql, run_fields, step_fields, audit_fields
