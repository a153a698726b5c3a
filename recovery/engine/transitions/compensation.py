"""Compensation (rule 10): undoing a run's effects in reverse order, each with its own key and
the same unknown-outcome rules as a step."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.contrib.auth.models import AbstractBaseUser

from recovery import clock
from recovery.engine import dispatch
from recovery.errors import ErrorKind, InvalidTransition, NotThisStep, StepError, TransientError
from recovery.models import RunRestart, RunState, StepExecution, StepState, WorkflowRun
from recovery.redaction import redact_text
from recovery.states import AuditAction
from recovery.workflow import Outcome, StepSpec, workflow_of

from . import offers
from ._core import (
    RUN_LEASE_FIELDS,
    Lease,
    _audit,
    _Change,
    _check,
    _redacted,
    _release_into,
    _run_transition,
    _save_run,
    _save_step,
    _snap,
    _step_transition,
    in_flight_text,
)
from .acting import Act, operator_transition
from .restart_plan import UNDO
from .tables import DONE_STEP_STATES, RUN_TRANSITIONS, STEP_TRANSITIONS

# --- compensation (rule 10) -----------------------------------------------------------


def _compensation_targets(run: WorkflowRun, step_name: str | None = None) -> list[StepExecution]:
    """The steps to undo, locked (offers.compensation_targets says which, or why none)."""
    steps = StepExecution.objects.select_for_update().filter(run=run)
    return offers.compensation_targets(offers.Situation.of(run, steps, clock.now()), step_name)


def _start_compensation(run: WorkflowRun, *, reason: str, now: datetime) -> list[str]:
    """The executor's automatic compensation of a run that failed for good: every completed
    compensable step, handed back to the executor (``_mark_compensation``), audited."""
    before = _snap(run)
    names = _mark_compensation(run, _compensation_targets(run), step_name=None, now=now, actor=None)
    after = {**_snap(run), "order": names}
    _audit(run, "compensate", actor=None, reason=reason, before=before, after=after, now=now)
    dispatch.enqueue_run(run.pk)
    return names


def _mark_compensation(
    run: WorkflowRun,
    targets: list[StepExecution],
    *,
    step_name: str | None,
    now: datetime,
    actor: AbstractBaseUser | None,
) -> list[str]:
    """Mark what will be compensated and hand the run to the executor, which undoes each
    marked step in reverse order (the order, returned). Steps that never ran are skipped
    (whole-run only)."""
    _check(RUN_TRANSITIONS, "compensate", run.state, "run")
    if step_name is None:
        for step in StepExecution.objects.select_for_update().filter(run=run, state=StepState.PENDING):
            step.state = _check(STEP_TRANSITIONS, "skip", step.state, "step")
            _save_step(step, ["state"], now, actor)
    for step in targets:
        step.state = _check(STEP_TRANSITIONS, "compensate", step.state, "step")
        step.next_attempt_at = None
        _save_step(step, ["state", "next_attempt_at"], now, actor)
    names = [s.step_name for s in sorted(targets, key=lambda s: s.order, reverse=True)]
    _release_into(run, RunState.COMPENSATING, reason=f"compensating {', '.join(names)}")
    run.lease_generation += 1  # fence out any executor still holding a lease
    _save_run(run, RUN_LEASE_FIELDS + ["status_reason"], now, actor)
    return names


@operator_transition("compensate", offered=offers.compensable)
def run_compensate(act: Act) -> None:
    """Undo completed effects with their business compensations, in reverse order: one step
    (``step_name``), or every completed compensable step of the run (the offer checked who may
    trigger each). Refused while an outcome is unknown or an executor holds the run. Also retries
    a compensation that failed."""
    act.abandon_running()  # then compensation waits for their reconciliation
    act.before = _snap(act.run)
    step_name = act.step_name or None
    targets = offers.compensation_targets(act.situation, step_name)
    waiting = RunRestart.waiting(act.run.pk)
    if waiting is not None:  # a restart waits for its own compensations, and for no other
        undo = sorted(e["step"] for e in waiting.effects if e["rule"] == UNDO)
        if any(step.step_name not in undo for step in targets):
            raise InvalidTransition(
                f"a restart from {waiting.step_name} waits for the compensation of {', '.join(undo)}: compensate "
                "only those (or terminate the run)"
            )
    order = _mark_compensation(act.run, targets, step_name=step_name, now=act.now, actor=act.actor)
    act.after = {**_snap(act.run), "order": order}
    act.wake = True


def compensation_begin(*, lease: Lease, step_name: str, now: datetime | None = None) -> StepExecution:
    """Record that the compensation call is about to be made (it may be made again after a
    crash: compensations are idempotent under their own key)."""

    def body(change: _Change) -> None:
        step, now = change.step, change.now
        _check(STEP_TRANSITIONS, "compensation_begin", step.state, "step")
        step.compensation_attempts += 1
        step.next_attempt_at = None
        step.compensation_sent_at = now  # until it answers, the request may commit
        change.save_step(step, ["compensation_attempts", "next_attempt_at", "compensation_sent_at"])
        change.extra = {"compensation_attempts": step.compensation_attempts}

    return _step_transition(lease, step_name, AuditAction.COMPENSATION_BEGIN, now, body)


def compensation_succeed(*, lease: Lease, step_name: str, outcome: Outcome, now: datetime | None = None) -> None:
    def body(change: _Change) -> None:
        run, step = change.run, change.step
        step.state = _check(STEP_TRANSITIONS, "compensation_succeed", step.state, "step")
        step.compensation_ref = redact_text(outcome.remote_ref)
        step.compensation_result = _redacted(run, outcome.result)
        step.compensation_restored = outcome.restored
        change.save_step(step, ["state", "compensation_ref", "compensation_result", "compensation_restored"])
        change.extra = {"compensation_ref": step.compensation_ref}
        if outcome.incident:
            incident = redact_text(outcome.incident)
            run.incident = "\n".join(filter(None, [run.incident, incident]))
            change.save_run(["incident"])
            change.extra["incident"] = incident

    _step_transition(lease, step_name, AuditAction.COMPENSATION_SUCCEED, now, body)


def compensation_fail(
    *, lease: Lease, step_name: str, error: StepError, spec: StepSpec, now: datetime | None = None
) -> None:
    """A compensation failed. Compensations are idempotent under their own key, so transient
    errors and unknown outcomes are retried within the step's budget — an unknown one not
    before its request can no longer commit (the step's in-flight bound), so that a look-up
    inside the compensation (has the correction been sent?) cannot miss a request still in
    flight. Anything else, an exhausted budget, or an unknown outcome with no bound stops in
    the visible ``compensation_failed`` state — never reported as rolled back."""

    def body(change: _Change) -> None:
        message = redact_text(error.message)
        _retry_or_stop(change, spec, error, message=message, why=f"{step_name}: compensation failed: {message}")

    _step_transition(lease, step_name, AuditAction.COMPENSATION_FAIL, now, body)


def compensation_unconfirmed(
    *,
    lease: Lease,
    step_name: str,
    remote_ref: str,
    error: StepError | None,
    spec: StepSpec,
    now: datetime | None = None,
) -> None:
    """The step's own look-up by the receiver's id (``@lookup_ref``) did not confirm that
    ``remote_ref``, the object its compensation would act on, is this run's, so nothing was sent.
    ``error`` None (the receiver has no such object) or NotThisStep (another request's object: a
    foreign id recorded before evidence was checked, or written by hand): the compensation is
    refused and waits for an operator in ``compensation_failed`` (audited ``compensation_refused``),
    never reported as compensated. Any other error (the receiver could not be asked): retried like
    a failed compensation within the step's budget, each check counting as an attempt; an
    exhausted budget or a permanent error stops in ``compensation_failed`` too. Never sent
    unconfirmed."""
    if error is None or isinstance(error, NotThisStep):
        _compensation_refuse(lease=lease, step_name=step_name, remote_ref=remote_ref, error=error, now=now)
        return

    message = redact_text(
        f"not sent: could not confirm that {remote_ref or 'its object'} is {step_name}'s own ({error.message})"
    )
    if error.kind == ErrorKind.UNKNOWN_OUTCOME:  # a look-up changes nothing: asking again is safe
        error = TransientError(error.message, retry_after=error.retry_after)
    failed = error

    def body(change: _Change) -> None:
        change.step.compensation_attempts += 1  # an attempt that sent nothing: the budget still counts it
        _retry_or_stop(change, spec, failed, message=message, why=f"{step_name}: compensation {message}")
        change.extra = {"compensation_attempts": change.step.compensation_attempts, "remote_ref": remote_ref}

    _step_transition(lease, step_name, AuditAction.COMPENSATION_FAIL, now, body)


def _compensation_refuse(
    *, lease: Lease, step_name: str, remote_ref: str, error: StepError | None, now: datetime | None
) -> None:
    def body(change: _Change) -> None:
        run, step = change.run, change.step
        if not remote_ref:
            cause = f"{step_name} recorded no remote id"
        elif error is None:
            cause = f"the receiver has no {remote_ref}"
        else:
            cause = f"{remote_ref} is not {step_name}'s object: {error.message}"
        message = redact_text(f"not sent: {cause}; check which object is this run's")
        step.state = _check(STEP_TRANSITIONS, "compensation_fail", step.state, "step")
        step.last_error_kind = ErrorKind.PERMANENT
        step.last_error = f"compensation: {message}"[:4000]
        step.next_attempt_at = None
        step.compensation_sent_at = None  # nothing sent, and an earlier request's window has closed
        _check(RUN_TRANSITIONS, "compensation_fail", run.state, "run")
        _release_into(run, RunState.COMPENSATION_FAILED, reason=f"{step_name}: compensation {message}")
        change.save_step(step, ["state", "last_error_kind", "last_error", "next_attempt_at", "compensation_sent_at"])
        change.save_run(RUN_LEASE_FIELDS + ["status_reason"])
        change.reason = message[:1000]
        change.extra = {"remote_ref": remote_ref}

    _step_transition(lease, step_name, AuditAction.COMPENSATION_REFUSED, now, body)


def _retry_or_stop(change, spec: StepSpec, error: StepError, *, message: str, why: str) -> None:
    """A compensation attempt that did not succeed (``message``, redacted): the next attempt
    scheduled within the step's budget, or the run stopped in ``compensation_failed`` (``why``)."""
    run, step, now, step_name = change.run, change.step, change.now, change.step.step_name
    step.last_error_kind = error.kind
    step.last_error = f"compensation: {message}"[:4000]
    unknown = error.kind == ErrorKind.UNKNOWN_OUTCOME
    settle_until = spec.in_flight_until(step.compensation_sent_at) if unknown else None
    if not unknown:
        step.compensation_sent_at = None  # it answered: nothing of this attempt is in flight
    retryable = unknown or spec.retry.retries(error.kind)
    delay = (
        spec.retry.next_delay(step.compensation_attempts, TransientError(error.message, retry_after=error.retry_after))
        if retryable
        else None
    )
    if unknown and spec.in_flight_bound() is None:
        delay = None
        why = f"{step_name}: compensation outcome unknown and its receiver may commit at any time: check it"
    if delay is not None:
        _check(STEP_TRANSITIONS, "compensation_begin", step.state, "step")
        step.next_attempt_at = max(now + timedelta(seconds=delay), settle_until or now)
        retry = "compensation retry scheduled"
        if settle_until is not None and step.next_attempt_at == settle_until:
            window = in_flight_text(step.compensation_sent_at, settle_until)
            retry = f"compensation outcome unknown; trying again {window}"
        _check(RUN_TRANSITIONS, "compensation_wait", run.state, "run")
        _release_into(run, RunState.COMPENSATING, wake_at=step.next_attempt_at, reason=f"{step_name}: {retry}")
        change.action = AuditAction.COMPENSATION_RETRY
    else:
        step.state = _check(STEP_TRANSITIONS, "compensation_fail", step.state, "step")
        step.next_attempt_at = None
        _check(RUN_TRANSITIONS, "compensation_fail", run.state, "run")
        _release_into(run, RunState.COMPENSATION_FAILED, reason=why)
    change.save_step(
        step,
        ["state", "last_error_kind", "last_error", "next_attempt_at", "compensation_sent_at", "compensation_attempts"],
    )
    change.save_run(RUN_LEASE_FIELDS + ["status_reason"])
    change.reason = message[:1000]


def run_compensation_done(*, lease: Lease, now: datetime | None = None) -> RunState:
    """Every marked step is compensated. The run is ``compensated`` when no completed effect
    is left; after compensating only some steps it returns to ``completed`` (if nothing else
    is outstanding) or to ``needs_review``. Undone for a restart that waits for it, it stays
    ``compensating`` until the restart is applied (``restart_apply``)."""

    def body(change: _Change) -> RunState:
        run = change.run
        _check(RUN_TRANSITIONS, "compensation_done", run.state, "run")
        waiting = RunRestart.waiting(run.pk)
        if waiting is not None:
            # Undone for a restart (transitions.restarts): the run stays compensating, due, until the
            # restart is applied (restart_apply, next) — never shown completed in between.
            why = f"compensations done; restarting from {waiting.step_name}"
            _release_into(run, RunState.COMPENSATING, wake_at=change.now, reason=why)
            change.save_run(RUN_LEASE_FIELDS + ["status_reason"])
            change.reason = why
            return RunState.COMPENSATING
        workflow = workflow_of(run)
        steps = change.draft.steps()
        states = {step.step_name: step.state for step in steps}
        compensable = {name for name in states if workflow.compensates(name)}
        left = [name for name, state in states.items() if name in compensable and state == StepState.SUCCEEDED]
        if not left:
            restored = not any(s.state == StepState.COMPENSATED and not s.compensation_restored for s in steps)
            # "Rolled back" only where every undone effect truly restored the previous state.
            target, why = RunState.COMPENSATED, "rolled back" if restored else "every completed effect was compensated"
        elif all(state in (*DONE_STEP_STATES, StepState.COMPENSATED) for state in states.values()):
            target, why = RunState.COMPLETED, f"compensated some steps; {', '.join(left)} stand"
        else:
            target, why = RunState.NEEDS_REVIEW, f"compensated some steps; {', '.join(left)} stand"
        _release_into(run, target, reason=why)
        run.current_step = ""
        change.save_run(RUN_LEASE_FIELDS + ["status_reason", "current_step"])
        change.reason = why
        return target

    return _run_transition(lease, AuditAction.COMPENSATION_DONE, now, body)
