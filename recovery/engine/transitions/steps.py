"""A step's attempts under a lease: begin, succeed, fail, unknown outcome, reconcile, the wait
for the in-flight window."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Max

from recovery import clock
from recovery.errors import ErrorKind, ExecutorLost, StepError
from recovery.models import DecisionState, ModelDecision, RunState, StepExecution, StepState
from recovery.redaction import redact_text
from recovery.states import AuditAction
from recovery.workflow import Outcome, Reconcile, StepSpec, workflow_of

from ._core import (
    RUN_LEASE_FIELDS,
    Lease,
    _Change,
    _check,
    _error_text,
    _redacted,
    _release_into,
    _step_transition,
    in_flight_text,
)
from .checkpoints import Draft
from .compensation import _compensation_targets, _start_compensation
from .tables import RUN_TRANSITIONS, STEP_TRANSITIONS


def _record_attempt(step: StepExecution, intent: dict[str, Any], request_hash: str, now: datetime) -> list[str]:
    """Checkpoint an attempt's intent and count it; returns the fields it changed. The intent
    is stored redacted; ``request_hash`` is the hash of that redacted intent (the executor
    redacts, hashes and calls with the redacted intent: redacting again changes nothing)."""
    step.intent = _redacted(step.run, intent)
    step.request_hash = request_hash
    step.attempts += 1
    step.first_attempt_at = step.first_attempt_at or now
    step.budget_started_at = step.budget_started_at or now
    step.last_attempt_at = now
    step.next_attempt_at = None
    return [
        "intent",
        "request_hash",
        "attempts",
        "first_attempt_at",
        "budget_started_at",
        "last_attempt_at",
        "next_attempt_at",
    ]


def step_begin(
    *,
    lease: Lease,
    step_name: str,
    intent: dict[str, Any],
    request_hash: str,
    now: datetime | None = None,
    draft: Draft | None = None,
) -> StepExecution:
    """Checkpoint the validated intent before the call (rule 5): after this commit a crash
    leaves evidence that the call may have been made. With ``draft``: decided on it, not
    written (``Lease.commit``)."""

    def body(change: _Change) -> None:
        step = change.step
        step.state = _check(STEP_TRANSITIONS, "begin", step.state, "step")
        change.save_step(step, ["state", *_record_attempt(step, intent, request_hash, change.now)])

    return _step_transition(lease, step_name, AuditAction.STEP_BEGIN, now, body, draft=draft)


def step_succeed(
    *,
    lease: Lease,
    step_name: str,
    outcome: Outcome,
    complete_run: bool = False,
    decision: dict[str, Any] | None = None,
    spec: StepSpec | None = None,
    attempt: tuple[dict[str, Any], str] | None = None,
    action: str = "step_succeed",
    reason: str = "",
    now: datetime | None = None,
    draft: Draft | None = None,
) -> StepExecution:
    """Checkpoint the observed result as soon as the call returns. ``decision`` (a model
    step's validated proposal) is accepted in the same transaction; ``complete_run`` marks
    the run completed in it too when this was the last step. ``attempt`` (intent, request
    hash) counts the attempt in this same checkpoint: for a local step whose effect is in the
    caller's transaction, where no intent was committed before (nothing could have happened
    without this commit)."""

    def body(change: _Change) -> None:
        run, step, now = change.run, change.step, change.now
        step.state = _check(STEP_TRANSITIONS, "succeed" if attempt is None else "attempt_succeed", step.state, "step")
        # The executor goes on with this copy (and a replay reads it back): the same values.
        step.remote_ref = redact_text(outcome.remote_ref)
        step.result = _redacted(run, outcome.result)
        step.next_attempt_at = None
        fields = ["state", "remote_ref", "result", "next_attempt_at"]
        if attempt is not None:
            fields += _record_attempt(step, *attempt, now)
        change.save_step(step, fields)
        if decision is not None:
            assert spec is not None and spec.is_decision
            accepted = _redacted(run, decision)
            latest = ModelDecision.objects.filter(run=run, step_name=step_name).aggregate(v=Max("version"))["v"] or 0
            change.insert(
                ModelDecision(
                    run=run,
                    step_name=step_name,
                    version=latest + 1,
                    state=DecisionState.ACCEPTED,
                    schema_version=spec.schema_version,
                    proposal=accepted,
                    accepted=accepted,
                    created_at=now,
                )
            )
        if complete_run:
            _check(RUN_TRANSITIONS, "complete", run.state, "run")
            _release_into(run, RunState.COMPLETED)
            run.current_step = ""
            change.save_run([*RUN_LEASE_FIELDS, "status_reason", "current_step"])
        change.reason = reason

    return _step_transition(lease, step_name, action, now, body, draft=draft)


def step_fail(
    *,
    lease: Lease,
    step_name: str,
    error: StepError,
    spec: StepSpec,
    auto_compensate: bool = False,
    now: datetime | None = None,
) -> StepExecution:
    """Record a failed attempt and decide what follows, by the error's kind and the step's
    budget: a scheduled retry (run waiting), a permanent stop (run failed, the transient
    budget untouched), or review (budget exhausted, unclassified, or too many invalid model
    outputs — the bad output kept when the step allows). With ``auto_compensate`` (the
    workflow's policy), a permanent failure starts compensating the completed steps; a
    technical error never does."""

    def body(change: _Change) -> None:
        run, step, now = change.run, change.step, change.now
        step.state = _check(STEP_TRANSITIONS, "fail", step.state, "step")
        message = redact_text(error.message)
        step.last_error_kind = error.kind
        step.last_error = message[:4000]
        step.next_attempt_at = None
        step_fields = ["state", "last_error_kind", "last_error", "next_attempt_at"]
        policy = spec.retry
        delay: float | None = None
        run_fields = ["status_reason"]
        if error.kind == ErrorKind.INVALID_MODEL_OUTPUT:
            step.format_failures += 1
            step_fields.append("format_failures")
            change.insert(
                ModelDecision(
                    run=run,
                    step_name=step_name,
                    version=0,
                    state=DecisionState.INVALID,
                    schema_version=spec.schema_version,
                    invalid_output=redact_text(error.raw_output or "")[:20000] if spec.keep_invalid_output else "",
                    validation_error=message[:4000],
                    created_at=now,
                )
            )
            if step.format_failures < policy.maximum_format_failures:
                delay = policy.backoff(step.format_failures)
            outcome, why = RunState.NEEDS_REVIEW, f"model output invalid {step.format_failures} times"
        elif error.kind == ErrorKind.PERMANENT or error.kind in policy.non_retryable_kinds:
            outcome, why = RunState.FAILED, f"{step_name}: permanent error, not retried: {message}"
            run.effects_stand = _effects_stand(run)
            run_fields.append("effects_stand")
        elif policy.retries(error.kind):
            elapsed = (now - step.budget_started_at).total_seconds() if step.budget_started_at else 0.0
            delay = policy.next_delay(step.attempts - step.budget_start_attempt, error, elapsed=elapsed)
            outcome, why = RunState.NEEDS_REVIEW, f"{step_name}: retry budget exhausted: {message}"
        else:
            outcome, why = RunState.NEEDS_REVIEW, f"{step_name}: {error.kind} error needs review: {message}"

        if delay is not None:
            step.next_attempt_at = now + timedelta(seconds=delay)
            _check(RUN_TRANSITIONS, "wait", run.state, "run")
            _release_into(run, RunState.WAITING, wake_at=step.next_attempt_at, reason=f"{step_name}: retry scheduled")
        else:
            _check(RUN_TRANSITIONS, "review" if outcome == RunState.NEEDS_REVIEW else "fail", run.state, "run")
            _release_into(run, outcome, reason=why)
        change.save_step(step, step_fields)
        change.save_run(run_fields + RUN_LEASE_FIELDS)
        change.reason = message[:1000]

    now = now or clock.now()
    if not auto_compensate:
        return _step_transition(lease, step_name, AuditAction.STEP_FAIL, now, body)
    with lease.atomic():  # the failure and an automatic compensation commit together
        step = _step_transition(lease, step_name, AuditAction.STEP_FAIL, now, body)
        run = step.run
        if run.state == RunState.FAILED and _compensation_targets(run):
            # The checkpoint's UPDATE holds the run's row lock until this transaction ends.
            _start_compensation(run, reason=f"automatic: {step_name} failed permanently", now=now)
            lease.seen.clear()  # it marked other steps and fenced this lease off: the copy is out of date
        return step


def _effects_stand(run) -> bool:
    """Whether a completed step of the run wrote elsewhere (by its workflow's declaration)."""
    try:
        workflow = workflow_of(run)
    except LookupError:
        return False
    made = StepExecution.objects.filter(run=run, state=StepState.SUCCEEDED).values_list("step_name", flat=True)
    return any(workflow.writes(name) for name in made)


def step_refuse(
    *,
    lease: Lease,
    step_name: str,
    rule: str,
    message: str,
    values: dict[str, Any],
    to_model: bool = False,
    now: datetime | None = None,
    draft: Draft | None = None,
) -> StepExecution:
    """A guard refused the step before its intent was checkpointed: nothing was written or
    sent. The step keeps the refusal (which rule, which values) and the run waits for an
    operator: supersede the decision, override the rule (a supervisor), or terminate. With
    ``to_model`` (an agent's tool call, by its agent's policy) the call is skipped instead and
    the refusal is answered to the model; the run goes on."""

    def body(change: _Change) -> None:
        run, step = change.run, change.step
        step.state = _check(STEP_TRANSITIONS, "refuse_to_model" if to_model else "refuse", step.state, "step")
        cause = redact_text(f"policy refused: {rule}: {message}")
        step.refusal = _redacted(run, {"rule": rule, "message": message, "values": _plain(values)})
        step.last_error_kind = ErrorKind.POLICY_REFUSED
        step.last_error = cause[:4000]
        step.next_attempt_at = None
        change.save_step(step, ["state", "refusal", "last_error_kind", "last_error", "next_attempt_at"])
        change.extra = {"refusal": step.refusal}
        if to_model:
            change.reason = f"{cause}; answered to the model"[:1000]
            return
        _check(RUN_TRANSITIONS, "review", run.state, "run")
        _release_into(run, RunState.NEEDS_REVIEW, reason=cause)
        change.save_run(RUN_LEASE_FIELDS + ["status_reason"])
        change.reason = cause[:1000]

    return _step_transition(lease, step_name, AuditAction.POLICY_REFUSED, now, body, draft=draft)


def _plain(values: dict[str, Any]) -> dict[str, Any]:
    """A refusal's values as JSON (decimals and dates as text)."""
    return json.loads(json.dumps(values, default=str))


def step_defer_check(
    *,
    lease: Lease,
    step_name: str,
    rule: str,
    error: StepError,
    spec: StepSpec,
    now: datetime | None = None,
    draft: Draft | None = None,
) -> StepExecution:
    """A guard could not read the state it checks (the other system failed): nothing was
    sent. A retryable failure checks again later, within the step's retry budget (counted in
    ``reconcile_attempts``, the step's failed look-ups); anything else goes to review."""

    def body(change: _Change) -> None:
        run, step, now = change.run, change.step, change.now
        step.state = _check(STEP_TRANSITIONS, "defer_check", step.state, "step")
        step.reconcile_attempts += 1
        message = redact_text(f"guard {rule} could not check: {error.message}")
        step.last_error_kind = error.kind
        step.last_error = message[:4000]
        delay = spec.retry.next_delay(step.reconcile_attempts, error)
        if delay is None:
            step.next_attempt_at = None
            _check(RUN_TRANSITIONS, "review", run.state, "run")
            _release_into(run, RunState.NEEDS_REVIEW, reason=f"{step_name}: {message}"[:2000])
        else:
            step.next_attempt_at = now + timedelta(seconds=delay)
            _check(RUN_TRANSITIONS, "wait", run.state, "run")
            _release_into(
                run, RunState.WAITING, wake_at=step.next_attempt_at, reason=f"{step_name}: check retry scheduled"
            )
        fields = ["state", "reconcile_attempts", "last_error_kind", "last_error", "next_attempt_at"]
        change.save_step(step, fields)
        change.save_run(RUN_LEASE_FIELDS + ["status_reason"])
        change.reason = message[:1000]

    return _step_transition(lease, step_name, AuditAction.CHECK_DEFERRED, now, body, draft=draft)


def step_mark_unknown(
    *, lease: Lease, step_name: str, error: StepError, spec: StepSpec, now: datetime | None = None
) -> StepExecution:
    """The call may have happened and nobody can prove it either way (rule 7). Never
    relabelled as failed: it is reconciled next, or goes to an operator when the step has
    no automatic way to find out."""

    def body(change: _Change) -> None:
        run, step = change.run, change.step
        step.state = _check(STEP_TRANSITIONS, "mark_unknown", step.state, "step")
        step.last_error_kind = ErrorKind.UNKNOWN_OUTCOME
        step.last_error = _error_text(error, 4000)
        change.save_step(step, ["state", "last_error_kind", "last_error"])
        if isinstance(error, ExecutorLost):  # not the receiver's failure (workflow_pause_if_failing)
            change.extra["executor_lost"] = True
        if spec.reconcile in (None, Reconcile.OPERATOR):
            _check(RUN_TRANSITIONS, "review", run.state, "run")
            _release_into(run, RunState.NEEDS_REVIEW, reason=f"{step_name}: outcome unknown, operator must reconcile")
            change.save_run(RUN_LEASE_FIELDS + ["status_reason"])
        change.reason = _error_text(error, 1000)

    return _step_transition(lease, step_name, AuditAction.STEP_UNKNOWN, now, body)


def step_reset(*, lease: Lease, step_name: str, reason: str, now: datetime | None = None) -> StepExecution:
    """A look-up proved the unknown call never took effect: the step may be performed."""

    def body(change: _Change) -> None:
        step = change.step
        step.state = _check(STEP_TRANSITIONS, "reset", step.state, "step")
        step.next_attempt_at = None
        change.save_step(step, ["state", "next_attempt_at"])
        change.reason = reason

    return _step_transition(lease, step_name, AuditAction.RECONCILED_ABSENT, now, body)


def step_defer_reconcile(
    *, lease: Lease, step_name: str, error: StepError, spec: StepSpec, now: datetime | None = None
) -> StepExecution:
    """The look-up of an unknown outcome failed: the step stays unknown (never failed). A
    retryable failure schedules another look-up within the step's budget; anything else,
    or an exhausted budget, goes to review."""

    def body(change: _Change) -> None:
        run, step, now = change.run, change.step, change.now
        step.state = _check(STEP_TRANSITIONS, "defer_reconcile", step.state, "step")
        step.reconcile_attempts += 1
        step.last_error = f"reconcile failed: {redact_text(error.message)}"[:4000]
        delay = spec.retry.next_delay(step.reconcile_attempts, error)
        if delay is None:
            step.next_attempt_at = None
            _check(RUN_TRANSITIONS, "review", run.state, "run")
            _release_into(run, RunState.NEEDS_REVIEW, reason=f"{step_name}: outcome unknown and look-up failed")
        else:
            step.next_attempt_at = now + timedelta(seconds=delay)
            _check(RUN_TRANSITIONS, "wait", run.state, "run")
            _release_into(
                run, RunState.WAITING, wake_at=step.next_attempt_at, reason=f"{step_name}: look-up retry scheduled"
            )
        change.save_step(step, ["state", "reconcile_attempts", "last_error", "next_attempt_at"])
        change.save_run(RUN_LEASE_FIELDS + ["status_reason"])
        change.reason = _error_text(error, 1000)

    return _step_transition(lease, step_name, AuditAction.RECONCILE_DEFERRED, now, body)


def step_await_settle(
    *, lease: Lease, step_name: str, until: datetime, sent_at: datetime | None, now: datetime | None = None
) -> StepExecution:
    """A look-up found nothing while the request sent at ``sent_at`` may still commit (its
    in-flight window ends at ``until``): the miss proves nothing yet (rule 7). The step stays
    unknown and is looked up again at ``until``, when a miss does prove absence."""

    def body(change: _Change) -> None:
        run, step = change.run, change.step
        step.state = _check(STEP_TRANSITIONS, "await_settle", step.state, "step")
        step.next_attempt_at = until
        why = f"{step_name}: outcome unknown; looking again {in_flight_text(sent_at, until)}"
        _check(RUN_TRANSITIONS, "wait", run.state, "run")
        _release_into(run, RunState.WAITING, wake_at=until, reason=why)
        change.save_step(step, ["state", "next_attempt_at"])
        change.save_run(RUN_LEASE_FIELDS + ["status_reason"])
        change.reason = f"look-up found nothing yet; the receiver may commit the request until {until.isoformat()}"
        change.extra = {"in_flight_until": until.isoformat()}

    return _step_transition(lease, step_name, AuditAction.RECONCILE_WAIT, now, body)
