"""Restarting with a corrected input at every step boundary, with a kill (issue 37): a completed
order is restarted from its first step (every effect undone first, then made again) or from its
last step, and the worker dies at each failpoint of each compensation and each step made again.
The executor that takes the run over ends it with exactly one compensation of each first effect
and one second effect per step — never a third, never a second compensation."""

from __future__ import annotations

import pytest

from recovery.engine import failpoints
from recovery.engine.transitions import run_restart, run_start
from recovery.models import RunRestart, RunState, WorkflowRun
from tests.support import receivers
from tests.support.engine import assert_invariants, doomed_worker, drive, person

pytestmark = pytest.mark.django_db

EFFECTS = ("task", "message", "ledger")
UNDO = {"create_task": "task_cancel", "notify": "correction", "post_entry": "reversal"}
EFFECT_OF = {"create_task": "task", "notify": "message", "post_entry": "ledger"}
STEPS = ("read", "decide", "create_task", "notify", "post_entry")
POINTS = ("before_intent", "before_call", "after_call", "after_outcome")


def cases(start: str) -> list[tuple[str, str]]:
    again = STEPS[STEPS.index(start) :]
    made = [(step, point) for step in again for point in POINTS if not (step == "read" and point == "before_intent")]
    undone = [
        (f"{step}.compensate", point) for step in again if step in UNDO for point in ("before_call", "after_call")
    ]
    return undone + made


CASES = [(start, step, point) for start in ("read", "post_entry") for step, point in cases(start)]


@pytest.mark.parametrize(("start", "step", "point"), CASES)
def test_a_restart_killed_at_every_boundary_undoes_each_effect_once_and_makes_it_again_once(
    start, step, point, clock, monkeypatch
):
    sam = person("sam")
    run = run_start(workflow="test_orders", data={"tenant": "t", "order_id": f"{step}-{point}", "text": "120"})[0]
    assert drive(run, clock).state == RunState.COMPLETED
    run_restart(
        workflow_id=run.workflow_id,
        step_name=start,
        actor=sam,
        reason="the order said 125",
        edited="input",
        value={**run.input, "text": "125"},
    )
    fired = []

    def killed(name: str, at: str) -> None:
        if (name, at) == (step, point) and not fired:
            fired.append(True)
            raise failpoints.FailpointRaised(f"killed at {step}:{point}")

    monkeypatch.setattr(failpoints, "hit", killed)
    doomed_worker(run, clock)  # until it dies at the failpoint; its lease runs out, another takes over
    assert fired, f"{step}:{point} was never reached"

    run = drive(WorkflowRun.objects.get(pk=run.pk), clock)
    assert run.state == RunState.COMPLETED, run.status_reason
    again = STEPS[STEPS.index(start) :]
    counts, undone = receivers.counts(), receivers.compensations()
    assert {kind: counts[kind] for kind in EFFECTS} == {
        EFFECT_OF[name]: 2 if name in again else 1 for name in EFFECT_OF
    }, counts
    assert undone == {UNDO[name]: 1 if name in again else 0 for name in UNDO}, undone
    assert RunRestart.objects.get(run=run).applied_at is not None
    posted = run.steps.get(step_name="post_entry")
    # From its first step the corrected order is read again; from the last, the decision stands.
    assert (posted.intent["amount"], posted.key_version) == (125 if start == "read" else 120, 2)
    assert_invariants()
