"""Releasing a workflow's pause without flooding a receiver that is coming back (issue 37): first a
canary of the oldest runs while the pause stays in force for every other, then the rest in waves,
each run due at a random moment of its wave; every effect made once."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from recovery.engine.executor import advance
from recovery.engine.transitions import Waves, run_start, workflow_pause, workflow_unpause
from recovery.errors import InvalidTransition
from recovery.models import RunState, WorkflowPause, WorkflowRun
from tests.support import receivers
from tests.support.engine import assert_invariants, drive, person

pytestmark = pytest.mark.django_db


def started(order_id: str) -> WorkflowRun:
    return run_start(workflow="test_orders", data={"tenant": "t", "order_id": order_id})[0]


def held(n: int, clock, prefix: str = "h") -> list[WorkflowRun]:
    """``n`` runs stopped before post_entry by its pause."""
    runs = [drive(started(f"{prefix}-{i}"), clock) for i in range(n)]
    assert [r.state for r in runs] == [RunState.PAUSED] * n
    return runs


def states(runs: list[WorkflowRun]) -> list[str]:
    return [WorkflowRun.objects.get(pk=r.pk).state for r in runs]


def test_a_canary_goes_first_while_the_pause_holds_the_rest_then_the_rest_go_in_waves(clock):
    sam = person("sam")
    workflow_pause(workflow="test_orders", step_name="post_entry", actor=sam, reason="ledger outage")
    runs = held(5, clock)

    canary = workflow_unpause(workflow="test_orders", step_name="post_entry", actor=sam, reason="try two", canary=2)
    assert canary["canary"] and canary["released"] == [r.workflow_id for r in runs[:2]]
    assert WorkflowPause.objects.get().released_at is None  # still in force for every other run
    assert [drive(r, clock).state for r in runs[:2]] == [RunState.COMPLETED] * 2
    assert receivers.counts()["ledger"] == 2
    clock.advance(600)
    for run in runs[2:]:
        assert advance(run.pk, owner="test-executor") is None  # still held
    late = drive(started("h-late"), clock)  # a new event meanwhile: held like the rest
    assert late.state == RunState.PAUSED and receivers.counts()["ledger"] == 2
    first = runs[0].audit_events.get(action="unpause")
    assert first.after["canary"] is True and first.reason == "canary of step post_entry of test_orders: try two"

    rest = [*runs[2:], late]
    now = clock.now()
    released = workflow_unpause(
        workflow="test_orders",
        step_name="post_entry",
        actor=sam,
        reason="ledger back",
        waves=Waves(size=2, every=timedelta(seconds=60)),
    )
    assert released["released"] == [r.workflow_id for r in rest]  # oldest first
    for index, run in enumerate(rest):
        run.refresh_from_db()
        wave = index // 2
        assert run.state == RunState.PENDING
        assert now + timedelta(seconds=60 * wave) <= run.next_wake_at < now + timedelta(seconds=60 * (wave + 1))
        assert released["due"][run.workflow_id] == run.next_wake_at
        assert run.audit_events.get(action="unpause").after["due_at"] == run.next_wake_at.isoformat()
    # Nothing is claimed before its wave's time; each goes on once it is due.
    for run in rest:
        assert advance(run.pk, owner="test-executor") is None
    assert receivers.counts()["ledger"] == 2
    for run in rest:
        assert drive(run, clock).state == RunState.COMPLETED
    assert receivers.counts() == {"task": 6, "message": 6, "ledger": 6, "model_call": 6}
    assert_invariants()


def test_a_canary_of_a_whole_workflow_takes_the_oldest_runs_it_kept_pending(clock):
    sam = person("sam")
    workflow_pause(workflow="test_orders", actor=sam, reason="tracker outage")
    runs = [started(f"p-{i}") for i in range(3)]
    workflow_unpause(workflow="test_orders", actor=sam, reason="one first", canary=1)
    assert drive(runs[0], clock).state == RunState.COMPLETED
    clock.advance(600)
    assert [advance(r.pk, owner="test-executor") for r in runs[1:]] == [None, None]
    assert states(runs[1:]) == [RunState.PENDING, RunState.PENDING]
    released = workflow_unpause(workflow="test_orders", actor=sam, reason="all back")
    assert released["released"] == [r.workflow_id for r in runs[1:]]
    assert [drive(r, clock).state for r in runs[1:]] == [RunState.COMPLETED] * 2
    assert receivers.counts()["task"] == 3


def test_waves_spread_their_runs_within_each_wave():
    now = datetime(2026, 12, 4, 3, 0, tzinfo=UTC)
    due = Waves(size=3, every=timedelta(seconds=30)).due_times(7, now, random.Random(7))
    offsets = [(d - now).total_seconds() for d in due]
    assert [int(o // 30) for o in offsets] == [0, 0, 0, 1, 1, 1, 2]
    assert len(set(offsets)) == 7  # jitter: not in lockstep
    assert Waves().due_times(3, now) == [None, None, None]
    assert Waves(size=3, every=timedelta(seconds=30)).text(7) == "in 3 waves of 3, 30 s apart"


@pytest.mark.parametrize(
    ("size", "seconds", "refusal"),
    [("x", "60", "whole numbers"), ("0", "60", "at least 1 run a wave"), ("5", "0", "1 to 3600 seconds")],
)
def test_bad_waves_are_refused(size, seconds, refusal):
    with pytest.raises(InvalidTransition, match=refusal):
        Waves.parse(size, seconds)


def test_a_canary_of_a_pause_that_holds_nothing_is_refused():
    sam = person("sam")
    workflow_pause(workflow="test_orders", step_name="notify", actor=sam, reason="chat outage")
    before = list(WorkflowPause.objects.values())
    with pytest.raises(InvalidTransition, match="step notify of test_orders holds no run to release as a canary"):
        workflow_unpause(workflow="test_orders", step_name="notify", actor=sam, reason="x", canary=1)
    assert list(WorkflowPause.objects.values()) == before


def test_bad_releases_are_refused_and_change_nothing(clock):
    sam = person("sam")
    workflow_pause(workflow="test_orders", step_name="post_entry", actor=sam, reason="ledger outage")
    run = held(1, clock)[0]
    before = (list(WorkflowPause.objects.values()), list(WorkflowRun.objects.values("pk", "state", "next_wake_at")))
    for canary, refusal in [(101, "a canary is 1 to 100 runs"), (-1, "a canary is 1 to 100 runs")]:
        with pytest.raises(InvalidTransition, match=refusal):
            workflow_unpause(workflow="test_orders", step_name="post_entry", actor=sam, reason="x", canary=canary)
    for arguments, refusal in [
        (["--canary", "1", "--wave-size", "2", "--wave-seconds", "10"], "--canary or waves, not both"),
        (["--wave-size", "2"], "at least 1 run a wave, and 1 to 3600 seconds"),
    ]:
        with pytest.raises(CommandError, match=refusal):
            call_command(
                "unpause_workflow", "test_orders", "--step", "post_entry", "--reason", "x", "--as", "sam", *arguments
            )
    after = (list(WorkflowPause.objects.values()), list(WorkflowRun.objects.values("pk", "state", "next_wake_at")))
    assert after == before

    out = StringIO()
    call_command(
        "unpause_workflow",
        "test_orders",
        "--step",
        "post_entry",
        "--canary",
        "1",
        "--reason",
        "x",
        "--as",
        "sam",
        stdout=out,
    )
    assert out.getvalue() == (
        f"canary: 1 run(s) of step post_entry of test_orders released; the pause stays in force\n"
        f"{run.workflow_id}\tdue now\n"
    )


def test_a_canary_paused_by_an_operator_is_held_again_by_the_workflows_pause_once_unpaused(clock):
    from recovery import why
    from recovery.engine.transitions import run_pause, run_unpause

    sam, olga = person("sam"), person("olga", "operator")
    workflow_pause(workflow="test_orders", actor=sam, reason="tracker outage")
    runs = [started(f"o-{i}") for i in range(2)]
    workflow_unpause(workflow="test_orders", actor=sam, reason="one first", canary=1)
    canary = WorkflowRun.objects.get(pk=runs[0].pk)
    said = why.why_not_moving(canary, [], now=clock.now(), executor_live=True)
    assert said == "due now: waiting for an executor to claim it"  # a canary is not kept pending
    run_pause(workflow_id=canary.workflow_id, actor=olga, reason="not this one")
    run_unpause(workflow_id=canary.workflow_id, actor=olga, reason="well, go")  # the operator's own pause
    clock.advance(600)
    assert advance(canary.pk, owner="test-executor") is None  # a canary no more: the workflow's pause keeps it
    released = workflow_unpause(workflow="test_orders", actor=sam, reason="all back")
    assert sorted(released["released"]) == sorted(r.workflow_id for r in runs)
    assert [drive(r, clock).state for r in runs] == [RunState.COMPLETED] * 2
