"""Local steps (``local=True``): the effect is a write to the engine's own database, made in the
transaction that records the step's outcome. Under every fault of the matrix each step's row
exists exactly once at the end, and a failed or interrupted attempt leaves none."""

import threading

import pytest
from django.db import connection, transaction
from django.db.models import F
from django.test.utils import CaptureQueriesContext

from recovery.engine import failpoints
from recovery.engine.audit.chain import stored_chains, verify
from recovery.engine.executor import advance
from recovery.engine.transitions import run_start, run_terminate
from recovery.errors import TransientError
from recovery.models import AuditEvent, RunState, StepState, WorkflowRun
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


EFFECT = 'INSERT INTO "support_remoteobject"'


def transactions_after_the_claim(run) -> list[list[str]]:
    """Advance ``run`` to completion; the statements of each transaction from the first effect on."""
    with CaptureQueriesContext(connection) as queries:
        assert advance(run.pk) == RunState.COMPLETED
    sql = [q["sql"] for q in queries.captured_queries]
    first = next(i for i, statement in enumerate(sql) if statement.startswith(EFFECT))  # after the claim
    transactions, current = [], []
    for statement in sql[first:]:
        word = statement.split()[0].upper()
        if word == "COMMIT":
            transactions.append(current)
            current = []
        elif word not in ("BEGIN", "SAVEPOINT", "RELEASE"):
            current.append(statement)
    assert not current, sql  # nothing outside a transaction after the effects
    return transactions


def test_consecutive_local_steps_commit_their_effects_attempts_and_outcomes_once_with_one_audit_event_each():
    """Rule 5 for steps whose effect is in this database: effect and outcome in one transaction,
    so no intent commit before it is needed; and the local steps that follow each other share
    that transaction: one commit for both steps, one audit event each."""
    run = run_start(workflow="test_local", data={"tenant": "t", "order_id": "one-commit"})[0]
    transactions = transactions_after_the_claim(run)
    assert len(transactions) == 1, transactions  # one transaction for both steps, nothing after it
    (statements,) = transactions
    effects = [i for i, statement in enumerate(statements) if statement.startswith(EFFECT)]
    assert effects == [0, 1], statements  # both effects, then both checkpoints as one write
    if connection.vendor == "postgresql":  # one statement: the run, both steps, both events
        assert len(statements) == 3, statements
        assert "WITH fenced AS" in statements[2] and statements[2].count("INSERT INTO") == 1, statements
    else:  # the fenced UPDATE of the run, each step's UPDATE, each event's INSERT
        verbs = [statement.split()[0] for statement in statements[2:]]
        assert verbs == ["UPDATE", "UPDATE", "UPDATE", "INSERT", "INSERT"], statements
        assert '"revision" = ' in statements[2].split("WHERE")[1], statements
    assert local_effects(run) == {"reserve": 1, "book": 1}
    assert verify(stored_chains(run=run.workflow_id)).broken_runs == 0
    for name in ("reserve", "book"):
        step = run.steps.get(step_name=name)
        assert (step.state, step.attempts) == (StepState.SUCCEEDED, 1)
        assert step.first_attempt_at is not None and step.request_hash
        events = AuditEvent.objects.filter(run=run, step_name=name)
        assert [(e.action, e.before["step"], e.after["step"], e.after["attempts"]) for e in events] == [
            ("step_succeed", StepState.PENDING, StepState.SUCCEEDED, 1)
        ]


def test_a_group_of_local_steps_stops_at_its_limit(monkeypatch):
    from recovery.engine import local_steps

    monkeypatch.setattr(local_steps, "MAX_LOCAL_GROUP", 1)
    run = run_start(workflow="test_local", data={"tenant": "t", "order_id": "limit"})[0]
    transactions = transactions_after_the_claim(run)
    assert [sum(s.startswith(EFFECT) for s in statements) for statements in transactions] == [1, 1]
    assert local_effects(run) == {"reserve": 1, "book": 1}


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
    from recovery import registry
    from recovery.workflow import Reconcile, Workflow

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))  # keep the registry as it was
    wf = Workflow("local_bad", version=1, workflow_id=lambda i: "x")
    with pytest.raises(ValueError, match="local step"):
        wf.step(local=True, reconcile=Reconcile.LOOKUP)(lambda ctx: None)
    with pytest.raises(ValueError, match="local step"):
        wf.step(local=True, outbox=True)(lambda ctx: None)


def test_a_failing_follower_rolls_its_group_back_and_only_its_own_failure_is_recorded(clock, monkeypatch):
    """book fails after writing, inside the transaction it shares with reserve: both rows are
    rolled back; reserve is made again in a transaction of its own (one row, one attempt, one
    audit event), book's attempt is recorded as failed and retried later, not at once."""
    from tests.support import workflows

    calls = {"reserve": 0, "book": 0}
    real_reserve, real_book = workflows.reserve.call, workflows.book.call

    def counted_reserve(ctx):
        calls["reserve"] += 1
        return real_reserve(ctx)

    def flaky_book(ctx):
        calls["book"] += 1
        row = real_book(ctx)
        if calls["book"] == 1:
            raise TransientError("lost the answer")  # after writing: the group's rollback must undo the row
        return row

    monkeypatch.setattr(workflows.reserve, "call", counted_reserve)
    monkeypatch.setattr(workflows.book, "call", flaky_book)
    run = run_start(workflow="test_local", data={"tenant": "t", "order_id": "follower"})[0]

    assert advance(run.pk) == RunState.WAITING
    assert calls == {"reserve": 2, "book": 1}  # reserve made again after the rollback; book not at once
    assert local_effects(run) == {"reserve": 1, "book": 0}
    reserve, book = run.steps.get(step_name="reserve"), run.steps.get(step_name="book")
    assert (reserve.state, reserve.attempts) == (StepState.SUCCEEDED, 1)
    assert (book.state, book.attempts, book.last_error_kind) == (StepState.FAILED, 1, "transient")
    assert book.next_attempt_at is not None and "lost the answer" in book.last_error

    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    assert calls == {"reserve": 2, "book": 2}
    assert local_effects(run) == {"reserve": 1, "book": 1}
    actions = list(AuditEvent.objects.filter(run=run).exclude(step_name="").values_list("action", "step_name"))
    assert actions == [
        ("step_succeed", "reserve"),
        ("step_begin", "book"),
        ("step_fail", "book"),
        ("step_succeed", "book"),
    ]


def test_a_crash_inside_a_group_of_local_steps_leaves_none_of_them_made(clock, monkeypatch):
    """The worker dies before book, after reserve was made in the same transaction: nothing was
    committed, reserve included, and the executor that takes the run over makes each once."""
    monkeypatch.setenv("RECOVERY_FAILPOINTS", "book:before_intent=raise")
    run = run_start(workflow="test_local", data={"tenant": "t", "order_id": "group-crash"})[0]
    with pytest.raises(failpoints.FailpointRaised):
        advance(run.pk)
    monkeypatch.delenv("RECOVERY_FAILPOINTS")
    assert RemoteObject.objects.filter(kind="local").count() == 0
    assert [(s.state, s.attempts) for s in run.steps.order_by("position")] == [(StepState.PENDING, 0)] * 2
    assert not AuditEvent.objects.filter(run=run).exclude(step_name="").exists()

    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    assert local_effects(run) == {"reserve": 1, "book": 1}


def test_a_follower_whose_intent_cannot_be_built_fails_alone_and_the_step_before_it_is_kept(clock, monkeypatch):
    """book's intent raises inside the group: the group is rolled back, reserve is made again
    and kept (one row), book fails permanently without an attempt (nothing was sent)."""
    from tests.support import workflows

    def broken(ctx):
        raise KeyError("amount")

    monkeypatch.setattr(workflows.book, "intent_fn", broken)
    run = run_start(workflow="test_local", data={"tenant": "t", "order_id": "bad-intent"})[0]
    assert advance(run.pk) == RunState.FAILED
    assert local_effects(run) == {"reserve": 1, "book": 0}
    reserve, book = run.steps.get(step_name="reserve"), run.steps.get(step_name="book")
    assert (reserve.state, reserve.attempts) == (StepState.SUCCEEDED, 1)
    assert (book.state, book.attempts, book.last_error_kind) == (StepState.FAILED, 0, "permanent")
    assert "could not build the step's intent" in book.last_error
    actions = list(AuditEvent.objects.filter(run=run).exclude(step_name="").values_list("action", "step_name"))
    assert actions == [("step_succeed", "reserve"), ("step_fail", "book")]


def while_book_runs(run, change) -> list[str]:
    """Advance ``run``; as book's effect is about to be written (reserve's made, in the same
    transaction), ``change(run)`` runs and commits on another connection, as another process
    would. Returns the statements. ``lock_timeout``: a change that would wait for the group's
    transaction fails instead (that would be a deadlock here: this thread waits for it)."""
    sql = []

    def other_process():
        try:
            with transaction.atomic():
                with connection.cursor() as cursor:
                    cursor.execute("SET LOCAL lock_timeout = '2s'")
                change(run)
        finally:
            connection.close()

    def wrapper(execute, statement, params, many, context):
        sql.append(statement)
        if statement.startswith(EFFECT) and sum(s.startswith(EFFECT) for s in sql) == 2:
            thread = threading.Thread(target=other_process)
            thread.start()
            thread.join()
        return execute(statement, params, many, context)

    with connection.execute_wrapper(wrapper):
        advance(run.pk)
    return sql


@pytest.mark.usefixtures("postgres_only")
def test_an_operator_who_terminates_the_run_while_its_local_group_runs_wins_and_nothing_of_the_group_is_made():
    """The group's checkpoints are written at its end, as one fenced statement: an operator's
    terminate that commits meanwhile makes it match nothing, and the group rolls back whole."""
    run = run_start(workflow="test_local", data={"tenant": "t", "order_id": "terminated"})[0]

    def terminate(run):
        run_terminate(workflow_id=run.workflow_id, actor=None, reason="duplicate order")

    while_book_runs(run, terminate)

    run.refresh_from_db()
    assert run.state == RunState.TERMINATED
    assert local_effects(run) == {"reserve": 0, "book": 0}
    assert [(s.state, s.attempts) for s in run.steps.order_by("position")] == [(StepState.PENDING, 0)] * 2
    actions = list(AuditEvent.objects.filter(run=run).order_by("id").values_list("action", flat=True))
    assert actions == ["start", "claim", "terminate"]
    assert verify(stored_chains(run=run.workflow_id)).broken_runs == 0


@pytest.mark.usefixtures("postgres_only")
def test_a_local_group_whose_run_was_saved_meanwhile_is_rolled_back_and_made_again_once_on_fresh_rows():
    """Someone saves the run (its revision moves) while its local group runs, lease untouched:
    the group's statement matches nothing, everything of it rolls back, and the executor makes
    the group again on the rows as they are now: each effect, attempt and event once."""
    run = run_start(workflow="test_local", data={"tenant": "t", "order_id": "saved-meanwhile"})[0]

    def save(run):
        WorkflowRun.objects.filter(pk=run.pk).update(revision=F("revision") + 1)

    sql = while_book_runs(run, save)

    assert sum(s.startswith(EFFECT) for s in sql) == 4  # the group twice: rolled back once
    run.refresh_from_db()
    assert run.state == RunState.COMPLETED
    assert local_effects(run) == {"reserve": 1, "book": 1}
    assert [(s.state, s.attempts) for s in run.steps.order_by("position")] == [(StepState.SUCCEEDED, 1)] * 2
    actions = list(AuditEvent.objects.filter(run=run).order_by("id").values_list("action", "step_name"))
    assert actions == [
        ("start", ""),
        ("claim", ""),
        ("step_succeed", "reserve"),
        ("step_succeed", "book"),  # the run completed with it
    ]
    assert verify(stored_chains(run=run.workflow_id)).broken_runs == 0
