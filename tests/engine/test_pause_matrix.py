"""Pausing at every step boundary, with a kill (issue 37): at each failpoint of each step, a
supervisor pauses the workflow (or the next step) and the worker dies there. The executor that
takes the run over records what was in flight, stops before the next attempt, and once the pause
is released the run completes with one remote object per step — never a second one."""

from __future__ import annotations

import pytest

from recovery.engine import failpoints
from recovery.engine.transitions import run_start, workflow_pause, workflow_unpause
from recovery.models import RunState, WorkflowPause, WorkflowRun
from tests.support import receivers
from tests.support.engine import assert_invariants, doomed_worker, drive, person

pytestmark = pytest.mark.django_db

EFFECTS = ("task", "message", "ledger")  # a model asked again after a kill is usage, not an effect
EFFECT_OF = {"create_task": "task", "notify": "message", "post_entry": "ledger"}
STEPS = ("read", "decide", "create_task", "notify", "post_entry")
NEXT = dict(zip(STEPS, [*STEPS[1:], None], strict=True))
POINTS = ("before_intent", "before_call", "after_call", "after_outcome")
CASES = [
    (step, point, scope)
    for step in STEPS
    for point in POINTS
    for scope in ("workflow", "next step")
    if not (scope == "next step" and NEXT[step] is None)
    and not (step == "read" and point == "before_intent")  # a read builds no intent
]


@pytest.mark.parametrize(("step", "point", "scope"), CASES, ids=lambda v: str(v).replace(" ", "-"))
def test_a_pause_at_every_step_boundary_with_a_kill_leaves_one_object_per_step(step, point, scope, clock, monkeypatch):
    sam = person("sam")
    paused_step = "" if scope == "workflow" else NEXT[step]
    fired = []

    def paused_then_killed(name: str, at: str) -> None:
        if (name, at) == (step, point) and not fired:
            fired.append(True)
            workflow_pause(workflow="test_orders", step_name=paused_step, actor=sam, reason="outage")
            raise failpoints.FailpointRaised(f"killed at {step}:{point}")

    run = run_start(workflow="test_orders", data={"tenant": "t", "order_id": f"{step}-{point}"})[0]
    monkeypatch.setattr(failpoints, "hit", paused_then_killed)
    doomed_worker(run, clock)  # until it dies at the failpoint; its lease runs out, another takes over
    assert fired, f"{step}:{point} was never reached"

    run = drive(run, clock)
    counts = receivers.counts()
    assert all(counts[kind] <= 1 for kind in EFFECTS), counts
    # Nothing called after the pause: the run stops before its next attempt, held by the pause —
    # unless the last step's call was made before it (found by its key: the run completes). An
    # intent written with the step's outcome before the pause (one commit: engine.fold) is an
    # attempt begun; it is looked up, never called, while the pause holds.
    if step == STEPS[-1] and point in ("after_call", "after_outcome"):
        assert run.state == RunState.COMPLETED
    else:
        held = (run.state, run.workflow_pause_id)
        assert held == (RunState.PAUSED, WorkflowPause.objects.get().pk), run.status_reason
    if NEXT[step] in EFFECT_OF:
        assert counts[EFFECT_OF[NEXT[step]]] == 0, counts
    workflow_unpause(workflow="test_orders", step_name=paused_step, actor=sam, reason="back")
    assert drive(WorkflowRun.objects.get(pk=run.pk), clock).state == RunState.COMPLETED
    counts = receivers.counts()
    assert {kind: counts[kind] for kind in EFFECTS} == dict.fromkeys(EFFECTS, 1), counts
    assert_invariants()
