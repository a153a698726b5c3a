"""JSON stored as its canonical text, so that the database can hand it out byte for byte."""

from __future__ import annotations

import json
from typing import Any

from django.db import models
from psycopg.types.json import Json

# Built once (json.dumps with options builds a new encoder at every call).
_encode = json.JSONEncoder(separators=(",", ":"), sort_keys=True, ensure_ascii=False).encode


def canonical_json(value: Any) -> str:
    """Compact JSON with its keys sorted at every depth and non-ASCII characters kept: one
    text for one value, whoever writes it (``json.dumps(value, separators=(",", ":"),
    sort_keys=True, ensure_ascii=False)``)."""
    return _encode(value)


class CanonicalJSONField(models.JSONField):
    """A ``JSONField`` whose column holds the value's canonical text (``canonical_json``).

    On PostgreSQL the column is ``json``, not ``jsonb``: ``json`` keeps the text exactly as it
    was written, where ``jsonb`` reorders keys and adds spaces. The audit export relies on it:
    PostgreSQL streams ``before`` and ``after`` as stored, and they are what the Python
    formatter writes (recovery.engine.audit.export). Nothing queries inside these documents, which is
    what ``jsonb`` is for. On SQLite a JSON field is text anyway; it is canonical text too."""

    def db_type(self, connection):
        return "json" if connection.vendor == "postgresql" else super().db_type(connection)

    def get_db_prep_value(self, value, connection, prepared=False):
        if not prepared:
            value = self.get_prep_value(value)
        if connection.vendor == "postgresql":
            return Json(value, dumps=canonical_json)
        return canonical_json(value)

    def from_db_value(self, value, expression, connection):
        if connection.vendor == "postgresql":
            return value  # psycopg decodes json itself (Django has it hand over jsonb's text only)
        return super().from_db_value(value, expression, connection)
