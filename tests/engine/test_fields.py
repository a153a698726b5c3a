"""Audit documents are stored as their canonical JSON text (recovery.fields), which the
export hands out as stored on PostgreSQL: the text in the database must be exactly
``canonical_json`` of the value, whoever wrote it (the ORM, the executor's own SQL, the
migration that rewrote older events)."""

import importlib
import json
from types import SimpleNamespace

import pytest
from django.conf import settings
from django.db import connection

from recovery.engine.audit import chain as audit_chain
from recovery.engine.transitions import run_claim, run_start
from recovery.fields import canonical_json
from recovery.models import AuditEvent
from tests.support.engine import drive

pytestmark = pytest.mark.django_db

EVENT = {"tenant": "t", "order_id": "canon"}


def stored(pk: int) -> tuple[str, str]:
    with connection.cursor() as cursor:
        cursor.execute(
            'SELECT CAST("before" AS text), CAST("after" AS text) FROM recovery_auditevent WHERE id = %s', [pk]
        )
        return cursor.fetchone()


def test_canonical_json_sorts_keys_at_every_depth_without_spaces_and_keeps_unicode():
    value = {"z": 1, "a": {"y": [2, {"d": 1, "c": 0}], "b": "é 😀"}, "m": None}
    assert canonical_json(value) == '{"a":{"b":"é 😀","y":[2,{"c":0,"d":1}]},"m":null,"z":1}'


@pytest.mark.parametrize("value", [{"z": 1, "a": {"é": [1, {"b": 2, "a": "x y"}]}}, "-1", -1, [3, "=1"], {}])
def test_a_document_is_stored_as_its_canonical_text_and_read_back_as_it_was(value):
    run = run_start(workflow="test_orders", data=EVENT)[0]
    event = AuditEvent.objects.create(
        run=run, at=run.created_at, actor="executor", action="note", before=value, after={"k": value}
    )
    assert stored(event.pk) == (canonical_json(value), canonical_json({"k": value}))
    event = AuditEvent.objects.get(pk=event.pk)
    assert (event.before, event.after) == (value, {"k": value})  # a JSON string stays a string


def test_every_event_the_engine_writes_is_canonical_text(clock):
    """The executor writes its events with its own SQL (a claim, a checkpoint): the same text."""
    assert drive(run_start(workflow="test_orders", data=EVENT)[0], clock).state == "completed"
    lost = run_start(workflow="test_orders", data={**EVENT, "order_id": "lost"})[0]
    assert run_claim(run_pk=lost.pk, owner="lost-worker") is not None
    clock.advance(settings.RECOVERY_LEASE_SECONDS + 1)
    assert run_claim(run_pk=lost.pk).taken_over
    pks = list(AuditEvent.objects.values_list("pk", flat=True))
    assert AuditEvent.objects.filter(action="lease_takeover").count() == 1 and len(pks) > 5
    for pk in pks:
        before, after = stored(pk)
        assert (before, after) == (canonical_json(json.loads(before)), canonical_json(json.loads(after))), pk


def test_on_postgresql_the_columns_are_json_which_keeps_the_text_as_written():
    if connection.vendor != "postgresql":
        pytest.skip("the column type is PostgreSQL's")
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT column_name, data_type FROM information_schema.columns "
            "WHERE table_name = 'recovery_auditevent' AND column_name IN ('before', 'after')"
        )
        assert dict(cursor.fetchall()) == {"before": "json", "after": "json"}


def test_the_migration_rewrites_older_events_as_canonical_text():
    run = run_start(workflow="test_orders", data=EVENT)[0]
    event = AuditEvent.objects.create(run=run, at=run.created_at, actor="executor", action="note")
    untouched = AuditEvent.objects.create(run=run, at=run.created_at, actor="executor", action="note", after={"a": 1})
    with connection.cursor() as cursor:  # as jsonb (or Django's default JSON text) left them
        for statement in audit_chain.uninstall_statements(connection.vendor):  # as before 0013 (rolled back)
            cursor.execute(statement)
        cursor.execute(
            """UPDATE recovery_auditevent SET "before" = '{"z": 1, "a": {"c": "é", "b": [1, 2]}}', "after" = '{}' """
            "WHERE id = %s",
            [event.pk],
        )
    migration = importlib.import_module("recovery.migrations.0012_canonical_audit_json")
    migration.canonicalise(None, SimpleNamespace(connection=connection))
    assert stored(event.pk) == ('{"a":{"b":[1,2],"c":"é"},"z":1}', "{}")
    assert stored(untouched.pk) == ("{}", '{"a":1}')
