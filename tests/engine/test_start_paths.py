"""One start, two paths: PostgreSQL starts a run in one statement (storage.start: the run, its
steps and its start event, one round trip), every database can start it in a transaction of
three. Here twin events are started on both paths and the rows they leave are compared field
by field (also for workflows of one step and of many, with every kind of step column filled in:
the one statement writes the steps from a JSON document); a repeated event writes nothing on
either, and the engine's start saves no version of the run (the start event says who started
it). The one statement stays small enough for psycopg to convert it once, whatever the number
of steps. A start claimed by the executor that will run
it (``run_start_claimed``) leaves exactly the rows of a start followed by a claim."""

from contextlib import contextmanager
from datetime import UTC, datetime, timedelta, timezone
from io import StringIO
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext
from psycopg import _queries

from recovery import tasks
from recovery.engine import dispatch, executor, storage
from recovery.engine.transitions import run_claim, run_start, run_start_claimed, runs
from recovery.errors import StartConflict
from recovery.models import AuditEvent, RunSearch, RunState, StepExecution, WorkflowRun
from recovery.registry import _REGISTRY
from recovery.workflow import Workflow
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


@pytest.fixture
def scratch():
    """Workflows of ``n`` steps, dropped from the registry afterwards."""
    made = []

    def make(n: int) -> Workflow:
        wf = Workflow(f"scratch_start_{n}", version=1, workflow_id=lambda i, n=n: f"scratch{n}:{i['order_id']}")
        for index in range(n):
            wf.step(name=f"step_{index}")(lambda ctx: None)
        made.append(wf.name)
        return wf

    yield make
    for name in made:
        _REGISTRY.pop(name, None)


def filled(new_steps):
    """``runs._new_steps``, with every kind of column a step has filled in: nested JSON with
    non-ASCII text, a JSON field left None and one holding a JSON string, datetimes with
    microseconds (one not in UTC), booleans, a long text."""
    at = datetime(2031, 5, 6, 7, 8, 9, 123456, tzinfo=UTC)

    def steps(wf, run, now):
        made = new_steps(wf, run, now)
        for index, step in enumerate(made):
            step.intent = {"größe": [1, 2.5, None, {"ключ": "値 ✓"}], "empty": {}, "index": index}
            step.result = None if index % 2 else "just a string"
            step.refusal = {"rule": "limit", "values": {"amount": 10**20, "flag": True}}
            step.overrides = [{"rule": "limit", "by": "ann", "at": "2031-05-06T07:08:09.000001+00:00"}]
            step.compensation_result = [] if index % 2 else None
            step.compensation_restored = bool(index % 2)
            step.first_attempt_at = at + timedelta(microseconds=index)
            step.next_attempt_at = (at + timedelta(seconds=1)).astimezone(timezone(timedelta(hours=5, minutes=30)))
            step.last_error = "é" * 5000
            step.attempts, step.reconcile_attempts = 3, index
        return made

    return steps


@pytest.mark.parametrize("n", [1, 2, 12])
def test_both_start_paths_leave_the_same_rows_whatever_the_steps(postgresql, clock, monkeypatch, scratch, n):
    wf = scratch(n)
    monkeypatch.setattr(runs, "_new_steps", filled(runs._new_steps))
    one, created = run_start(workflow=wf, data={"order_id": "twin-a"})
    assert created
    monkeypatch.setattr(runs, "_insert_in_one_statement", runs._insert_in_transaction)
    other, created = run_start(workflow=wf, data={"order_id": "twin-b"})
    assert created

    assert rows(one) == rows(other)
    _, steps, _ = rows(one)
    assert [s["step_name"] for s in steps] == [f"step_{index}" for index in range(n)]
    assert steps[0]["first_attempt_at"].microsecond == 123456
    assert steps[0]["intent"]["größe"][3] == {"ключ": "値 ✓"} and steps[0]["result"] == "just a string"
    # A JSON field's None is SQL NULL on both paths, not JSON null.
    assert StepExecution.objects.filter(run__in=[one, other], result__isnull=True).count() == 2 * (n // 2)
    assert StepExecution.objects.filter(run__in=[one, other], compensation_result__isnull=True).count() == 2 * (
        n - n // 2
    )


def test_a_step_value_without_a_json_form_is_refused(postgresql, clock, monkeypatch, scratch):
    def naive(new_steps):
        def steps(wf, run, now):
            made = new_steps(wf, run, now)
            made[0].first_attempt_at = datetime(2031, 5, 6, 7, 8, 9)
            return made

        return steps

    monkeypatch.setattr(runs, "_new_steps", naive(runs._new_steps))
    with pytest.raises(TypeError, match="StepExecution.first_attempt_at: no JSON form"):
        run_start(workflow=scratch(1), data={"order_id": "naive"})
    assert not WorkflowRun.objects.exists()


@pytest.mark.parametrize("claimed", [False, True])
def test_psycopg_converts_the_start_statement_once_whatever_the_steps(postgresql, clock, monkeypatch, scratch, claimed):
    """At most 50 parameters and 4096 bytes: psycopg caches its conversion of the statement
    (psycopg._queries) instead of parsing it again at every start; with one audit event (a start)
    or two (a claimed start), and the same text for every number of steps."""
    seen, uncached = [], []
    cursor = storage._cursor

    @contextmanager
    def recording(connection):
        with cursor(connection) as real:
            yield _Recording(real, seen)

    monkeypatch.setattr(storage, "_cursor", recording)
    for name in ("_query2pg_nocache", "_query2pg_client_nocache"):
        convert = getattr(_queries, name)
        monkeypatch.setattr(_queries, name, lambda *args, convert=convert: uncached.append(args) or convert(*args))
    start = run_start_claimed if claimed else run_start
    for n in (1, 3, 12):
        start(workflow=scratch(n), data={"order_id": "cached"})

    assert len(seen) == 3 and len({sql for sql, _ in seen}) == 1
    sql, params = seen[0]
    assert len(sql.encode()) <= _queries.MAX_CACHED_STATEMENT_LENGTH
    assert params <= _queries.MAX_CACHED_STATEMENT_PARAMS
    assert uncached == []


class _Recording:
    """A cursor that records each statement and its number of parameters, then runs it."""

    def __init__(self, cursor, seen):
        self.cursor, self.seen = cursor, seen

    def execute(self, sql, params):
        self.seen.append((sql, len(params)))
        return self.cursor.execute(sql, params)

    def fetchall(self):
        return self.cursor.fetchall()


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
