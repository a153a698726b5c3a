"""Single-row writes for the executor's hot path, one level below the ORM.

An executor checkpoints twice per step. Through ``Model.save()`` or ``QuerySet.update()`` each
of those writes costs a few hundred microseconds of Python (query compilation, signals) —
more than the database round trip. These functions build the same statement once per model
and column set, and adapt every value with its field's own ``get_db_prep_save``, so a row
ends up exactly as the ORM would have written it, on SQLite as on PostgreSQL. Only
``recovery.transitions`` calls them.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from django.db import connection, models


@cache
def _columns(model: type[models.Model], names: tuple[str, ...]) -> tuple[str, tuple[models.Field, ...]]:
    fields = tuple(model._meta.get_field(name) for name in names)
    return connection.ops.quote_name(model._meta.db_table), fields


def _params(names: tuple[str, ...], fields: tuple[models.Field, ...], values: dict[str, Any]) -> list[Any]:
    return [field.get_db_prep_save(values[name], connection) for name, field in zip(names, fields, strict=True)]


def update(model: type[models.Model], pk: int, values: dict[str, Any], **fence: Any) -> int:
    """``UPDATE … SET values WHERE id = pk`` and, for each ``fence`` item, ``column = value``
    (a tuple or frozenset value: ``column IN (…)``). Returns the number of rows changed."""
    names = tuple(sorted(values))
    table, fields = _columns(model, names)
    quote = connection.ops.quote_name
    sets = ", ".join(f"{quote(field.column)} = %s" for field in fields)
    where, params = [f"{quote(model._meta.pk.column)} = %s"], [*_params(names, fields, values), pk]
    for name, value in fence.items():
        column = quote(model._meta.get_field(name).column)
        if isinstance(value, (tuple, frozenset, set, list)):
            where.append(f"{column} IN ({', '.join(['%s'] * len(value))})")
            params.extend(sorted(value))
        else:
            where.append(f"{column} = %s")
            params.append(value)
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {table} SET {sets} WHERE {' AND '.join(where)}", params)
        return cursor.rowcount


def insert(model: type[models.Model], values: dict[str, Any]) -> None:
    """``INSERT INTO … (values)``: one row, its id not read back."""
    names = tuple(sorted(values))
    table, fields = _columns(model, names)
    quote = connection.ops.quote_name
    columns = ", ".join(quote(field.column) for field in fields)
    placeholders = ", ".join(["%s"] * len(fields))
    with connection.cursor() as cursor:
        cursor.execute(f"INSERT INTO {table} ({columns}) VALUES ({placeholders})", _params(names, fields, values))
