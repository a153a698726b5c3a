"""What an operator does to a run: resume, retry (now), reconcile, resolve, terminate, override a
refusal. Each is a body under ``@operator_transition`` (recovery.engine.transitions.acting), but
resolve, whose offer depends on its answer and whose evidence is checked before the transaction:
it opens ``acting`` itself, under ``@performs``."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.contrib.auth.models import AbstractBaseUser

from recovery.engine import dispatch
from recovery.errors import InvalidTransition
from recovery.models import (
    ApprovalRequest,
    OutboxMessage,
    OutboxState,
    RunState,
    StepExecution,
    StepState,
    WorkflowRun,
)
from recovery.redaction import redact_text
from recovery.states import AuditAction

from . import offers
from ._core import _check, _redacted, _save_step
from .acting import Act, acting, operator_transition
from .performers import performs
from .tables import RUN_TRANSITIONS, STEP_TRANSITIONS


@operator_transition("resume", offered=offers.resumable)
def run_resume(act: Act) -> None:
    """Resume from the last checkpoint: the run becomes due now; every succeeded step is kept
    and a blocked step gets a fresh retry budget. A finished run refuses (rule 12)."""
    run, now = act.run, act.now
    _check(RUN_TRANSITIONS, "resume", run.state, "run")
    for step in act.situation.steps:
        if step.state in (StepState.FAILED, StepState.UNKNOWN):
            _restart_budget(step, now, act.actor)
    for step in act.situation.steps:
        # a refusal answered to an agent's model (its call skipped) stays on record
        if step.refusal is not None and step.state in (StepState.PENDING, StepState.FAILED):
            _clear_refusal(step)  # its guards run again: a refusal that still holds is recorded again
            act.save_step(step, ["refusal", "last_error_kind", "last_error"])
    requeued = []
    for message in OutboxMessage.objects.select_for_update().filter(run=run, state=OutboxState.FAILED):
        # Delivered once at most: the next attempt looks the message up before sending.
        message.state = OutboxState.PENDING
        message.budget_start_attempt = message.attempts
        message.budget_started_at = now
        message.next_attempt_at = None
        message.updated_at = now
        message.save(
            update_fields=["state", "budget_start_attempt", "budget_started_at", "next_attempt_at", "updated_at"]
        )
        dispatch.enqueue_message(message.pk)
        requeued.append(message.step_name)
    act.release(RunState.PENDING, f"resumed by {act.who}")
    if requeued:
        act.extra["outbox_requeued"] = requeued


BUDGET_FIELDS = [
    "budget_start_attempt",
    "budget_started_at",
    "format_failures",
    "reconcile_attempts",
    "next_attempt_at",
]


def _fresh_budget(step: StepExecution) -> None:
    step.budget_start_attempt = step.attempts
    step.budget_started_at = None
    step.format_failures = 0
    step.reconcile_attempts = 0
    step.next_attempt_at = None


def _restart_budget(step: StepExecution, now: datetime, actor: AbstractBaseUser | None) -> None:
    """An operator decided something changed: a failed step becomes due again with a fresh
    budget; an unknown one stays unknown (it is reconciled first, never retried blindly)."""
    _fresh_budget(step)
    if step.state == StepState.FAILED:
        step.state = StepState.PENDING
    _save_step(step, ["state", *BUDGET_FIELDS], now, actor)


@operator_transition("retry", offered=offers.step_in("retry", frozenset({StepState.FAILED, StepState.UNKNOWN})))
def step_retry(act: Act) -> None:
    """Retry one failed step now, with a fresh budget. The same idempotency key is sent
    again: an operator's retry never bypasses idempotency. An unknown step is not retried
    blindly: the executor reconciles it first, as it always does."""
    _restart_step(act, "retry")


@operator_transition("retry_now", offered=offers.backoff_waiting)
def step_retry_now(act: Act) -> None:
    """Drop a waiting step's backoff: its next attempt is made now, under the same key, and counts
    in its retry budget as any other (no attempt beyond the budget; if it fails, the next waits
    its backoff again). Refused where an outcome is unknown (reconcile first)."""
    step = act.step
    act.extra["was_due_at"] = step.next_attempt_at.isoformat()
    step.next_attempt_at = act.now
    act.save_step(step, ["next_attempt_at"])
    _check(RUN_TRANSITIONS, "retry_now", act.run.state, "run")
    act.release(RunState.PENDING, f"{act.step_name}: to be tried now, asked by {act.who}")


@operator_transition("reset_attempts", offered=offers.backoff_waiting)
def step_reset_attempts(act: Act) -> None:
    """Give a step waiting for its retry its whole retry budget back (a supervisor's): the attempts
    made so far, and the time spent, no longer count against it; it stays due when it was (the
    run keeps waiting). Refused where an outcome is unknown (reconcile first) or nothing waits."""
    step = act.step
    act.extra["attempts_counted"] = step.attempts - step.budget_start_attempt
    due = step.next_attempt_at
    _fresh_budget(step)
    step.next_attempt_at = due
    act.save_step(step, BUDGET_FIELDS)
    act.run.status_reason = redact_text(
        f"{act.step_name}: retry budget given back by {act.who}; next attempt at {due:%H:%M:%S} UTC"
    )
    act.save_run(["status_reason"])  # the executor's copy of the run is stale: it reads it again


@operator_transition("reconcile", offered=offers.step_in("reconcile", frozenset({StepState.UNKNOWN})))
def step_reconcile(act: Act) -> None:
    """Reconcile an unknown step with the remote system now (look up by key, or resend the
    same key to a receiver that keeps its first result), with a fresh look-up budget."""
    _restart_step(act, "reconcile")


def _restart_step(act: Act, action: str) -> None:
    act.abandon_running()  # the offer judged a step running under an expired lease unknown
    _restart_budget(act.step, act.now, act.actor)
    act.release(RunState.PENDING, f"{act.step_name}: {action} requested")


@performs("resolve_happened", offered=offers.resolvable(True), happened=True)
@performs("resolve_absent", offered=offers.resolvable(False), happened=False)
def step_resolve(
    *,
    workflow_id: str,
    step_name: str,
    actor: AbstractBaseUser | None,
    reason: str,
    happened: bool,
    evidence: dict[str, Any] | None = None,
    expect: str | None = None,
    now: datetime | None = None,
    approval: ApprovalRequest | None = None,
) -> WorkflowRun:
    """An operator settles an unknown outcome with evidence from the other system: "it
    succeeded, remote id X" records the step as succeeded with the ``evidence`` that
    ``recovery.engine.evidence.examine`` checked (at the receiver, or a result validated by the
    step's schema: the step's result, as a reconcile would record it); "it did not happen"
    makes it due again, with the same key. The run becomes due — except a terminated run,
    which stays terminated: there the evidence only settles what exists (so that it can be
    compensated), and a call that did not happen is skipped."""
    if happened:
        evidence = checked_evidence(evidence)
    elif evidence is not None:
        raise InvalidTransition("it did not happen: there is no evidence to record")
    with acting(
        "resolve_happened" if happened else "resolve_absent",
        workflow_id=workflow_id,
        step_name=step_name,
        actor=actor,
        reason=reason,
        expect=expect,
        now=now,
        approval=approval,
        audit_as=AuditAction.RESOLVE,
    ) as act:
        run = act.run
        stays_terminated = run.state == RunState.TERMINATED
        act.abandon_running()
        step = act.step
        early = None if happened else _window_open(act.situation, step, act.now)
        _fresh_budget(step)
        if happened:
            step.state = _check(STEP_TRANSITIONS, "succeed", step.state, "step")
            step.remote_ref = redact_text(evidence["remote_ref"])
            step.result = _redacted(run, evidence["result"])
        elif stays_terminated:
            step.state = StepState.SKIPPED
        else:
            step.state = _check(STEP_TRANSITIONS, "reset", step.state, "step")
        act.save_step(step, ["state", "remote_ref", "result", *BUDGET_FIELDS])
        if not stays_terminated:
            act.release(RunState.PENDING, f"{step_name}: resolved by an operator")
        said = {"happened": happened}
        if happened:
            said.update(remote_ref=step.remote_ref, checked=evidence["checked"])
        if early is not None:
            said["in_flight_until"] = early
        act.extra["evidence"] = said
        return run


def checked_evidence(evidence: Any) -> dict[str, Any]:
    """The checked evidence's shape (recovery.engine.evidence.examine makes it)."""
    if evidence is None:
        raise InvalidTransition("give the remote id that shows it succeeded")
    ref, result, checked = (evidence.get(k) for k in ("remote_ref", "result", "checked"))
    if not (isinstance(ref, str) and ref.strip() and isinstance(checked, str) and checked):
        raise InvalidTransition("the evidence was not checked: look it up first (recovery.engine.evidence)")
    if result is not None and not isinstance(result, dict):
        raise InvalidTransition("the evidence's result must be a JSON object")
    return evidence


def _window_open(situation: offers.Situation, step: StepExecution, now: datetime) -> str | None:
    """When "it did not happen" is said while the step's request may still commit (a
    supervisor's call, offers.absent_too_early): the window's end, for the audit."""
    until = offers.in_flight_until(situation, step)
    if until is not None and until <= now:
        return None
    return until.isoformat() if until is not None else "unbounded"


@operator_transition("terminate", offered=offers.terminable)
def run_terminate(act: Act) -> None:
    """Stop the run for good. Effects already made stay made (compensate them explicitly);
    a live executor's next fenced write fails, so it cannot continue."""
    _check(RUN_TRANSITIONS, "terminate", act.run.state, "run")
    abandoned = act.abandon_running()  # a live executor's call may land or not
    act.release(RunState.TERMINATED, act.reason, fence=True)  # fence out any executor still holding a lease
    if abandoned:
        act.extra["steps_now_unknown"] = abandoned


def _clear_refusal(step: StepExecution) -> None:
    step.refusal = None
    step.last_error_kind = ""
    step.last_error = ""


@operator_transition("override", offered=offers.overridable, audit_as=AuditAction.POLICY_OVERRIDE)
def step_override(act: Act) -> None:
    """Accept the proposal a guard refused: the refused rule is overridden for this run (every
    step's guards skip it while the decision stands), recorded with who and why, and the run
    goes on. Other rules still hold."""
    step = act.step
    refusal = step.refusal
    override = {
        "rule": refusal.get("rule", ""),
        "by": act.who,
        "reason": redact_text(act.reason)[:1000],
        "at": act.now.isoformat(),
        "refused": refusal.get("message", ""),
        "values": refusal.get("values", {}),
    }
    act.before["refusal"] = refusal
    step.overrides = [*(step.overrides or []), override]
    _clear_refusal(step)
    act.save_step(step, ["refusal", "overrides", "last_error_kind", "last_error"])
    _check(RUN_TRANSITIONS, "resume", act.run.state, "run")
    act.release(RunState.PENDING, f"{act.step_name}: {override['rule']} overridden by {override['by']}")
    act.extra["override"] = override
