"""Pausing a run (issue 37): an operator stops a run that moves by itself, with a reason, and
lets it go on later. No new attempt starts while it is paused: a call already in flight finishes
and is recorded, timers and in-flight windows keep running, and unpausing continues where it
stopped.

A run nobody holds is paused at once. A run an executor holds is paused by that executor at its
next step boundary (``_core.pause_checkpoint``): the pause is asked for (``paused_at`` set, the run's
revision bumped), so the executor's next write misses its fence and is decided again on the run
as it is now — a call's outcome is recorded, a new call is not begun (``_core.PAUSE_POINTS``),
and the run is given back as paused."""

from __future__ import annotations

from collections.abc import Iterable

from recovery.models import RunRestart, RunState, StepExecution, StepState, WorkflowRun
from recovery.redaction import redact_text

from . import offers
from ._core import Lease, PauseReached, _check, _snap, paused_text, pausing, transition
from .acting import Act, operator_transition
from .checkpoints import Draft
from .tables import RUN_TRANSITIONS

PAUSE_FIELDS = ("paused_at", "paused_by", "pause_reason")


@operator_transition("pause", offered=offers.pausable)
def run_pause(act: Act) -> None:
    """Pause a run that moves by itself (pending, waiting, running, compensating): no new attempt
    (nor compensation) starts until it is unpaused. Held by a live executor, it is paused at that
    executor's next step boundary, once the call in flight is recorded; otherwise at once."""
    run = act.run
    run.paused_at, run.paused_by, run.pause_reason = act.now, act.who, redact_text(act.reason)[:1000]
    # An operator's own pause: a canary released from its workflow's pause is one no more (that
    # pause holds it again once it is unpaused; it does not release this one).
    run.workflow_pause_id = None
    if act.situation.live:
        act.save_run([*PAUSE_FIELDS, "workflow_pause_id"])
        act.extra["pause"] = "at the executor's next step boundary, once the call in flight is recorded"
        return
    abandoned = act.abandon_running()  # an expired executor's call: unknown, reconciled after
    _check(RUN_TRANSITIONS, "pause", run.state, "run")
    act.release(RunState.PAUSED, paused_text(run), fence=True, fields=(*PAUSE_FIELDS, "workflow_pause_id"))
    if abandoned:
        act.extra["steps_now_unknown"] = abandoned


@operator_transition("unpause", offered=offers.unpausable)
def run_unpause(act: Act) -> None:
    """Let a paused run go on where it stopped: it is due at once (a step whose timer has not run
    out waits for it), or at ``wake_at`` in a release in waves — going forward, or compensating
    if it was (``resumed_state``). A pause not reached yet is withdrawn: its executor goes on."""
    run = act.run
    act.before = {**_snap(run), "paused_by": run.paused_by}
    run.paused_at, run.paused_by, run.pause_reason = None, None, None
    if run.state == RunState.PAUSED:
        target = resumed_state(run, act.situation.steps)
        run.workflow_pause_id = None  # released with its workflow's pause, or never held by one
        act.release(target, f"unpaused by {act.who}", fields=(*PAUSE_FIELDS, "workflow_pause_id"))
    else:  # asked for while an executor held it, not reached yet
        act.save_run(list(PAUSE_FIELDS))


def resumed_state(run: WorkflowRun, steps: Iterable[StepExecution] | None = None) -> RunState:
    """Where a paused run goes on: compensating, if it was paused while undoing its effects
    (steps still marked for compensation, or a restart waiting for its compensations to be
    applied); else forward, pending. Checked against the table."""
    steps = StepExecution.objects.filter(run=run) if steps is None else steps
    undoing = any(step.state == StepState.COMPENSATING for step in steps)
    if undoing or RunRestart.waiting(run.pk) is not None:
        return _check(RUN_TRANSITIONS, "unpause_compensation", run.state, "run")
    return _check(RUN_TRANSITIONS, "unpause", run.state, "run")


def run_pause_reached(*, lease: Lease) -> None:
    """The executor, at a step boundary, finds the pause asked for: the run is given back as
    paused (RunPaused is raised once it is written). Nothing happens if it was unpaused since."""

    def decide(draft: Draft) -> None:
        if pausing(draft.run):
            raise PauseReached

    transition(lease, decide)
