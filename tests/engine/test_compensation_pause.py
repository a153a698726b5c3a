"""Pausing a run while it compensates (issue 37): compensations are calls to the same receivers,
so a pause stops them too. An operator's pause of a compensating run stops it before its next
compensation is sent (at once if nobody holds it; once the one in flight is recorded if an
executor does); a supervisor's pause of a step holds that step's compensation. Unpausing goes on
compensating — never forward — and every effect is undone once."""

from __future__ import annotations

import pytest

from recovery.engine import failpoints
from recovery.engine.executor import advance
from recovery.engine.transitions import (
    run_compensate,
    run_pause,
    run_start,
    run_unpause,
    workflow_pause,
    workflow_unpause,
)
from recovery.models import AuditEvent, RunState, StepState, WorkflowPause, WorkflowRun
from tests.support import receivers
from tests.support.engine import assert_invariants, drive, person

pytestmark = pytest.mark.django_db

UNDONE = {"task_cancel": 1, "correction": 1, "reversal": 0}
NONE_UNDONE = {"task_cancel": 0, "correction": 0, "reversal": 0}


def compensating(clock, order_id: str) -> WorkflowRun:
    """The task and the message exist, the ledger refused for good; a supervisor compensates."""
    receivers.arm("ledger", "forbidden")
    run = drive(run_start(workflow="test_orders", data={"tenant": "t", "order_id": order_id})[0], clock)
    assert run.state == RunState.FAILED
    run_compensate(workflow_id=run.workflow_id, actor=person(f"sam-{order_id}"), reason="vendor blocked")
    run.refresh_from_db()
    assert run.state == RunState.COMPENSATING
    return run


def states(run: WorkflowRun) -> dict[str, str]:
    return {s.step_name: s.state for s in run.steps.filter(step_name__in=["create_task", "notify"])}


def test_a_compensating_run_nobody_holds_is_paused_at_once_and_goes_on_compensating_when_unpaused(clock):
    olga = person("olga", "operator")
    run = compensating(clock, "c-1")
    run_pause(workflow_id=run.workflow_id, actor=olga, reason="messenger outage")
    run.refresh_from_db()
    assert run.state == RunState.PAUSED and run.status_reason.startswith("paused by olga at ")
    assert advance(run.pk) is None and receivers.compensations() == NONE_UNDONE

    run_unpause(workflow_id=run.workflow_id, actor=olga, reason="messenger back")
    run.refresh_from_db()
    assert run.state == RunState.COMPENSATING  # not forward: its effects are still being undone
    run = drive(run, clock)
    assert run.state == RunState.COMPENSATED and receivers.compensations() == UNDONE
    assert receivers.counts()["ledger"] == 0
    assert_invariants()


def test_a_pause_asked_while_a_compensation_is_in_flight_records_it_and_sends_no_next_one(clock, monkeypatch):
    olga = person("olga", "operator")
    run = compensating(clock, "c-2")
    asked = []

    def pause_in_flight(name: str, at: str) -> None:
        if (name, at) == ("notify.compensate", "after_call") and not asked:
            asked.append(True)  # the correction is sent; its answer not recorded yet
            run_pause(workflow_id=run.workflow_id, actor=olga, reason="tracker outage")

    monkeypatch.setattr(failpoints, "hit", pause_in_flight)
    advance(run.pk, owner="test-executor")
    assert asked
    run.refresh_from_db()
    assert run.state == RunState.PAUSED
    assert states(run) == {"notify": StepState.COMPENSATED, "create_task": StepState.COMPENSATING}
    assert receivers.compensations() == {"task_cancel": 0, "correction": 1, "reversal": 0}
    actions = list(AuditEvent.objects.filter(run=run).order_by("id").values_list("action", flat=True))
    assert actions[-3:] == ["pause", "compensation_succeed", "pause_reached"]

    run_unpause(workflow_id=run.workflow_id, actor=olga, reason="tracker back")
    run = drive(run, clock)
    assert run.state == RunState.COMPENSATED and receivers.compensations() == UNDONE
    assert_invariants()


def test_a_paused_step_holds_its_compensation_and_its_release_lets_it_be_sent_once(clock):
    sam = person("sam")
    run = compensating(clock, "c-3")
    workflow_pause(workflow="test_orders", step_name="create_task", actor=sam, reason="tracker outage")
    run = drive(run, clock)
    assert (run.state, run.workflow_pause_id) == (RunState.PAUSED, WorkflowPause.objects.get().pk)
    assert states(run) == {"notify": StepState.COMPENSATED, "create_task": StepState.COMPENSATING}
    assert receivers.compensations() == {"task_cancel": 0, "correction": 1, "reversal": 0}

    released = workflow_unpause(workflow="test_orders", step_name="create_task", actor=sam, reason="tracker back")
    assert released["released"] == [run.workflow_id]
    run.refresh_from_db()
    assert run.state == RunState.COMPENSATING
    run = drive(run, clock)
    assert run.state == RunState.COMPENSATED and receivers.compensations() == UNDONE
    assert_invariants()


@pytest.mark.parametrize("step", ["notify", "create_task"])
@pytest.mark.parametrize("point", ["before_call", "after_call"])
def test_a_pause_with_a_kill_at_every_compensation_boundary_undoes_each_effect_once(clock, monkeypatch, step, point):
    """The operator pauses the compensating run and its worker dies at the boundary (after_call:
    the receiver committed, the answer never recorded). The executor that takes the run over
    settles what was in flight and stops before the next compensation; unpaused, the run ends
    compensated with each effect undone once."""
    from django.conf import settings

    olga = person("olga", "operator")
    run = compensating(clock, f"k-{step}-{point}")
    fired = []

    def paused_then_killed(name: str, at: str) -> None:
        if (name, at) == (f"{step}.compensate", point) and not fired:
            fired.append(True)
            run_pause(workflow_id=run.workflow_id, actor=olga, reason="outage")
            raise failpoints.FailpointRaised(f"killed at {name}:{at}")

    monkeypatch.setattr(failpoints, "hit", paused_then_killed)
    with pytest.raises(failpoints.FailpointRaised):
        advance(run.pk, owner="doomed")
    clock.advance(settings.RECOVERY_LEASE_SECONDS + 1)  # its lease runs out; another takes over
    run = drive(WorkflowRun.objects.get(pk=run.pk), clock)
    assert run.state == RunState.PAUSED, run.status_reason
    assert all(count <= 1 for count in receivers.compensations().values())

    run_unpause(workflow_id=run.workflow_id, actor=olga, reason="back")
    run = drive(run, clock)
    assert run.state == RunState.COMPENSATED and receivers.compensations() == UNDONE
    assert_invariants()
