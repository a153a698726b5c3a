"""Pausing a whole workflow, or one step of it (issue 37): a supervisor's pause keeps new events'
runs pending, stops runs under way before their next attempt (a call in flight is recorded), and
its release lets every run it held go on, each effect made once. Bad input changes nothing."""

from __future__ import annotations

import pytest

from recovery import why
from recovery.engine import executor
from recovery.engine.executor import advance
from recovery.engine.transitions import run_start, run_unpause, workflow_pause, workflow_unpause
from recovery.errors import InvalidTransition, NotPermitted
from recovery.models import RunState, StepState, WorkflowPause, WorkflowRun
from tests.support import receivers
from tests.support.engine import assert_invariants, drive, person

pytestmark = pytest.mark.django_db

NOTHING = {"task": 0, "message": 0, "ledger": 0, "model_call": 0}


def event(order_id: str) -> dict:
    return {"tenant": "t", "order_id": order_id}


def started(order_id: str) -> WorkflowRun:
    return run_start(workflow="test_orders", data=event(order_id))[0]


def steps_of(run: WorkflowRun) -> dict[str, tuple[str, int]]:
    return {s.step_name: (s.state, s.attempts) for s in run.steps.all()}


def actions(run: WorkflowRun) -> list[str]:
    return list(run.audit_events.order_by("id").values_list("action", flat=True))


def test_a_paused_workflow_keeps_new_runs_pending_and_its_release_lets_them_run_once(clock):
    sam = person("sam", "supervisor")
    workflow_pause(workflow="test_orders", actor=sam, reason="ledger outage")
    queued = started("w-1")
    # A process that runs what it starts does not claim it either: it is started pending.
    claimed, lease = executor.transitions.run_start_claimed(workflow="test_orders", data=event("w-2"))
    assert lease is None and claimed.state == RunState.PENDING and not claimed.lease_owner
    for _ in range(3):
        assert advance(queued.pk, owner="test-executor") is None
        assert advance(claimed.pk, owner="test-executor") is None
        clock.advance(600)
    for run in (queued, claimed):
        run.refresh_from_db()
        assert (run.state, run.lease_generation) == (RunState.PENDING, 0)
        assert all(state == StepState.PENDING for state, _ in steps_of(run).values())
    assert receivers.counts() == NOTHING

    released = workflow_unpause(workflow="test_orders", actor=sam, reason="ledger back")
    assert released["released"] == [queued.workflow_id, claimed.workflow_id] and released["due"] == {}
    for run in (queued, claimed):  # kept pending, now due: audited on the run
        unpaused = run.audit_events.get(action="unpause")
        assert (unpaused.actor, unpaused.reason) == ("sam", "workflow test_orders unpaused: ledger back")
    for run in (queued, claimed):
        assert drive(run, clock).state == RunState.COMPLETED
    assert receivers.counts() == {"task": 2, "message": 2, "ledger": 2, "model_call": 2}
    pause = WorkflowPause.objects.get()
    assert (pause.paused_by, pause.reason, pause.released_by, pause.release_reason) == (
        "sam",
        "ledger outage",
        "sam",
        "ledger back",
    )
    assert_invariants()


def test_a_run_under_way_records_its_call_in_flight_and_stops_before_the_next_when_its_workflow_is_paused(
    clock, monkeypatch
):
    """The supervisor pauses the workflow while the executor is inside create_task's call: the
    call's success is recorded, notify is not begun, the run waits as paused, held by the pause;
    its own unpause is refused until the workflow's is released, which lets it go on once."""
    sam, olga = person("sam", "supervisor"), person("olga", "operator")
    run = started("w-3")
    real = receivers.create_task

    def create_task_during_the_incident(**arguments):
        outcome = real(**arguments)  # the receiver commits; meanwhile the supervisor pauses
        workflow_pause(workflow="test_orders", actor=sam, reason="tracker outage")
        return outcome

    monkeypatch.setattr(receivers, "create_task", create_task_during_the_incident)
    advance(run.pk, owner="test-executor")
    monkeypatch.setattr(receivers, "create_task", real)
    run.refresh_from_db()
    steps = steps_of(run)
    assert (run.state, run.lease_owner) == (RunState.PAUSED, "")
    assert steps["create_task"] == (StepState.SUCCEEDED, 1) and steps["notify"] == (StepState.PENDING, 0)
    assert receivers.counts() == {"task": 1, "message": 0, "ledger": 0, "model_call": 1}
    assert run.workflow_pause == WorkflowPause.objects.get()
    sentence = why.why_not_moving(run, list(run.steps.all()), now=clock.now())
    assert sentence.startswith("paused by sam at ") and "workflow test_orders paused: tracker outage" in sentence
    assert actions(run)[-1] == "pause_reached"

    with pytest.raises(InvalidTransition, match="held by the pause of workflow test_orders"):
        run_unpause(workflow_id=run.workflow_id, actor=olga, reason="go on")
    clock.advance(3600)
    assert advance(run.pk, owner="test-executor") is None  # a paused run is not claimed

    released = workflow_unpause(workflow="test_orders", actor=sam, reason="tracker back")
    assert released["released"] == [run.workflow_id]
    run.refresh_from_db()
    assert (run.state, run.workflow_pause_id, run.paused_at) == (RunState.PENDING, None, None)
    unpaused = run.audit_events.filter(action="unpause").get()
    assert (unpaused.actor, unpaused.reason) == ("sam", "workflow test_orders unpaused: tracker back")
    assert drive(run, clock).state == RunState.COMPLETED
    assert receivers.counts() == {"task": 1, "message": 1, "ledger": 1, "model_call": 1}
    assert_invariants()


def test_a_paused_step_lets_runs_go_up_to_it_and_no_further(clock):
    sam = person("sam", "supervisor")
    workflow_pause(workflow="test_orders", step_name="post_entry", actor=sam, reason="ledger outage")
    runs = [started("w-4"), started("w-5")]
    for run in runs:
        run = drive(run, clock)
        steps = steps_of(run)
        assert (
            run.state == RunState.PAUSED and run.pause_reason == "step post_entry of test_orders paused: ledger outage"
        )
        assert steps["notify"] == (StepState.SUCCEEDED, 1) and steps["post_entry"] == (StepState.PENDING, 0)
    assert receivers.counts() == {"task": 2, "message": 2, "ledger": 0, "model_call": 2}

    # Another step's pause is another pause: releasing it releases none of these.
    workflow_pause(workflow="test_orders", step_name="notify", actor=sam, reason="chat outage")
    assert workflow_unpause(workflow="test_orders", step_name="notify", actor=sam, reason="chat back")["released"] == []

    released = workflow_unpause(workflow="test_orders", step_name="post_entry", actor=sam, reason="ledger back")
    assert sorted(released["released"]) == sorted(r.workflow_id for r in runs)
    for run in runs:
        assert drive(run, clock).state == RunState.COMPLETED
    assert receivers.counts() == {"task": 2, "message": 2, "ledger": 2, "model_call": 2}
    assert_invariants()


def test_a_pause_released_before_a_run_reaches_it_holds_nothing(clock):
    sam = person("sam", "supervisor")
    workflow_pause(workflow="test_orders", step_name="post_entry", actor=sam, reason="maybe the ledger")
    workflow_unpause(workflow="test_orders", step_name="post_entry", actor=sam, reason="false alarm")
    assert drive(started("w-6"), clock).state == RunState.COMPLETED
    assert receivers.counts()["ledger"] == 1


@pytest.mark.parametrize(
    ("workflow", "step", "who", "reason", "refusal"),
    [
        ("nope", "", "sam", "outage", "no workflow 'nope' is deployed here"),
        ("test_orders", "nope", "sam", "outage", "workflow test_orders has no step 'nope' (its steps: "),
        ("test_local", "reserve", "sam", "outage", "step reserve of test_local is local"),
        ("test_orders", "", "sam", "   ", "a reason is required"),
        ("test_orders", "", "olga", "outage", "olga (operator) may not pause a workflow: that needs the supervisor"),
        ("test_orders", "notify", "sam", "again", "step notify of test_orders is paused already, by sam at "),
    ],
)
def test_bad_pauses_are_refused_and_change_nothing(workflow, step, who, reason, refusal):
    actors = {"sam": person("sam", "supervisor"), "olga": person("olga", "operator")}
    workflow_pause(workflow="test_orders", step_name="notify", actor=actors["sam"], reason="chat outage")
    before = list(WorkflowPause.objects.values())
    with pytest.raises((InvalidTransition, NotPermitted), match=refusal.replace("(", r"\(").replace(")", r"\)")):
        workflow_pause(workflow=workflow, step_name=step, actor=actors[who], reason=reason)
    assert list(WorkflowPause.objects.values()) == before


def test_unpausing_what_is_not_paused_is_refused_and_changes_nothing():
    sam = person("sam", "supervisor")
    workflow_pause(workflow="test_orders", step_name="notify", actor=sam, reason="chat outage")
    before = list(WorkflowPause.objects.values())
    with pytest.raises(InvalidTransition, match="workflow test_orders is not paused"):
        workflow_unpause(workflow="test_orders", actor=sam, reason="back")
    with pytest.raises(NotPermitted):
        workflow_unpause(workflow="test_orders", step_name="notify", actor=person("olga", "operator"), reason="back")
    assert list(WorkflowPause.objects.values()) == before


def test_the_commands_pause_list_and_unpause_through_the_same_transitions(clock):
    from io import StringIO

    from django.core.management import CommandError, call_command

    person("sam", "supervisor"), person("olga", "operator")
    out = StringIO()
    call_command(
        "pause_workflow", "test_orders", "--step", "post_entry", "--reason", "ledger outage", "--as", "sam", stdout=out
    )
    assert out.getvalue().startswith("paused: step post_entry of test_orders, by sam at ")
    out = StringIO()
    call_command("pause_workflow", "--list", stdout=out)
    assert out.getvalue().startswith("step post_entry of test_orders\tpaused by sam at ")
    assert out.getvalue().endswith(": ledger outage\n")
    run = drive(started("w-7"), clock)
    assert run.state == RunState.PAUSED

    for arguments, refusal in [
        (["pause_workflow", "test_orders", "--step", "post_entry", "--reason", "x", "--as", "sam"], "paused already"),
        (["pause_workflow", "test_orders", "--reason", "x", "--as", "olga"], r"olga \(operator\) may not pause"),
        (["pause_workflow", "test_orders", "--as", "sam"], "--reason is required"),
        (["unpause_workflow", "test_orders", "--reason", "x", "--as", "sam"], "workflow test_orders is not paused"),
        (
            ["unpause_workflow", "test_orders", "--step", "post_entry", "--reason", "x", "--as", "nobody"],
            "no active user",
        ),
    ]:
        before = list(WorkflowPause.objects.values())
        with pytest.raises(CommandError, match=refusal):
            call_command(*arguments)
        assert list(WorkflowPause.objects.values()) == before

    out = StringIO()
    call_command(
        "unpause_workflow", "test_orders", "--step", "post_entry", "--reason", "ledger back", "--as", "sam", stdout=out
    )
    assert (
        out.getvalue()
        == f"unpaused: step post_entry of test_orders; 1 run(s) released at once\n{run.workflow_id}\tdue now\n"
    )
    assert drive(run, clock).state == RunState.COMPLETED
    assert receivers.counts()["ledger"] == 1


def test_the_runs_list_says_which_runs_a_pause_holds_and_keeps_pending_in_one_query(clock, monkeypatch):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from recovery.console.runs_query import RUN_LIST_FIELDS

    sam = person("sam", "supervisor")
    workflow_pause(workflow="test_orders", step_name="post_entry", actor=sam, reason="ledger outage")
    held = drive(started("w-8"), clock)
    workflow_pause(workflow="test_orders", actor=sam, reason="tracker outage too")
    pending = [started("w-9"), started("w-10")]
    rows = list(WorkflowRun.objects.only(*RUN_LIST_FIELDS).filter(pk__in=[held.pk, *(r.pk for r in pending)]))
    monkeypatch.setattr(why.executors, "any_live", lambda now: True)
    with CaptureQueriesContext(connection) as queries:
        why.for_page(rows, now=clock.now())
    said = {row.workflow_id: row.why for row in rows}
    assert said[held.workflow_id].endswith(
        "step post_entry of test_orders paused: ledger outage; it goes on when that pause is released "
        "(nothing new starts meanwhile)"
    )
    for run in pending:
        assert said[run.workflow_id].startswith("kept pending: workflow test_orders paused by sam at ")
        assert said[run.workflow_id].endswith(": tracker outage too; it starts when the workflow is unpaused")
    # the moving runs' steps, their four-eyes requests (a test workflow has some), and the pauses
    # that keep runs pending: none per row
    assert [q["sql"].split('"')[1] for q in queries.captured_queries] == [
        "recovery_stepexecution",
        "recovery_approvalrequest",
        "recovery_workflowpause",
    ]


def test_show_run_wait_returns_for_a_run_kept_pending_by_its_workflows_pause(clock):
    from io import StringIO

    from django.core.management import call_command

    workflow_pause(workflow="test_orders", actor=person("sam"), reason="tracker outage")
    run = started("w-11")
    out = StringIO()
    call_command("show_run", run.workflow_id, "--wait", "600", stdout=out)  # rests: returns at once, exit 0
    assert out.getvalue().split()[1] == "pending"
    assert "kept pending: workflow test_orders paused by sam at " in out.getvalue()
