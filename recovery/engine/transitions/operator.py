"""What an operator does to a run (resume, retry, reconcile, resolve, terminate, supersede a
decision), and the four-eyes rule some of those actions fall under."""

from __future__ import annotations

from contextvars import ContextVar
from datetime import datetime
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction

from recovery import clock
from recovery.actions import ACTIONS, FOUR_EYES_ACTIONS
from recovery.engine import dispatch
from recovery.errors import ApprovalRequired, InvalidTransition
from recovery.models import (
    ApprovalRequest,
    ApprovalState,
    OutboxMessage,
    OutboxState,
    RunState,
    StepExecution,
    StepState,
    WorkflowRun,
)
from recovery.redaction import redact_text
from recovery.workflow import workflow_of

from . import offers
from ._core import (
    RUN_LEASE_FIELDS,
    _abandon_running_steps,
    _actor_fields,
    _audit,
    _check,
    _locked_run_by_id,
    _redacted,
    _release_into,
    _save_run,
    _save_step,
    _snap,
    require_reason,
)
from .tables import RUN_TRANSITIONS, STEP_TRANSITIONS


def run_resume(
    *,
    workflow_id: str,
    actor: AbstractBaseUser | None,
    reason: str,
    expect: str | None = None,
    now: datetime | None = None,
) -> WorkflowRun:
    """Resume from the last checkpoint: the run becomes due now; every succeeded step is kept
    and a blocked step gets a fresh retry budget. A finished run refuses (rule 12)."""
    reason = require_reason(reason)
    now = now or clock.now()
    with transaction.atomic():
        run = _locked_run_by_id(workflow_id, expect)
        offers.require("resume", run, now, actor=actor)
        before = _snap(run)
        _check(RUN_TRANSITIONS, "resume", run.state, "run")
        for step in StepExecution.objects.select_for_update().filter(
            run=run, state__in=[StepState.FAILED, StepState.UNKNOWN]
        ):
            _restart_budget(step, now, actor)
        held = StepExecution.objects.select_for_update().filter(
            run=run, refusal__isnull=False, state__in=[StepState.PENDING, StepState.FAILED]
        )  # a refusal answered to an agent's model (its call skipped) stays on record
        for step in held:
            _clear_refusal(step)  # its guards run again: a refusal that still holds is recorded again
            _save_step(step, ["refusal", "last_error_kind", "last_error"], now, actor)
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
        _release_into(run, RunState.PENDING, reason=f"resumed by {_actor_fields(actor)['actor']}")
        _save_run(run, RUN_LEASE_FIELDS + ["status_reason"], now, actor)
        after = {**_snap(run), "outbox_requeued": requeued} if requeued else _snap(run)
        _audit(run, "resume", actor=actor, reason=reason, before=before, after=after, now=now)
        dispatch.enqueue_run(run.pk)
        return run


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


def step_retry(
    *,
    workflow_id: str,
    step_name: str,
    actor: AbstractBaseUser | None,
    reason: str,
    expect: str | None = None,
    now: datetime | None = None,
) -> WorkflowRun:
    """Retry one failed step now, with a fresh budget. The same idempotency key is sent
    again: an operator's retry never bypasses idempotency. An unknown step is not retried
    blindly: the executor reconciles it first, as it always does."""
    return _operator_step_action(
        "retry",
        frozenset({StepState.FAILED, StepState.UNKNOWN}),
        workflow_id=workflow_id,
        step_name=step_name,
        actor=actor,
        reason=reason,
        expect=expect,
        now=now,
    )


def step_reconcile(
    *,
    workflow_id: str,
    step_name: str,
    actor: AbstractBaseUser | None,
    reason: str,
    expect: str | None = None,
    now: datetime | None = None,
) -> WorkflowRun:
    """Reconcile an unknown step with the remote system now (look up by key, or resend the
    same key to a receiver that keeps its first result), with a fresh look-up budget."""
    return _operator_step_action(
        "reconcile",
        frozenset({StepState.UNKNOWN}),
        workflow_id=workflow_id,
        step_name=step_name,
        actor=actor,
        reason=reason,
        expect=expect,
        now=now,
    )


def _operator_step_action(
    action: str,
    allowed: frozenset[StepState],
    *,
    workflow_id: str,
    step_name: str,
    actor: AbstractBaseUser | None,
    reason: str,
    expect: str | None = None,
    now: datetime | None,
) -> WorkflowRun:
    reason = require_reason(reason)
    now = now or clock.now()
    with transaction.atomic():
        run = _locked_run_by_id(workflow_id, expect)
        offers.require(action, run, now, step_name=step_name, actor=actor)
        _abandon_running_steps(run, now, actor)
        step = StepExecution.objects.select_for_update().get(run=run, step_name=step_name)
        assert step.state in allowed  # offers.require: a step running under an expired lease is now unknown
        before = _snap(run, step)
        _restart_budget(step, now, actor)
        _release_into(run, RunState.PENDING, reason=f"{step_name}: {action} requested")
        _save_run(run, RUN_LEASE_FIELDS + ["status_reason"], now, actor)
        _audit(
            run, action, actor=actor, step_name=step_name, reason=reason, before=before, after=_snap(run, step), now=now
        )
        dispatch.enqueue_run(run.pk)
        return run


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
    reason = require_reason(reason)
    if happened:
        evidence = _evidence(evidence)
    elif evidence is not None:
        raise InvalidTransition("it did not happen: there is no evidence to record")
    now = now or clock.now()
    with transaction.atomic():
        run = _locked_run_by_id(workflow_id, expect)
        if happened:
            _four_eyes(run, "resolve_happened", step_name, approval)
        stays_terminated = run.state == RunState.TERMINATED
        situation = offers.require(
            "resolve_happened" if happened else "resolve_absent", run, now, step_name=step_name, actor=actor
        )
        _abandon_running_steps(run, now, actor)
        step = StepExecution.objects.select_for_update().get(run=run, step_name=step_name)
        early = None if happened else _window_open(situation, step, now)
        before = _snap(run, step)
        _fresh_budget(step)
        if happened:
            step.state = _check(STEP_TRANSITIONS, "succeed", step.state, "step")
            step.remote_ref = redact_text(evidence["remote_ref"])
            step.result = _redacted(run, evidence["result"])
        elif stays_terminated:
            step.state = StepState.SKIPPED
        else:
            step.state = _check(STEP_TRANSITIONS, "reset", step.state, "step")
        _save_step(step, ["state", "remote_ref", "result", *BUDGET_FIELDS], now, actor)
        if not stays_terminated:
            _release_into(run, RunState.PENDING, reason=f"{step_name}: resolved by an operator")
            _save_run(run, RUN_LEASE_FIELDS + ["status_reason"], now, actor)
        said = {"happened": happened}
        if happened:
            said.update(remote_ref=step.remote_ref, checked=evidence["checked"])
        if early is not None:
            said["in_flight_until"] = early
        _audit(
            run,
            "resolve",
            actor=actor,
            step_name=step_name,
            reason=reason,
            before=before,
            after={**_snap(run, step), "evidence": said},
            now=now,
        )
        dispatch.enqueue_run(run.pk)
        return run


def _evidence(evidence: Any) -> dict[str, Any]:
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


def run_terminate(
    *,
    workflow_id: str,
    actor: AbstractBaseUser | None,
    reason: str,
    expect: str | None = None,
    now: datetime | None = None,
    approval: ApprovalRequest | None = None,
) -> WorkflowRun:
    """Stop the run for good. Effects already made stay made (compensate them explicitly);
    a live executor's next fenced write fails, so it cannot continue."""
    reason = require_reason(reason)
    now = now or clock.now()
    with transaction.atomic():
        run = _locked_run_by_id(workflow_id, expect)
        _four_eyes(run, "terminate", "", approval)
        offers.require("terminate", run, now, actor=actor)
        before = _snap(run)
        _check(RUN_TRANSITIONS, "terminate", run.state, "run")
        abandoned = _abandon_running_steps(run, now, actor)  # a live executor's call may land or not
        _release_into(run, RunState.TERMINATED, reason=reason)
        run.lease_generation += 1  # fence out any executor still holding a lease
        _save_run(run, RUN_LEASE_FIELDS + ["status_reason"], now, actor)
        after = {**_snap(run), "steps_now_unknown": abandoned} if abandoned else _snap(run)
        _audit(run, "terminate", actor=actor, reason=reason, before=before, after=after, now=now)
        return run


def _clear_refusal(step: StepExecution) -> None:
    step.refusal = None
    step.last_error_kind = ""
    step.last_error = ""


def step_override(
    *,
    workflow_id: str,
    step_name: str,
    actor: AbstractBaseUser | None,
    reason: str,
    expect: str | None = None,
    now: datetime | None = None,
) -> WorkflowRun:
    """Accept the proposal a guard refused: the refused rule is overridden for this run (every
    step's guards skip it while the decision stands), recorded with who and why, and the run
    goes on. Other rules still hold."""
    reason = require_reason(reason)
    now = now or clock.now()
    with transaction.atomic():
        run = _locked_run_by_id(workflow_id, expect)
        offers.require("override", run, now, step_name=step_name)
        step = StepExecution.objects.select_for_update().get(run=run, step_name=step_name)
        before = _snap(run, step)
        refusal = step.refusal
        override = {
            "rule": refusal.get("rule", ""),
            "by": _actor_fields(actor)["actor"],
            "reason": redact_text(reason)[:1000],
            "at": now.isoformat(),
            "refused": refusal.get("message", ""),
            "values": refusal.get("values", {}),
        }
        step.overrides = [*(step.overrides or []), override]
        _clear_refusal(step)
        _save_step(step, ["refusal", "overrides", "last_error_kind", "last_error"], now, actor)
        _check(RUN_TRANSITIONS, "resume", run.state, "run")
        _release_into(run, RunState.PENDING, reason=f"{step_name}: {override['rule']} overridden by {override['by']}")
        _save_run(run, RUN_LEASE_FIELDS + ["status_reason"], now, actor)
        _audit(
            run,
            "policy_override",
            actor=actor,
            step_name=step_name,
            reason=reason,
            before={**before, "refusal": refusal},
            after={**_snap(run, step), "override": override},
            now=now,
        )
        dispatch.enqueue_run(run.pk)
        return run


# --- four-eyes: an action, requested by one person, approved by another ------------------

# How a request for each four-eyes action names it (recovery.actions).
LABELS = {name: ACTIONS[name].label for name in FOUR_EYES_ACTIONS}


def needs_approval(run: WorkflowRun, action: str) -> bool:
    """Whether the run's workflow puts ``action`` behind a second supervisor (``four_eyes``)."""
    try:
        return action in workflow_of(run).four_eyes
    except LookupError:
        return False


def _four_eyes(run: WorkflowRun, action: str, step_name: str, approval: ApprovalRequest | None) -> None:
    """Refuse ``action`` unless the workflow lets it run directly or ``approval`` is its
    granted request (approval_grant runs the action with it, in the grant's transaction)."""
    if not needs_approval(run, action):
        return
    if approval is not None and (approval.run_id, approval.action, approval.step_name) == (run.pk, action, step_name):
        if approval.state == ApprovalState.APPROVED or approval is _DRY_RUN.get():
            return
    raise ApprovalRequired(
        f"{LABELS[action]} on {run.workflow_name} runs needs a second supervisor's approval: request it on the "
        "run's page (or manage.py approval request)"
    )


# While a request is checked, the action runs once against it and is rolled back (_dry_run).
_DRY_RUN: ContextVar[ApprovalRequest | None] = ContextVar("recovery_approval_dry_run", default=None)
