"""The audit trail's integrity is kept by the database (recovery.engine.audit.chain): events cannot be
updated or deleted, and each run's events form a hash chain that ``verify_audit`` walks — in
the database, or offline in a JSON Lines export — reporting the first broken link."""

from __future__ import annotations

import importlib
import json
from io import StringIO
from types import SimpleNamespace

import pytest
from django.core.management import CommandError, call_command
from django.db import DatabaseError, connection, transaction

from recovery.engine.audit import chain as audit_chain
from recovery.engine.transitions import run_start
from recovery.models import AuditEvent, RunState, WorkflowRun
from tests.support.engine import drive

pytestmark = pytest.mark.django_db


def start(order_id: str) -> WorkflowRun:
    return run_start(workflow="test_orders", data={"tenant": "t", "order_id": order_id})[0]


def snapshot() -> list[tuple]:
    return list(AuditEvent.objects.order_by("id").values_list("id", "reason", "action", "before", "prev_hash", "hash"))


def verify(*args: str) -> tuple[int, str, str]:
    out, err = StringIO(), StringIO()
    try:
        call_command("verify_audit", *args, stdout=out, stderr=err)
        code = 0
    except SystemExit as exc:
        code = exc.code
    return code, out.getvalue(), err.getvalue()


def without_triggers() -> None:
    """As someone who can drop the database's triggers (the test's transaction restores them)."""
    with connection.cursor() as cursor:
        for statement in audit_chain.uninstall_statements(connection.vendor):
            cursor.execute(statement)


def sql(statement: str, params=()) -> None:
    with connection.cursor() as cursor:
        cursor.execute(statement, params)


def export_jsonl(**filters) -> str:
    out = StringIO()
    call_command("export_audit", "--format", "jsonl", *[f"--{k}={v}" for k, v in filters.items()], stdout=out)
    return out.getvalue()


@pytest.fixture
def two_runs(clock):
    first, second = drive(start("chain-1"), clock), drive(start("chain-2"), clock)
    assert first.state == second.state == RunState.COMPLETED
    return first, second


def test_the_database_chains_every_event_of_a_run_by_hash(two_runs):
    for run in two_runs:
        events = list(run.audit_events.order_by("id"))
        assert len(events) > 8
        assert events[0].prev_hash == ""
        for previous, event in zip(events, events[1:], strict=False):
            assert event.prev_hash == previous.hash
        # The hash is over what the export shows: an auditor recomputes it from a line.
        lines = export_jsonl(run=run.workflow_id).splitlines()[: len(events)]  # the trailer follows
        for line, event in zip(lines, events, strict=True):
            doc = json.loads(line)
            values = [doc[c] if c not in ("before", "after") else json.dumps(doc[c], separators=(",", ":"),
                      sort_keys=True, ensure_ascii=False) for c in audit_chain.HASHED]  # fmt: skip
            assert audit_chain.event_hash(doc["prev_hash"], values) == event.hash == doc["hash"]
    assert len(set(AuditEvent.objects.values_list("hash", flat=True))) == AuditEvent.objects.count()
    code, out, err = verify()
    assert (code, err) == (0, "")
    assert out.strip() == f"audit chain intact: {AuditEvent.objects.count()} events in 2 runs"


@pytest.mark.parametrize(
    "statement",
    [
        "UPDATE recovery_auditevent SET reason = 'rewritten'",
        "UPDATE recovery_auditevent SET hash = '', prev_hash = ''",
        "DELETE FROM recovery_auditevent",
        "DELETE FROM recovery_auditevent WHERE action = 'start'",
    ],
)
def test_the_database_refuses_to_update_or_delete_an_event(two_runs, statement):
    before = snapshot()
    with pytest.raises(DatabaseError, match="append-only"), transaction.atomic():
        sql(statement)
    assert snapshot() == before


@pytest.mark.parametrize(
    "statement",
    ["TRUNCATE recovery_auditevent", "TRUNCATE recovery_workflowrun CASCADE"],
)
def test_the_database_refuses_to_truncate_the_trail(postgres_only, two_runs, statement):
    # The owner's TRUNCATE emptied the trail, and verify_audit then said "intact: 0 events".
    sql("SET CONSTRAINTS ALL IMMEDIATE")  # the test's transaction holds deferred FK checks
    before = snapshot()
    with pytest.raises(DatabaseError, match="append-only: TRUNCATE refused"), transaction.atomic():
        sql(statement)
    assert snapshot() == before
    assert AuditEvent.objects.count() > 16


def test_the_orm_cannot_update_or_delete_events_either(two_runs):
    before = snapshot()
    with pytest.raises(DatabaseError, match="append-only"), transaction.atomic():
        AuditEvent.objects.filter(action="claim").update(reason="quietly")
    with pytest.raises(DatabaseError, match="append-only"), transaction.atomic():
        AuditEvent.objects.filter(action="claim")._raw_delete(connection.alias)
    with pytest.raises(ValueError, match="append-only"):
        AuditEvent.objects.first().delete()
    assert snapshot() == before


def test_a_writer_cannot_choose_an_events_hash(two_runs):
    run = two_runs[0]
    last = run.audit_events.order_by("-id").first()
    forged = "f" * 64
    try:
        with transaction.atomic():
            AuditEvent.objects.create(
                run=run, at=last.at, actor="mallory", action="note", prev_hash=forged, hash=forged
            )
    except DatabaseError:
        assert connection.vendor == "sqlite"  # refused there; PostgreSQL overwrites them
    assert not AuditEvent.objects.filter(hash=forged).exists()
    assert not AuditEvent.objects.filter(prev_hash=forged).exists()
    assert verify()[0] == 0


def test_verify_audit_reports_a_changed_event_as_the_first_broken_link(two_runs):
    without_triggers()
    events = list(two_runs[1].audit_events.order_by("id"))
    sql("UPDATE recovery_auditevent SET reason = 'nothing to see' WHERE id = %s", [events[3].id])
    sql("UPDATE recovery_auditevent SET actor = 'someone' WHERE id = %s", [events[6].id])

    code, out, err = verify()

    assert (code, out) == (1, "")
    assert err.count("\n") == 1 and err.startswith("audit chain broken in 1 of 2 runs; first broken link: ")
    assert f"event {events[3].id} of run {two_runs[1].workflow_id} ({events[3].action} at " in err
    assert "its content does not match its hash" in err
    assert verify("--run", two_runs[0].workflow_id)[0] == 0  # the other run's chain is intact


def test_verify_audit_reports_a_removed_event_at_the_next_link(two_runs):
    without_triggers()
    events = list(two_runs[0].audit_events.order_by("id"))
    sql("DELETE FROM recovery_auditevent WHERE id = %s", [events[4].id])

    code, _, err = verify()

    assert code == 1
    assert f"event {events[5].id} of run {two_runs[0].workflow_id}" in err
    assert f"its prev_hash does not match the hash of event {events[3].id} before it" in err


def test_verify_audit_reports_missing_first_events(two_runs):
    without_triggers()
    first = two_runs[0].audit_events.order_by("id").first()
    sql("DELETE FROM recovery_auditevent WHERE id = %s", [first.id])

    code, _, err = verify()

    assert code == 1 and "the run's first event has a prev_hash" in err


def test_a_rehashed_event_still_breaks_the_link_after_it(two_runs):
    """Someone who recomputes the changed event's own hash must rewrite every later event of
    the run too; one rewritten event alone shows at the next link."""
    without_triggers()
    events = list(two_runs[0].audit_events.order_by("id"))
    target = events[2]
    chain = next(audit_chain.stored_chains(run=two_runs[0].workflow_id))
    values = list(chain[2].values)
    values[6] = "a better reason"
    sql(
        "UPDATE recovery_auditevent SET reason = %s, hash = %s WHERE id = %s",
        [values[6], audit_chain.event_hash(target.prev_hash, values), target.id],
    )

    code, _, err = verify()

    assert code == 1 and f"event {events[3].id} of run" in err and "prev_hash does not match" in err


def test_an_export_verifies_offline_and_shows_tampering(two_runs, tmp_path):
    path = tmp_path / "audit.jsonl"
    call_command("export_audit", "--format", "jsonl", "--output", str(path), stdout=StringIO())
    lines = path.read_text().splitlines(keepends=True)
    assert len(lines) == AuditEvent.objects.count() + 3  # and the trailer: a line per run, the total

    code, out, _ = verify("--file", str(path))
    assert code == 0 and f"{AuditEvent.objects.count()} events in 2 runs" in out

    doc = json.loads(lines[5])
    doc["reason"] = "edited in a spreadsheet"
    path.write_text("".join([*lines[:5], json.dumps(doc) + "\n", *lines[6:]]))
    code, _, err = verify("--file", str(path))
    assert code == 1 and f"event {doc['event_id']} of run" in err and "content does not match" in err

    path.write_text("".join([*lines[:5], *lines[6:]]))  # a line removed
    code, _, err = verify("--file", str(path))
    assert code == 1 and "prev_hash does not match" in err


def test_an_export_of_a_later_period_verifies_from_its_first_event(two_runs, tmp_path):
    events = list(AuditEvent.objects.order_by("at", "id"))
    since = events[len(events) // 2].at
    path = tmp_path / "later.jsonl"
    call_command(
        "export_audit", "--format", "jsonl", f"--since={since.isoformat()}", "--output", str(path), stdout=StringIO()
    )
    code, out, err = verify("--file", str(path))
    assert (code, err) == (0, "") and "intact" in out


def test_verify_audit_refuses_bad_arguments_with_one_line(two_runs, tmp_path):
    with pytest.raises(CommandError, match="no run 'nope'"):
        call_command("verify_audit", "--run", "nope")
    with pytest.raises(CommandError, match="cannot read"):
        call_command("verify_audit", "--file", str(tmp_path / "missing.jsonl"))
    csv = tmp_path / "audit.csv"
    csv.write_text("at,workflow_id\n2026-01-01,x\n")
    with pytest.raises(CommandError, match="line 1 is not an event of a JSON Lines audit export"):
        call_command("verify_audit", "--file", str(csv))


def test_the_migration_chains_the_events_stored_before_it(two_runs):
    expected = snapshot()
    without_triggers()  # as before 0013: no triggers, no hashes
    sql("UPDATE recovery_auditevent SET prev_hash = '', hash = ''")
    assert verify()[0] == 1

    migration = importlib.import_module("recovery.migrations.0013_audit_chain")
    migration.backfill(None, SimpleNamespace(connection=connection))

    assert snapshot() == expected  # the same hashes the database's trigger computed
    assert verify()[0] == 0
