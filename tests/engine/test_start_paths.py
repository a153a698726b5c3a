"""One start, two paths: PostgreSQL starts a run in one statement (storage.start: the run, its
steps and its start event, one round trip), every database can start it in a transaction of
three. Here twin events are started on both paths and the rows they leave are compared field
by field; a repeated event writes nothing on either, and the engine's start saves no version
of the run (the start event says who started it)."""

from io import StringIO
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext

from recovery.engine import dispatch
from recovery.engine.transitions import run_start, runs
from recovery.errors import StartConflict
from recovery.models import AuditEvent, RunSearch, StepExecution, WorkflowRun

pytestmark = pytest.mark.django_db

# Fields that differ between twins by construction: their own ids and what the event makes.
RUN_OWN = {"id", "workflow_id", "input", "input_hash"}
STEP_OWN = {"id", "run", "idempotency_key"}
AUDIT_OWN = {"id", "run", "prev_hash", "hash"}


def fields(obj, own: set[str]) -> dict[str, Any]:
    return {f.name: getattr(obj, f.attname) for f in obj._meta.concrete_fields if f.name not in own}


def event(order_id: str) -> dict:
    return {"tenant": "t", "order_id": order_id, "text": "office chairs 120"}


def rows(run: WorkflowRun) -> tuple[dict, list[dict], list[dict]]:
    run = WorkflowRun.objects.get(pk=run.pk)
    steps = [fields(s, STEP_OWN) for s in run.steps.order_by("position")]
    audit = [fields(a, AUDIT_OWN) for a in run.audit_events.order_by("id")]
    return fields(run, RUN_OWN), steps, audit


@pytest.fixture
def postgresql():
    if connection.vendor != "postgresql":
        pytest.skip("the one-statement start is PostgreSQL's (set DATABASE_URL=postgres://…)")


@pytest.mark.parametrize("actor", [None, "api-client"])
def test_both_start_paths_leave_the_same_rows(postgresql, clock, monkeypatch, actor):
    if actor:
        actor = get_user_model().objects.create(username=actor)
    one, created = run_start(workflow="test_orders", data=event("twin-a"), actor=actor)
    assert created
    monkeypatch.setattr(runs, "_insert_in_one_statement", runs._insert_in_transaction)
    other, created = run_start(workflow="test_orders", data=event("twin-b"), actor=actor)
    assert created

    assert rows(one) == rows(other)
    run, steps, audit = rows(one)
    assert len(steps) == 5 and [a["action"] for a in audit] == ["start"]
    assert audit[0]["actor"] == (actor.get_username() if actor else "executor")
    # What run_start returns is the run as stored.
    assert fields(one, RUN_OWN) == run and one.pk and not one._state.adding
    assert RunSearch.objects.filter(run__in=[one, other]).count() == 2  # the search trigger saw both
    call_command("verify_audit", stdout=StringIO())  # the chain trigger hashed both alike


def test_a_start_on_postgresql_is_one_statement(postgresql, clock):
    with CaptureQueriesContext(connection) as captured:
        run_start(workflow="test_orders", data=event("one"))
    assert len(captured) == 1, [q["sql"][:80] for q in captured]


@pytest.mark.parametrize("path", ["one statement", "transaction"])
def test_a_repeated_event_writes_nothing_and_another_input_is_a_conflict(clock, monkeypatch, path):
    if path == "transaction":
        monkeypatch.setattr(runs, "_insert_in_one_statement", runs._insert_in_transaction)
    elif connection.vendor != "postgresql":
        pytest.skip("the one-statement start is PostgreSQL's (set DATABASE_URL=postgres://…)")
    first, _ = run_start(workflow="test_orders", data=event("again"))
    counts = (WorkflowRun.objects.count(), StepExecution.objects.count(), AuditEvent.objects.count())

    again, created = run_start(workflow="test_orders", data=event("again"))
    assert (again.pk, created) == (first.pk, False)
    with pytest.raises(StartConflict, match="already exists with a different input"):
        run_start(workflow="test_orders", data={**event("again"), "text": "travel 10"})

    assert (WorkflowRun.objects.count(), StepExecution.objects.count(), AuditEvent.objects.count()) == counts
    assert WorkflowRun.objects.get(pk=first.pk).input["text"] == "office chairs 120"


def test_the_engine_start_saves_no_version_of_the_run(clock):
    run, _ = run_start(workflow="test_orders", data=event("versions"), actor="api-client")
    assert run.history.count() == 0
    assert StepExecution.history.filter(run_id=run.pk).count() == 0


@pytest.mark.django_db(transaction=True)
def test_under_celery_a_start_is_stamped_with_its_insert_and_queued_after_commit(clock, settings, monkeypatch):
    sent = []
    monkeypatch.setitem(dispatch._senders, "run", sent.append)
    settings.RECOVERY_EXECUTOR = "celery"
    run, _ = run_start(workflow="test_orders", data=event("queued"))
    assert sent == [run.pk]
    assert WorkflowRun.objects.get(pk=run.pk).dispatched_at is not None
    run_start(workflow="test_orders", data=event("queued"))
    assert sent == [run.pk]  # a repeated event queues nothing
