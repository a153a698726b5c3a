"""Moving a run to another version of its workflow (issue 32): allowed only when the target can
continue the run, refused naming the first incompatible step otherwise; audited; checked like
any operator input (the version, the reason, the run's state, the role); and done only when the
run goes forward from it: every test drives the moved run to its end and counts what it made."""

from dataclasses import replace
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from pydantic import Field

from recovery import registry
from recovery.engine import transitions
from recovery.engine.executor import advance
from recovery.engine.transitions import run_start
from recovery.errors import ApprovalRequired, InvalidTransition, NotPermitted
from recovery.models import AuditEvent, RunState, StepState, WorkflowRun
from recovery.workflow import get_workflow, idempotency_key
from tests.support import receivers
from tests.support.engine import assert_invariants, crash_at, drive, person, unfolded
from tests.support.versioned_v1 import versioned_v1
from tests.support.workflows import Decision

pytestmark = pytest.mark.django_db

EVENT = {"tenant": "t1", "order_id": "mv-1"}
ONE_EACH = {"task": 1, "message": 0, "ledger": 1, "model_call": 0}


@pytest.fixture
def supervisor():
    return person("sam", "supervisor")


def start_v1(**event):
    run, _ = run_start(workflow=get_workflow("test_versioned", 1), data={**EVENT, **event})
    return run


def stopped_after_read(clock, monkeypatch, undeploy):
    """A v1 run whose executor died after ``read``, before ``create_task``'s intent (nothing of
    it begun), and whose version then went with a deploy: stranded, running under an expired lease.
    An executor now writes ``create_task``'s intent with ``read``'s outcome (recovery.engine.fold);
    this is the run as one of before that change left it, which a deploy meets."""
    unfolded(monkeypatch)
    run = start_v1()
    crash_at(monkeypatch, "create_task:before_intent", lambda: advance(run.pk))
    clock.advance(60)
    undeploy("test_versioned", 1)
    run.refresh_from_db()
    assert run.state == RunState.RUNNING and run.workflow_version == 1
    return run


def past_create_task(clock):
    """A v1 run waiting to retry its ledger entry, its task made (step 2 of v1, step 3 of v2)."""
    receivers.arm("ledger", "rate_limit")
    run = start_v1()
    advance(run.pk)
    run.refresh_from_db()
    assert run.state == RunState.WAITING and run.steps.get(step_name="create_task").state == StepState.SUCCEEDED
    return run


def move(run, supervisor, version=2, **kwargs):
    return transitions.perform(
        "move_version",
        workflow_id=run.workflow_id,
        actor=supervisor,
        reason=kwargs.pop("reason", "v1 is gone"),
        version=version,
        **kwargs,
    )


def moves(run) -> int:
    return AuditEvent.objects.filter(run=run, action="move_version").count()


def test_a_compatible_move_continues_the_run_on_the_target_version_with_one_object_per_step(
    clock, monkeypatch, undeploy, supervisor
):
    run = stopped_after_read(clock, monkeypatch, undeploy)
    read_key = run.steps.get(step_name="read").idempotency_key

    run = move(run, supervisor)
    assert run.workflow_version == 2 and run.state == RunState.PENDING
    rows = [(s.step_name, s.position, s.state) for s in run.steps.order_by("position")]
    assert rows == [
        ("read", 0, "succeeded"),
        ("check", 1, "pending"),
        ("create_task", 2, "pending"),
        ("post_entry", 3, "pending"),
    ]
    assert run.steps.get(step_name="read").idempotency_key == read_key  # keys never change by a move
    event = AuditEvent.objects.get(run=run, action="move_version")
    assert (event.actor, event.reason) == ("sam", "v1 is gone")
    assert event.before["version"] == 1 and event.after["version"] == 2
    assert event.after["steps_added"] == ["check"]

    run = drive(run, clock)  # the next step: the run goes forward on v2
    assert run.state == RunState.COMPLETED
    assert receivers.counts() == ONE_EACH
    assert [step for step, _ in receivers.CALLS] == ["check"]
    assert_invariants()


def test_a_move_to_a_version_that_cannot_continue_the_run_is_refused_naming_the_step(clock, undeploy, supervisor):
    run = past_create_task(clock)
    before = [(s.step_name, s.position, s.state, s.idempotency_key) for s in run.steps.order_by("position")]
    undeploy("test_versioned", 1)
    with pytest.raises(InvalidTransition, match="create_task is step 2 of this run and step 3 of v2"):
        move(run, supervisor)
    run.refresh_from_db()
    assert run.workflow_version == 1 and run.state == RunState.WAITING and moves(run) == 0
    assert [(s.step_name, s.position, s.state, s.idempotency_key) for s in run.steps.order_by("position")] == before
    assert receivers.counts()["task"] == 1


@pytest.mark.parametrize(
    "version, reason, message",
    [
        (9, "why", "test_versioned v9 is not deployed here"),
        (1, "why", "the run is on v1 already"),
        (None, "why", "needs the version"),
        (2, "  ", "reason"),
    ],
)
def test_bad_input_to_a_move_is_refused_and_changes_nothing(clock, supervisor, version, reason, message):
    run = start_v1()
    with pytest.raises(InvalidTransition, match=message):
        move(run, supervisor, version=version, reason=reason)
    run.refresh_from_db()
    assert run.workflow_version == 1 and moves(run) == 0 and run.steps.count() == 3


def test_a_finished_run_or_one_held_by_an_executor_is_not_moved(clock, supervisor):
    finished = drive(start_v1(), clock)
    with pytest.raises(InvalidTransition, match="a finished run is not moved"):
        move(finished, supervisor)
    assert moves(finished) == 0


def test_only_a_supervisor_moves_a_run(clock):
    run = start_v1()
    with pytest.raises(NotPermitted, match="that needs the supervisor role"):
        move(run, person("olga", "operator"))
    assert WorkflowRun.objects.get(pk=run.pk).workflow_version == 1


def test_a_move_where_the_workflow_asks_for_four_eyes_needs_a_second_supervisor(clock, monkeypatch, supervisor):
    run = start_v1()
    monkeypatch.setattr(get_workflow("test_versioned", 1), "four_eyes", frozenset({"move_version"}))
    with pytest.raises(ApprovalRequired):
        move(run, supervisor)
    request = transitions.approval_request(
        workflow_id=run.workflow_id, action="move_version", actor=supervisor, reason="v1 goes", version=2
    )
    assert request.options == {"version": 2, "effects_stand": False}
    assert WorkflowRun.objects.get(pk=run.pk).workflow_version == 1
    transitions.approval_grant(request_id=request.pk, actor=person("vera", "supervisor"), reason="checked")
    run.refresh_from_db()
    assert run.workflow_version == 2 and moves(run) == 1
    assert drive(run, clock).state == RunState.COMPLETED and receivers.counts() == ONE_EACH


def _with_new_key_for_create_task(monkeypatch) -> None:
    """Register a v3 whose create_task is a changed business action (key version 2)."""
    monkeypatch.setitem(registry._REGISTRY, "test_versioned", dict(registry._REGISTRY["test_versioned"]))
    v3 = get_workflow("test_versioned").derive(version=3)  # registered in the test's copy of the registry
    v3.steps[2] = replace(v3.steps[2], key_version=2)


def test_an_effect_made_under_a_key_the_target_changes_stands_only_when_the_operator_says_so(
    clock, monkeypatch, supervisor
):
    receivers.arm("ledger", "rate_limit")
    run, _ = run_start(workflow="test_versioned", data=EVENT)  # v2
    advance(run.pk)
    _with_new_key_for_create_task(monkeypatch)
    task = run.steps.get(step_name="create_task")
    with pytest.raises(InvalidTransition, match=f"create_task: {task.remote_ref}.*say whether that effect stands"):
        move(run, supervisor, version=3)
    assert WorkflowRun.objects.get(pk=run.pk).workflow_version == 2

    run = move(run, supervisor, version=3, effects_stand=True)
    kept = run.steps.get(step_name="create_task")
    assert (kept.key_version, kept.idempotency_key, kept.remote_ref) == (1, task.idempotency_key, task.remote_ref)
    event = AuditEvent.objects.get(run=run, action="move_version")
    assert event.after["effects_stand"] == [
        {"step": "create_task", "remote_ref": task.remote_ref, "key_version": 1, "to": 2}
    ]
    assert drive(run, clock).state == RunState.COMPLETED
    assert receivers.counts() == ONE_EACH  # the task was not made again under the new key


def test_a_step_not_begun_takes_the_target_key_version_on_a_move(clock, monkeypatch, undeploy, supervisor):
    run, _ = run_start(workflow="test_versioned", data=EVENT)  # v2, nothing begun
    _with_new_key_for_create_task(monkeypatch)
    run = move(run, supervisor, version=3)
    step = run.steps.get(step_name="create_task")
    assert (step.key_version, step.idempotency_key) == (2, idempotency_key(run.workflow_id, "create_task", 2))
    assert AuditEvent.objects.get(run=run, action="move_version").after["keys_changed"] == ["create_task"]
    assert drive(run, clock).state == RunState.COMPLETED and receivers.counts() == ONE_EACH


# --- manage.py recover move_version ----------------------------------------------------------


def recover(*args) -> str:
    out = StringIO()
    call_command("recover", "move_version", *args, stdout=out, stderr=StringIO())
    return out.getvalue().strip()


def test_recover_move_version_dry_run_says_what_a_move_would_do_and_writes_nothing(
    clock, monkeypatch, undeploy, supervisor
):
    stranded = stopped_after_read(clock, monkeypatch, undeploy)
    said = recover(stranded.workflow_id, "--to-version", "2", "--dry-run", "--reason", "check", "--as", "sam")
    assert said == f"{stranded.workflow_id}: can move to v2 (adds check)"
    assert moves(stranded) == 0 and WorkflowRun.objects.get(pk=stranded.pk).workflow_version == 1


def test_recover_move_version_moves_and_refuses_in_one_line(clock, monkeypatch, undeploy, supervisor):
    run = past_create_task(clock)
    said = recover(run.workflow_id, "--to-version", "2", "--dry-run", "--reason", "check", "--as", "sam")
    assert said == (
        f"{run.workflow_id}: cannot move to v2: create_task is step 2 of this run and step 3 of v2: "
        "the steps before it differ"
    )
    with pytest.raises(CommandError, match="create_task is step 2"):
        recover(run.workflow_id, "--to-version", "2", "--reason", "v1 goes", "--as", "sam")
    with pytest.raises(CommandError, match="give the version as a whole number"):
        recover(run.workflow_id, "--to-version", "two", "--reason", "v1 goes", "--as", "sam")
    with pytest.raises(CommandError, match="--dry-run is for move_version"):
        call_command("recover", "resume", run.workflow_id, "--dry-run", "--reason", "x", "--as", "sam")
    assert moves(run) == 0

    fresh = start_v1(order_id="mv-2")
    assert recover(fresh.workflow_id, "--to-version", "2", "--reason", "v1 goes", "--as", "sam") == (
        f"move_version: {fresh.workflow_id} is now pending"
    )
    assert WorkflowRun.objects.get(pk=fresh.pk).workflow_version == 2
    assert AuditEvent.objects.get(run=fresh, action="move_version").after["version"] == 2


# --- the fault matrix, with a deploy in the middle ---------------------------------------------

BOUNDARIES = ("before_intent", "before_call", "after_call", "after_outcome")


@pytest.mark.parametrize("step", ["read", "create_task", "post_entry"])
@pytest.mark.parametrize("boundary", BOUNDARIES)
def test_a_v1_run_crashed_anywhere_then_stranded_by_a_deploy_ends_with_one_object_per_step(
    clock, monkeypatch, undeploy, supervisor, step, boundary
):
    """The executor dies at STEP:BOUNDARY, then v1 goes with a deploy. Whatever the crash left,
    the supervisor's move either continues the run on v2 or is refused naming the step that
    stops it (then v1 comes back); either way the run completes with one task and one ledger
    entry, the check made at most once, and it was never sent to review."""
    run = start_v1()
    crash_at(monkeypatch, f"{step}:{boundary}", lambda: advance(run.pk))
    clock.advance(60)  # the dead executor's lease expires
    undeploy("test_versioned", 1)
    run.refresh_from_db()
    begun = run.steps.get(step_name="create_task")
    movable = begun.state == StepState.PENDING and begun.attempts == 0
    if run.state == RunState.COMPLETED:  # the last outcome finished the run: nothing is stranded
        with pytest.raises(InvalidTransition, match="a finished run is not moved"):
            move(run, supervisor)
    elif movable:
        run = move(run, supervisor)
        assert run.workflow_version == 2
    else:
        with pytest.raises(InvalidTransition, match="create_task is step 2 of this run and step 3 of v2"):
            move(run, supervisor)
        registry._REGISTRY["test_versioned"][1] = versioned_v1  # v1 deployed again: the way out
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    assert receivers.counts() == ONE_EACH
    assert len(receivers.CALLS) == (1 if movable else 0)
    assert not AuditEvent.objects.filter(run=run, action="review").exists()
    assert_invariants()


# --- a decision under an older schema --------------------------------------------------------


class DecisionV2(Decision):
    currency: str = Field(pattern="^[A-Z]{3}$")


def _orders_v2(monkeypatch, *, migrate: bool):
    """test_orders v2: its model step's schema gained a currency (schema v2), with or without a
    declared migration of decisions accepted under v1."""
    monkeypatch.setitem(registry._REGISTRY, "test_orders", dict(registry._REGISTRY["test_orders"]))
    v2 = get_workflow("test_orders").derive(version=2)
    migrations = {1: lambda d: {**d, "currency": "EUR"}} if migrate else {}
    v2.steps[1] = replace(v2.steps[1], decision_schema=DecisionV2, schema_version=2, decision_migrations=migrations)
    return v2


def decided_then_crashed(clock, monkeypatch):
    run, _ = run_start(workflow="test_orders", data={"tenant": "t", "order_id": "dm-1"})
    crash_at(monkeypatch, "create_task:before_intent", lambda: advance(run.pk))
    clock.advance(60)
    return run


def test_a_move_migrates_an_accepted_decision_through_the_migration_the_target_declares(clock, monkeypatch, supervisor):
    run = decided_then_crashed(clock, monkeypatch)
    _orders_v2(monkeypatch, migrate=True)
    said = recover(run.workflow_id, "--to-version", "2", "--dry-run", "--reason", "x", "--as", "sam")
    assert said.endswith("can move to v2 (migrates the decision of decide)")

    run = move(run, supervisor)
    decisions = run.decisions.exclude(state="invalid").order_by("version")
    assert [(d.version, d.state, d.schema_version) for d in decisions] == [(1, "superseded", 1), (2, "accepted", 2)]
    assert decisions[1].accepted == {**decisions[0].accepted, "currency": "EUR"}
    assert decisions[0].superseded_reason == "migrated to schema v2 by a move to v2: v1 is gone"
    assert run.steps.get(step_name="decide").result["currency"] == "EUR"
    assert AuditEvent.objects.get(run=run, action="move_version").after["decisions_migrated"] == ["decide"]

    run = drive(run, clock)
    assert run.state == RunState.COMPLETED
    assert receivers.counts() == {"task": 1, "message": 1, "ledger": 1, "model_call": 1}  # not asked again


def test_a_decision_under_an_older_schema_with_no_migration_refuses_the_move(clock, monkeypatch, supervisor):
    run = decided_then_crashed(clock, monkeypatch)
    _orders_v2(monkeypatch, migrate=False)
    with pytest.raises(
        InvalidTransition,
        match="decide's accepted decision was made under schema v1; v2 declares DecisionV2 v2 and no migration from v1",
    ):
        move(run, supervisor)
    assert WorkflowRun.objects.get(pk=run.pk).workflow_version == 1 and moves(run) == 0
