"""Pausing a run (issue 37): no new attempt starts while it is paused; a call already in flight
finishes and is recorded; timers keep running; unpausing continues where it stopped, and every
effect is made once. Every surface goes through one transition (console, manage.py recover)."""

from __future__ import annotations

from datetime import timedelta
from io import StringIO

import pytest
from django.conf import settings
from django.core.management import CommandError, call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from recovery import counts, why
from recovery.console.runs_query import RUN_LIST_FIELDS
from recovery.engine import executor, failpoints
from recovery.engine.executor import advance
from recovery.engine.transitions import perform, run_pause, run_start, run_unpause, run_version
from recovery.errors import InvalidTransition
from recovery.models import AuditEvent, RunState, StepState, WorkflowRun
from tests.support import receivers, workflows
from tests.support.console import act, confirm, failed_run, login
from tests.support.engine import assert_invariants, drive, person

pytestmark = pytest.mark.django_db

ONE_OF_EACH = {"task": 1, "message": 1, "ledger": 1, "model_call": 1}


def started(order_id: str = "p-1") -> WorkflowRun:
    return run_start(workflow="test_orders", data={"tenant": "t", "order_id": order_id})[0]


def waiting(clock) -> WorkflowRun:
    """create_task failed once (503): the run waits for its retry."""
    receivers.arm("task", "unavailable")
    run = started()
    advance(run.pk, owner="test-executor")
    run.refresh_from_db()
    assert run.state == RunState.WAITING
    return run


def actions(run: WorkflowRun) -> list[str]:
    return list(run.audit_events.order_by("id").values_list("action", flat=True))


def test_a_waiting_run_paused_starts_nothing_until_it_is_unpaused_then_makes_each_effect_once(clock):
    olga = person("olga", "operator")
    run = waiting(clock)
    wake = run.next_wake_at
    run = run_pause(workflow_id=run.workflow_id, actor=olga, reason="tracker outage")
    assert (run.state, run.paused_by, run.pause_reason) == (RunState.PAUSED, "olga", "tracker outage")
    assert why.why_not_moving(run, list(run.steps.all()), now=clock.now()).startswith("paused by olga at ")

    clock.set(wake)  # its retry falls due while it is paused: nothing is attempted
    for _ in range(3):
        assert advance(run.pk, owner="test-executor") is None
        clock.advance(600)
    run.refresh_from_db()
    assert run.state == RunState.PAUSED and receivers.counts() == {**ONE_OF_EACH, "task": 0, "message": 0, "ledger": 0}

    run = run_unpause(workflow_id=run.workflow_id, actor=olga, reason="tracker back")
    assert (run.state, run.paused_at, run.paused_by) == (RunState.PENDING, None, None)
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED and receivers.counts() == ONE_OF_EACH
    assert ["pause", "unpause"] == [a for a in actions(run) if a in ("pause", "unpause")]
    assert_invariants()


def test_a_call_in_flight_when_the_run_is_paused_is_recorded_and_the_next_call_is_not_begun(clock, monkeypatch):
    """The operator pauses while the executor is inside create_task's call (a live lease): the
    call's success is recorded, notify is not begun (its intent would have gone with that
    success's commit), and the run is paused; unpaused, it goes on with one of each."""
    olga = person("olga", "operator")
    run = started()
    real = receivers.create_task
    paused = []

    def create_task_while_paused(**arguments):
        outcome = real(**arguments)  # the receiver commits; meanwhile the operator pauses
        paused.append(run_pause(workflow_id=run.workflow_id, actor=olga, reason="ledger outage"))
        return outcome

    monkeypatch.setattr(receivers, "create_task", create_task_while_paused)
    advance(run.pk, owner="test-executor")
    run.refresh_from_db()
    assert paused and paused[0].state == RunState.RUNNING  # asked for: the executor held the run
    steps = {s.step_name: s for s in run.steps.all()}
    assert run.state == RunState.PAUSED and not run.lease_owner
    assert steps["create_task"].state == StepState.SUCCEEDED and steps["create_task"].remote_ref.startswith("task-")
    assert receivers.counts()["task"] == 1
    assert (steps["notify"].state, steps["notify"].attempts) == (StepState.PENDING, 0)
    assert receivers.counts()["message"] == 0
    assert actions(run)[-3:] == ["pause", "step_succeed", "pause_reached"]

    monkeypatch.setattr(receivers, "create_task", real)
    run = run_unpause(workflow_id=run.workflow_id, actor=olga, reason="ledger back")
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED and receivers.counts() == ONE_OF_EACH
    assert_invariants()


def test_a_pause_asked_for_and_withdrawn_before_it_is_reached_lets_the_executor_go_on(clock, monkeypatch):
    olga = person("olga", "operator")
    run = started()
    real = receivers.create_task

    def create_task_paused_and_unpaused(**arguments):
        outcome = real(**arguments)
        run_pause(workflow_id=run.workflow_id, actor=olga, reason="ledger outage?")
        run_unpause(workflow_id=run.workflow_id, actor=olga, reason="false alarm")
        return outcome

    monkeypatch.setattr(receivers, "create_task", create_task_paused_and_unpaused)
    advance(run.pk, owner="test-executor")
    monkeypatch.setattr(receivers, "create_task", real)
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED and receivers.counts() == ONE_OF_EACH
    assert "pause_reached" not in actions(run)


def test_a_run_whose_call_fails_while_its_pause_is_asked_for_waits_paused_with_its_timer(clock, monkeypatch):
    olga = person("olga", "operator")
    run = started()
    receivers.arm("task", "unavailable")
    real = receivers._before

    def failing_while_paused(kind):
        if kind == "task":
            run_pause(workflow_id=run.workflow_id, actor=olga, reason="tracker flapping")
        return real(kind)

    monkeypatch.setattr(receivers, "_before", failing_while_paused)
    advance(run.pk, owner="test-executor")
    monkeypatch.setattr(receivers, "_before", real)
    run.refresh_from_db()
    task = run.steps.get(step_name="create_task")
    assert run.state == RunState.PAUSED and task.state == StepState.FAILED and task.next_attempt_at is not None
    assert receivers.counts()["task"] == 0
    run = run_unpause(workflow_id=run.workflow_id, actor=olga, reason="stable again")
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED and receivers.counts() == ONE_OF_EACH


def test_what_a_paused_run_refuses_and_what_it_allows(clock):
    olga, sam = person("olga", "operator"), person("sam", "supervisor")
    run = failed_run(clock)
    with pytest.raises(InvalidTransition, match="only a run that moves by itself can be paused"):
        run_pause(workflow_id=run.workflow_id, actor=olga, reason="r")
    with pytest.raises(InvalidTransition, match="is not paused"):
        run_unpause(workflow_id=run.workflow_id, actor=olga, reason="r")

    other = started("p-2")
    run_pause(workflow_id=other.workflow_id, actor=olga, reason="incident 42")
    count = AuditEvent.objects.filter(run=other).count()
    with pytest.raises(InvalidTransition, match="paused by olga at .*: incident 42; unpause it first"):
        perform("resume", workflow_id=other.workflow_id, actor=olga, reason="go")
    with pytest.raises(InvalidTransition, match="unpause it first"):
        run_pause(workflow_id=other.workflow_id, actor=olga, reason="again")
    with pytest.raises(InvalidTransition, match="a reason is required"):
        run_unpause(workflow_id=other.workflow_id, actor=olga, reason=" ")
    assert AuditEvent.objects.filter(run=other).count() == count
    terminated = perform("terminate", workflow_id=other.workflow_id, actor=sam, reason="the order was withdrawn")
    assert terminated.state == RunState.TERMINATED
    assert receivers.counts() == {"task": 0, "message": 0, "ledger": 0, "model_call": 1}  # failed_run's decision


def test_pause_and_unpause_from_the_console_and_manage_py_with_the_same_checks(clock):
    run = started()
    operator = login("operator")
    page = operator.get(reverse("console:run", args=[run.workflow_id])).text
    assert 'data-action="pause"' in page and 'data-action="unpause"' not in page
    assert act(operator, run, "pause", reason=" ").status_code == 400
    done = act(operator, run, "pause", reason="messenger outage")
    assert done.status_code == 200 and "pause recorded" in done.text
    run.refresh_from_db()
    assert run.state == RunState.PAUSED
    page = operator.get(reverse("console:run", args=[run.workflow_id])).text
    assert 'data-action="unpause"' in page and 'data-action="pause"' not in page
    assert "paused by u-operator at " in page
    listed = operator.get(reverse("console:runs"), {"state": "paused"}).text
    assert run.workflow_id in listed
    assert act(login("viewer"), run, "unpause", reason="me").status_code == 403

    person("olga", "operator")
    call_command("recover", "unpause", run.workflow_id, "--reason", "messenger back", "--as", "olga", stdout=StringIO())
    run.refresh_from_db()
    assert run.state == RunState.PENDING
    with pytest.raises(CommandError, match="is not paused"):
        call_command("recover", "unpause", run.workflow_id, "--reason", "x", "--as", "olga", stderr=StringIO())
    assert run_version(run)  # the page's version token still reads the run
    assert drive(run, clock).state == RunState.COMPLETED and receivers.counts() == ONE_OF_EACH
    assert workflows.orders.name == "test_orders"


def test_an_answer_lost_after_commit_while_the_pause_is_asked_is_looked_up_only_after_unpausing(clock, monkeypatch):
    """The ledger commits and the answer is lost while the operator pauses: the step is recorded
    unknown, nothing is looked up or sent while the run is paused, and after unpausing the look-up
    finds the one entry."""
    olga = person("olga", "operator")
    run = started()
    receivers.arm("ledger", "commit_then_drop")
    real = receivers._after

    def answer_lost_while_paused(kind, mode):
        if kind == "ledger":
            run_pause(workflow_id=run.workflow_id, actor=olga, reason="ledger timeouts")
        return real(kind, mode)

    monkeypatch.setattr(receivers, "_after", answer_lost_while_paused)
    advance(run.pk, owner="test-executor")
    monkeypatch.setattr(receivers, "_after", real)
    run.refresh_from_db()
    entry = run.steps.get(step_name="post_entry")
    assert run.state == RunState.PAUSED and entry.state == StepState.UNKNOWN
    clock.advance(3600)
    assert advance(run.pk, owner="test-executor") is None  # a paused run is not claimed
    assert receivers.counts() == ONE_OF_EACH  # the one entry, not looked up or sent again yet
    unknown = counts.stuck_causes(clock.now())["unknown"][1]
    assert not WorkflowRun.objects.filter(unknown, pk=run.pk).exists()  # paused on purpose: no alert for it

    run = drive(run_unpause(workflow_id=run.workflow_id, actor=olga, reason="ledger answers again"), clock)
    assert run.state == RunState.COMPLETED and receivers.counts() == ONE_OF_EACH
    assert run.steps.get(step_name="post_entry").state == StepState.SUCCEEDED
    assert_invariants()


def test_an_executor_that_dies_after_the_pause_was_asked_leaves_it_to_the_next_one_which_pauses(clock, monkeypatch):
    """The executor holding the run dies inside create_task's call after the pause was asked:
    the next executor records the call unknown and pauses before looking it up; after unpausing
    the task is resent under its key and the tracker keeps one."""
    olga = person("olga", "operator")
    run = started()
    real = receivers.create_task

    def dies_after_the_pause(**arguments):
        real(**arguments)
        run_pause(workflow_id=run.workflow_id, actor=olga, reason="tracker outage")
        raise failpoints.FailpointRaised("the worker was killed")

    monkeypatch.setattr(receivers, "create_task", dies_after_the_pause)
    with pytest.raises(failpoints.FailpointRaised):
        advance(run.pk, owner="dying-executor")
    monkeypatch.setattr(receivers, "create_task", real)
    clock.advance(settings.RECOVERY_LEASE_SECONDS + 1)
    advance(run.pk, owner="next-executor")
    run.refresh_from_db()
    assert run.state == RunState.PAUSED and run.steps.get(step_name="create_task").state == StepState.UNKNOWN
    assert actions(run)[-2:] == ["step_unknown", "pause_reached"]

    run = drive(run_unpause(workflow_id=run.workflow_id, actor=olga, reason="tracker back"), clock)
    assert run.state == RunState.COMPLETED and receivers.counts() == ONE_OF_EACH
    assert_invariants()


def test_a_pause_asked_while_a_retry_is_being_built_stops_it_before_it_is_begun(clock, monkeypatch):
    """notify failed once (503) and waits; at its retry the executor builds the intent from its
    copy of the run while the operator pauses: the begin misses its fence, is decided again on
    the run as it is now, and writes the pause instead. No message is sent until unpausing."""
    olga = person("olga", "operator")
    run = started()
    receivers.arm("message", "unavailable")
    advance(run.pk, owner="test-executor")
    run.refresh_from_db()
    assert run.state == RunState.WAITING and receivers.counts()["message"] == 0
    spec = workflows.orders.get_step("notify")
    real = spec.intent_fn

    def intent_while_paused(ctx):
        run_pause(workflow_id=run.workflow_id, actor=olga, reason="messenger outage")
        return real(ctx)

    monkeypatch.setattr(spec, "intent_fn", intent_while_paused)
    clock.set(run.next_wake_at)
    advance(run.pk, owner="test-executor")
    monkeypatch.setattr(spec, "intent_fn", real)
    run.refresh_from_db()
    notify = run.steps.get(step_name="notify")
    assert run.state == RunState.PAUSED and (notify.state, notify.attempts) == (StepState.FAILED, 1)
    assert actions(run)[-2:] == ["pause", "pause_reached"] and receivers.counts()["message"] == 0
    run = drive(run_unpause(workflow_id=run.workflow_id, actor=olga, reason="messenger back"), clock)
    assert run.state == RunState.COMPLETED and receivers.counts() == ONE_OF_EACH


def test_bulk_pause_is_a_dry_run_first_then_pauses_exactly_the_runs_it_listed_and_bulk_unpause_lets_them_go(clock):
    moving = [started(f"bulk-{i}") for i in range(2)]
    stuck = failed_run(clock, "bulk-failed")
    operator = login("operator")
    ids = [r.workflow_id for r in moving] + [stuck.workflow_id]
    events = AuditEvent.objects.count()
    preview = operator.post(reverse("console:bulk"), {"action": "pause", "reason": "ledger outage", "run": ids})
    assert preview.status_code == 200
    assert "<b>2</b> of 3 selected runs would be changed" in preview.text
    assert "only a run that moves by itself can be paused" in preview.text
    assert AuditEvent.objects.count() == events  # a dry run writes nothing

    assert "2 runs changed" in confirm(operator, preview).text
    assert set(WorkflowRun.objects.filter(pk__in=[r.pk for r in moving]).values_list("state", flat=True)) == {"paused"}
    assert WorkflowRun.objects.get(pk=stuck.pk).state == RunState.FAILED
    for run in moving:
        assert advance(run.pk, owner="test-executor") is None

    preview = operator.post(reverse("console:bulk"), {"action": "unpause", "reason": "ledger back", "run": ids})
    assert "2 runs changed" in confirm(operator, preview).text
    for run in moving:
        assert drive(run, clock).state == RunState.COMPLETED
    assert receivers.counts() == {"task": 2, "message": 2, "ledger": 2, "model_call": 3}


def test_a_pause_asked_during_the_last_call_ends_with_the_run_which_completes(clock, monkeypatch):
    """Nothing is left to stop once the last call is recorded: the run completes and the request
    ends with it (no paused completed run, nothing to unpause)."""
    olga = person("olga", "operator")
    run = started()
    real = receivers.post_entry

    def post_entry_while_paused(**arguments):
        outcome = real(**arguments)
        run_pause(workflow_id=run.workflow_id, actor=olga, reason="ledger slow")
        return outcome

    monkeypatch.setattr(receivers, "post_entry", post_entry_while_paused)
    advance(run.pk, owner="test-executor")
    run.refresh_from_db()
    assert (run.state, run.paused_at, run.paused_by, run.pause_reason) == (RunState.COMPLETED, None, None, None)
    assert receivers.counts() == ONE_OF_EACH
    with pytest.raises(InvalidTransition, match="is not paused"):
        run_unpause(workflow_id=run.workflow_id, actor=olga, reason="r")


def test_a_pause_withdrawn_after_the_executor_saw_it_lets_the_executor_go_on(clock, monkeypatch):
    """The executor's copy says the pause was asked (the call's outcome was written with it), and
    the operator unpauses before the executor reaches its boundary: the pause, decided again on
    the run as it is now, writes nothing, and the executor goes on (not an executor error)."""
    olga = person("olga", "operator")
    run = started()
    real_task, real_load = receivers.create_task, executor.load
    asked = []

    def create_task_while_paused(**arguments):
        outcome = real_task(**arguments)
        asked.append(run_pause(workflow_id=run.workflow_id, actor=olga, reason="ledger outage?"))
        return outcome

    def load_then_unpause(lease):
        plan = real_load(lease)
        if asked and plan is not None and plan.run.paused_at is not None:
            run_unpause(workflow_id=run.workflow_id, actor=olga, reason="false alarm")
        return plan

    monkeypatch.setattr(receivers, "create_task", create_task_while_paused)
    monkeypatch.setattr(executor, "load", load_then_unpause)
    advance(run.pk, owner="test-executor")
    monkeypatch.setattr(receivers, "create_task", real_task)
    run = drive(run, clock)
    assert run.state == RunState.COMPLETED and receivers.counts() == ONE_OF_EACH
    assert not AuditEvent.objects.filter(run=run, action="review").exists()
    assert "pause_reached" not in actions(run)


def test_the_runs_list_says_why_a_pausing_run_waits_from_the_fields_it_loads(clock, monkeypatch):
    """A run whose pause was asked while its executor holds it: the list's rows (RUN_LIST_FIELDS)
    hold what its why-sentence names, so saying it costs no query per row."""
    olga = person("olga", "operator")
    run = started()
    WorkflowRun.objects.filter(pk=run.pk).update(
        state=RunState.RUNNING, lease_owner="w1", lease_expires_at=clock.now() + timedelta(minutes=5)
    )
    run_pause(workflow_id=run.workflow_id, actor=olga, reason="ledger outage")
    row = WorkflowRun.objects.only(*RUN_LIST_FIELDS).get(pk=run.pk)
    with CaptureQueriesContext(connection) as queries:
        said = why.why_not_moving(row, [], now=clock.now(), executor_live=True)
    assert said.startswith("pausing, asked by olga at ") and len(queries) == 0
