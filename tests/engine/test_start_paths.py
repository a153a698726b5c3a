"""One start, two paths: PostgreSQL starts a run in one statement (storage.start: the run, its
steps and its start event, one round trip), every database can start it in a transaction of
three. Here twin events are started on both paths and the rows they leave are compared field
by field; a repeated event writes nothing on either, and the engine's start saves no version
of the run (the start event says who started it). A start claimed by the executor that will run
it (``run_start_claimed``) leaves exactly the rows of a start followed by a claim."""

from io import StringIO
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext

from recovery import tasks
from recovery.engine import dispatch, executor
from recovery.engine.transitions import run_claim, run_start, run_start_claimed, runs
from recovery.errors import StartConflict
from recovery.models import AuditEvent, RunSearch, RunState, StepExecution, WorkflowRun
from tests.support import receivers
from tests.support.engine import crash_at, drive

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


ONE_STATEMENT_SKIP = "the one-statement start is PostgreSQL's (set DATABASE_URL=postgres://…)"


@pytest.fixture
def postgresql():
    if connection.vendor != "postgresql":
        pytest.skip(ONE_STATEMENT_SKIP)


@pytest.fixture(params=["one statement", "transaction"])
def path(request, monkeypatch):
    if request.param == "transaction":
        monkeypatch.setattr(runs, "_insert_in_one_statement", runs._insert_in_transaction)
    elif connection.vendor != "postgresql":
        pytest.skip(ONE_STATEMENT_SKIP)
    return request.param


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


def test_a_repeated_event_writes_nothing_and_another_input_is_a_conflict(clock, path):
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


def test_a_claimed_start_leaves_the_rows_of_a_start_then_a_claim(clock, path):
    started, _ = run_start(workflow="test_orders", data=event("then-claimed"))
    lease = run_claim(run_pk=started.pk, owner="executor-7")
    claimed, own = run_start_claimed(workflow="test_orders", data=event("claimed"), owner="executor-7")

    assert rows(claimed) == rows(started)
    run, steps, audit = rows(claimed)
    assert (run["state"], run["lease_owner"], run["lease_generation"]) == (RunState.RUNNING, "executor-7", 1)
    assert [(a["action"], a["before"], a["after"]) for a in audit] == [
        ("start", {}, {"run": "pending"}),
        ("claim", {"run": "pending"}, {"run": "running", "lease_owner": "executor-7"}),
    ]
    # The lease carries the executor's copy, as a claim's does: no read before the first step.
    assert (own.owner, own.generation, own.taken_over) == (lease.owner, lease.generation, lease.taken_over)
    assert fields(own.seen["run"], RUN_OWN) == run
    assert [fields(s, STEP_OWN) for s in own.seen["steps"].values()] == steps
    assert [s.pk for s in own.seen["steps"].values()] == list(
        claimed.steps.order_by("position").values_list("pk", flat=True)
    )
    call_command("verify_audit", stdout=StringIO())  # start, then claim, chained in that order


def test_a_claimed_start_of_a_repeated_event_claims_nothing(clock, path):
    first, _ = run_start(workflow="test_orders", data=event("seen"))
    events = AuditEvent.objects.count()
    again, lease = run_start_claimed(workflow="test_orders", data=event("seen"), owner="executor-7")
    assert (again.pk, lease) == (first.pk, None)
    assert WorkflowRun.objects.get(pk=first.pk).state == RunState.PENDING
    assert AuditEvent.objects.count() == events
    with pytest.raises(StartConflict):
        run_start_claimed(workflow="test_orders", data={**event("seen"), "text": "travel 10"})


def test_start_and_advance_runs_the_event_to_its_end_with_one_claim(clock, path):
    run, state = executor.start_and_advance(workflow="test_orders", data=event("here"), owner="executor-7")
    assert state == RunState.COMPLETED
    assert receivers.counts() == {"task": 1, "message": 1, "ledger": 1, "model_call": 1}
    actions = list(run.audit_events.order_by("id").values_list("action", flat=True))
    assert actions[:2] == ["start", "claim"] and actions.count("claim") == 1
    call_command("verify_audit", stdout=StringIO())


def test_a_worker_that_dies_after_a_claimed_start_leaves_the_run_to_its_lease(clock, monkeypatch, path):
    """The run is written claimed: nobody else takes it while the lease lives, and once it
    expires another executor takes it over and finishes it, each effect made once."""
    crash_at(
        monkeypatch,
        "create_task:before_call",
        lambda: executor.start_and_advance(workflow="test_orders", data=event("dies"), owner="dying"),
    )
    run = WorkflowRun.objects.get(workflow_id="order:t:dies")
    assert run.lease_owner == "dying"
    assert executor.advance(run.pk, owner="other") is None  # the lease still lives
    clock.advance(3600)
    assert drive(run, clock).state == RunState.COMPLETED
    assert run.audit_events.filter(action="lease_takeover").count() == 1
    assert receivers.counts() == {"task": 1, "message": 1, "ledger": 1, "model_call": 1}


@pytest.mark.django_db(transaction=True)
def test_under_celery_start_run_runs_the_event_without_queueing_an_advance(clock, settings, monkeypatch):
    sent = []
    monkeypatch.setitem(dispatch._senders, "run", sent.append)
    settings.RECOVERY_EXECUTOR = "celery"
    assert tasks.start_run.apply(args=["test_orders", event("celery")]).successful()
    run = WorkflowRun.objects.get(workflow_id="order:t:celery")
    assert run.state == RunState.COMPLETED and sent == []
    assert tasks.start_run.apply(args=["test_orders", event("celery")]).successful()  # redelivered
    assert receivers.counts() == {"task": 1, "message": 1, "ledger": 1, "model_call": 1}
    assert WorkflowRun.objects.count() == 1
