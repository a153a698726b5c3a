"""Local steps (``local=True``): the effect is a write to the engine's own database, made in the
transaction that records the step's outcome. Under every fault of the matrix each step's row
exists exactly once at the end, and a failed or interrupted attempt leaves none."""

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from recovery.engine import failpoints
from recovery.engine.executor import advance
from recovery.engine.transitions import run_start
from recovery.errors import TransientError
from recovery.models import AuditEvent, RunState, StepState
from recovery.testing import fault_matrix
from tests.support.engine import advance_as_dying_workers, drive
from tests.support.models import RemoteObject
from tests.support.workflows import FAST

pytestmark = pytest.mark.django_db(transaction=True)


def local_effects(run) -> dict[str, int]:
    keys = dict(run.steps.values_list("step_name", "idempotency_key"))
    return {name: RemoteObject.objects.filter(kind="local", client_ref=key).count() for name, key in keys.items()}


test_local_fault_matrix = fault_matrix(
    "test_local", event=lambda n: {"tenant": "matrix", "order_id": f"l-{n}"}, effects=local_effects
)


def test_a_crash_after_the_call_rolls_the_effect_back_and_the_next_executor_makes_it_once(clock, monkeypatch):
    run = run_start(workflow="test_local", data={"tenant": "t", "order_id": "1"})[0]
    monkeypatch.setenv("RECOVERY_FAILPOINTS", "reserve:after_call=raise")
    with pytest.raises(failpoints.FailpointRaised):
        advance(run.pk)
    monkeypatch.delenv("RECOVERY_FAILPOINTS")
    assert RemoteObject.objects.filter(kind="local").count() == 0  # the call ran; its transaction did not commit
    reserve = run.steps.get(step_name="reserve")
    assert (reserve.state, reserve.attempts) == (StepState.PENDING, 0)  # nor did the attempt's count
    run.refresh_from_db()
    assert run.state == RunState.RUNNING and run.lease_owner  # held by the lost executor until its lease expires

    run = drive(run, clock)

    assert run.state == RunState.COMPLETED
    assert local_effects(run) == {"reserve": 1, "book": 1}
    reserve = run.steps.get(step_name="reserve")
    assert reserve.attempts == 1 and reserve.remote_ref.startswith("local-")
    # The executor that took the run over counted each attempt before making it.
    actions = list(AuditEvent.objects.filter(run=run).order_by("id").values_list("action", "step_name"))
    assert actions == [
        ("start", ""),
        ("claim", ""),
        ("lease_takeover", ""),
        ("step_begin", "reserve"),
        ("step_succeed", "reserve"),
        ("step_begin", "book"),
        ("step_succeed", "book"),
    ]


def test_a_local_step_commits_its_effect_attempt_and_outcome_once_with_one_audit_event():
    """Rule 5 for a step whose effect is in this database: effect and outcome in one
    transaction, so no intent commit before it is needed: one commit and one audit event."""
    run = run_start(workflow="test_local", data={"tenant": "t", "order_id": "one-commit"})[0]
    with CaptureQueriesContext(connection) as queries:
        assert advance(run.pk) == RunState.COMPLETED
    sql = [q["sql"] for q in queries.captured_queries]
    effect = 'INSERT INTO "support_remoteobject"'
    first = next(i for i, statement in enumerate(sql) if statement.startswith(effect))  # after the claim
    transactions, current = [], []
    for statement in sql[first:]:
        word = statement.split()[0].upper()
        if word == "COMMIT":
            transactions.append(current)
            current = []
        elif word not in ("BEGIN", "SAVEPOINT", "RELEASE"):
            current.append(statement)
    assert len(transactions) == 2 and not current, sql  # one transaction per step, nothing after them
    for statements in transactions:
        assert statements[0].startswith(effect), statements  # the effect, then its checkpoint:
        # one statement on PostgreSQL (run, step, audit event), three or four elsewhere
        assert len(statements) == 2 if connection.vendor == "postgresql" else len(statements) >= 4, statements
    assert local_effects(run) == {"reserve": 1, "book": 1}
    reserve = run.steps.get(step_name="reserve")
    assert (reserve.state, reserve.attempts) == (StepState.SUCCEEDED, 1)
    assert reserve.first_attempt_at is not None and reserve.request_hash
    events = AuditEvent.objects.filter(run=run, step_name="reserve")
    assert [(e.action, e.before["step"], e.after["step"], e.after["attempts"]) for e in events] == [
        ("step_succeed", StepState.PENDING, StepState.SUCCEEDED, 1)
    ]


def test_a_local_step_that_kills_its_worker_every_time_goes_to_review_not_round_forever(clock, monkeypatch):
    """Rule 9: the first attempt is counted only by its own commit, which a crash undoes; every
    attempt after a takeover is counted first, so the budget is met and the run goes to review."""
    monkeypatch.setenv("RECOVERY_FAILPOINTS", "reserve:after_call=raise")
    run = run_start(workflow="test_local", data={"tenant": "t", "order_id": "poison"})[0]
    run = advance_as_dying_workers(run, clock, FAST.maximum_attempts + 3)
    assert run.state == RunState.NEEDS_REVIEW
    assert "without a recorded outcome" in run.status_reason
    assert run.steps.get(step_name="reserve").attempts == FAST.maximum_attempts
    assert RemoteObject.objects.filter(kind="local").count() == 0


def test_a_failed_local_attempt_is_counted_and_retried_within_its_budget(clock, monkeypatch):
    """A local attempt that raised was rolled back (it left nothing, so it is a plain transient
    failure); it is recorded as any failed attempt is, and the retry makes the row once."""
    from tests.support import workflows

    real = workflows.reserve.call
    calls = []

    def flaky(ctx):
        calls.append(1)
        row = real(ctx)
        if len(calls) == 1:
            raise TransientError("lost the answer")  # after writing: the rollback must undo the row
        return row

    monkeypatch.setattr(workflows.reserve, "call", flaky)
    run = drive(run_start(workflow="test_local", data={"tenant": "t", "order_id": "flaky"})[0], clock)
    assert run.state == RunState.COMPLETED
    assert local_effects(run) == {"reserve": 1, "book": 1}
    reserve = run.steps.get(step_name="reserve")
    assert reserve.attempts == 2 and len(calls) == 2
    actions = list(AuditEvent.objects.filter(run=run, step_name="reserve").values_list("action", flat=True))
    assert actions == ["step_begin", "step_fail", "step_succeed"]


def test_a_local_step_cannot_also_declare_another_way_to_reconcile(monkeypatch):
    from recovery import workflow
    from recovery.workflow import Reconcile, Workflow

    monkeypatch.setattr(workflow, "_REGISTRY", dict(workflow._REGISTRY))  # keep the registry as it was
    wf = Workflow("local_bad", version=1, workflow_id=lambda i: "x")
    with pytest.raises(ValueError, match="local step"):
        wf.step(local=True, reconcile=Reconcile.LOOKUP)(lambda ctx: None)
    with pytest.raises(ValueError, match="local step"):
        wf.step(local=True, outbox=True)(lambda ctx: None)
