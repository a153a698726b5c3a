"""The transactional outbox (rule 5): a step's message is written with the step's success and
delivered by the publisher, never twice."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import connection, transaction
from django.db.models import Q

from recovery import clock, registry
from recovery.engine import dispatch
from recovery.errors import ErrorKind, LeaseLost, StepError, TransientError
from recovery.models import OutboxMessage, OutboxState, RunState, StepExecution, WorkflowRun
from recovery.redaction import redact_text
from recovery.states import AuditAction
from recovery.workflow import Outcome, StepSpec

from ._core import (
    Lease,
    _audit,
    _Change,
    _check,
    _decide,
    _error_text,
    _live_lease,
    _redacted,
    _renew,
    _save_run,
    _save_step,
    default_owner,
    in_flight_text,
    lease_duration,
    pause_checkpoint,
    paused_error,
    pausing,
)
from .checkpoints import Draft, _locked_run
from .steps import _record_attempt
from .tables import STEP_TRANSITIONS

# --- transactional outbox (rule 5) ------------------------------------------------------


def step_enqueue(
    *, lease: Lease, step_name: str, intent: dict[str, Any], request_hash: str, now: datetime | None = None
) -> OutboxMessage:
    """The step's message is written as an outbox row in the same transaction as the step's
    success: after this commit it will be delivered, and never twice. The step's remote
    reference is the outbox row until the publisher records the provider's message id.

    Decided under the run's lock (the message's row is written before the checkpoint that
    names it, so the fence must not miss)."""
    now = now or clock.now()
    with lease.atomic():
        draft = Draft.read(lease, locked=True)
        paused = draft.workflow_pause(step_name)  # a supervisor's pause of the workflow or the step
        if pausing(draft.run) or paused is not None:  # an operator asked to pause it: no message is queued
            pause_checkpoint(draft, now, paused=None if pausing(draft.run) else paused)
            lease.commit(draft.checkpoints)
            message = None
        else:
            message = _enqueued(lease, draft, step_name, intent, request_hash, now)
    if message is None:
        raise paused_error(draft)  # once the pause is committed
    dispatch.enqueue_message(message.pk)
    return message


def _enqueued(
    lease: Lease, draft: Draft, step_name: str, intent: dict[str, Any], request_hash: str, now: datetime
) -> OutboxMessage:
    step = draft.step(step_name)
    # The payload is what the publisher calls the step with: the redacted intent, as the
    # step's own checkpoint. A step gets its credentials from settings, never its intent.
    payload = _redacted(draft.run, intent)
    message = OutboxMessage.objects.create(
        run_id=lease.run_pk,
        step_name=step_name,
        idempotency_key=step.idempotency_key,
        payload=payload,
        created_at=now,
        updated_at=now,
    )

    def body(change: _Change) -> None:
        step.state = _check(STEP_TRANSITIONS, "succeed", step.state, "step")
        step.remote_ref = f"outbox:{message.pk}"
        step.result = {"outbox_id": message.pk, "delivered": False}
        fields = _record_attempt(step, payload, request_hash, now)
        change.save_step(step, ["state", "remote_ref", "result", *fields])

    _decide(draft, AuditAction.STEP_ENQUEUE, now, body, step_name=step_name)
    lease.commit(draft.checkpoints)
    return message


@dataclass(frozen=True)
class OutboxClaim:
    pk: int
    owner: str
    generation: int
    # When the latest attempt whose outcome is unknown was sent (None: no earlier attempt may
    # have delivered the message unbeknown to us)
    settle_from: datetime | None = None


def outbox_due(now: datetime, owner: str | None = None) -> Q:
    """Messages due for a delivery attempt by ``owner`` (None: any publisher): not of a run
    reserved for another executor (``run_start(reserve=…)``), which delivers them itself."""
    due = Q(next_attempt_at__isnull=True) | Q(next_attempt_at__lte=now)
    unclaimed = Q(claimed_until__isnull=True) | Q(claimed_until__lte=now)
    free = Q(run__reserved_for__isnull=True) | Q(run__reserved_until__lte=now)
    if owner is not None:
        free |= Q(run__reserved_for=owner)
    return Q(state=OutboxState.PENDING) & due & unclaimed & free


def locked_rows(qs):
    """``qs`` locked for update, skipping locked rows where the database can: only its own
    table's rows, not those of the tables it joins to filter."""
    of = ("self",) if connection.features.has_select_for_update_of else ()
    return qs.select_for_update(skip_locked=connection.features.has_select_for_update_skip_locked, of=of)


def outbox_claim(*, pk: int, owner: str | None = None, now: datetime | None = None) -> OutboxClaim | None:
    """Take one due outbox row for a delivery attempt (counted before the call, like a
    step's intent checkpoint), or None if it is not due or another publisher holds it."""
    now = now or clock.now()
    with transaction.atomic():
        owner = owner or default_owner()
        # Only a message of a run whose version this process has: its step is the one to deliver it.
        mine = registry.deployed_filter(prefix="run__")
        message = locked_rows(OutboxMessage.objects.filter(outbox_due(now, owner), mine, pk=pk)).first()
        if message is None:
            return None
        _settle_from_lost_publisher(message)
        message.attempts += 1
        message.claimed_by = owner
        message.claimed_until = now + lease_duration()
        message.claim_generation += 1
        message.dispatched_at = None
        message.last_attempt_at = now
        message.updated_at = now
        fields = ["attempts", "claimed_by", "claimed_until", "claim_generation", "dispatched_at", "updated_at"]
        message.save(update_fields=[*fields, "last_attempt_at", "settle_from"])
        return OutboxClaim(
            pk=message.pk,
            owner=message.claimed_by,
            generation=message.claim_generation,
            settle_from=message.settle_from,
        )


def _settle_from_lost_publisher(message: OutboxMessage) -> bool:
    """A claim still set when the row is taken again means its publisher was lost before it
    recorded an outcome: that attempt's request may be in flight still, and commit until its
    in-flight window ends, so the window counts from it. Returns whether it was so."""
    if not message.claimed_by:
        return False
    message.settle_from = message.last_attempt_at
    return True


def _locked_outbox(claim: OutboxClaim) -> tuple[WorkflowRun, OutboxMessage]:
    run_pk = OutboxMessage.objects.filter(pk=claim.pk).values_list("run_id", flat=True).first()
    run = WorkflowRun.objects.select_for_update().get(pk=run_pk)  # lock order: run, step, outbox
    message = (
        OutboxMessage.objects.select_for_update()
        .filter(pk=claim.pk, claim_generation=claim.generation, state=OutboxState.PENDING)
        .first()
    )
    if message is None:
        raise LeaseLost(f"outbox claim {claim.generation} on {claim.pk} is no longer held")
    return run, message


def _wake(run: WorkflowRun, now: datetime) -> None:
    """Make a waiting run due now (it may be waiting for this delivery)."""
    if run.state in (RunState.WAITING, RunState.COMPENSATING) and not _live_lease(run, now):
        run.next_wake_at = now
        _save_run(run, ["next_wake_at"], now)
        dispatch.enqueue_run(run.pk)


def outbox_delivered(*, claim: OutboxClaim, outcome: Outcome, how: str, now: datetime | None = None) -> None:
    """Record the provider's message id on the outbox row and on its step."""
    now = now or clock.now()
    with transaction.atomic():
        run, message = _locked_outbox(claim)
        step = StepExecution.objects.select_for_update().get(run=run, step_name=message.step_name)
        before = {"outbox": message.state, "remote_ref": step.remote_ref}
        message.state = OutboxState.DELIVERED
        message.provider_ref = redact_text(outcome.remote_ref)
        message.delivered_at = now
        message.claimed_by, message.claimed_until, message.next_attempt_at = "", None, None
        message.updated_at = now
        message.save(
            update_fields=[
                "state",
                "provider_ref",
                "delivered_at",
                "claimed_by",
                "claimed_until",
                "next_attempt_at",
                "updated_at",
            ]
        )
        step.remote_ref = message.provider_ref
        step.result = {**(_redacted(run, outcome.result) or {}), "outbox_id": message.pk, "delivered": True}
        _save_step(step, ["remote_ref", "result"], now)
        _save_run(run, [], now)  # a step changed: an executor holding the run reads it again
        _audit(
            run,
            AuditAction.OUTBOX_DELIVERED,
            actor=None,
            step_name=message.step_name,
            reason=how,
            before=before,
            after={"outbox": message.state, "remote_ref": step.remote_ref, "attempts": message.attempts, "how": how},
            now=now,
        )
        _wake(run, now)


def outbox_failed_attempt(*, claim: OutboxClaim, error: StepError, spec: StepSpec, now: datetime | None = None) -> str:
    """A delivery attempt failed. Transient errors and unknown outcomes are retried within the
    step's budget (the next attempt looks the message up first); a permanent error or an
    exhausted budget stops the row as ``failed`` and wakes the run, which goes to review."""
    now = now or clock.now()
    with transaction.atomic():
        run, message = _locked_outbox(claim)
        before = {"outbox": message.state, "attempts": message.attempts}
        message.last_error_kind = error.kind
        message.last_error = _error_text(error, 4000)
        message.claimed_by, message.claimed_until = "", None
        unknown = error.kind == ErrorKind.UNKNOWN_OUTCOME
        if unknown:
            message.settle_from = message.last_attempt_at  # it may have been delivered: look first
        retryable = unknown or spec.retry.retries(error.kind)
        elapsed = (now - (message.budget_started_at or message.created_at)).total_seconds()
        as_retry = TransientError(error.message, retry_after=error.retry_after)
        attempt = message.attempts - message.budget_start_attempt
        delay = spec.retry.next_delay(attempt, as_retry, elapsed=elapsed) if retryable else None
        if unknown and spec.in_flight_bound() is None:
            delay = None  # no look-up can ever prove it was not delivered: an operator decides
        if delay is None:
            message.state = OutboxState.FAILED
            message.next_attempt_at = None
            action = AuditAction.OUTBOX_FAIL
        else:
            message.next_attempt_at = now + timedelta(seconds=delay)
            action = AuditAction.OUTBOX_RETRY
        message.updated_at = now
        message.save(
            update_fields=[
                "state",
                "last_error_kind",
                "last_error",
                "claimed_by",
                "claimed_until",
                "next_attempt_at",
                "settle_from",
                "updated_at",
            ]
        )
        _audit(
            run,
            action,
            actor=None,
            step_name=message.step_name,
            reason=_error_text(error, 1000),
            before=before,
            after={"outbox": message.state, "attempts": message.attempts, "error_kind": error.kind},
            now=now,
        )
        if action == "outbox_fail":
            _wake(run, now)
        return action


def outbox_await_settle(
    *, claim: OutboxClaim, until: datetime, sent_at: datetime | None, now: datetime | None = None
) -> None:
    """The look-up before a new delivery attempt found nothing, but an earlier attempt's request
    may still commit until ``until`` (rule 7): send nothing now, look again then. The claim
    counted a delivery attempt that was not made: it is given back."""
    now = now or clock.now()
    with transaction.atomic():
        run, message = _locked_outbox(claim)
        before = {"outbox": message.state, "attempts": message.attempts}
        message.attempts -= 1
        message.claimed_by, message.claimed_until = "", None
        message.next_attempt_at = until
        message.last_error = f"looking it up again {in_flight_text(sent_at, until)}"
        message.updated_at = now
        message.save(
            update_fields=["attempts", "claimed_by", "claimed_until", "next_attempt_at", "last_error", "updated_at"]
        )
        if run.state == RunState.WAITING and not _live_lease(run, now):
            # The run waits for this delivery: its status says what it waits for, and it wakes then.
            run.status_reason = f"{message.step_name}: message outcome unknown; {message.last_error}"
            run.next_wake_at = until
            _save_run(run, ["status_reason", "next_wake_at"], now)
        _audit(
            run,
            AuditAction.OUTBOX_SETTLE_WAIT,
            actor=None,
            step_name=message.step_name,
            reason=message.last_error,
            before=before,
            after={"outbox": message.state, "attempts": message.attempts, "in_flight_until": until.isoformat()},
            now=now,
        )


def outbox_unresolved(*, claim: OutboxClaim, reason: str, now: datetime | None = None) -> None:
    """The look-up found nothing and the step has no in-flight bound: an earlier attempt may
    still be delivered at any time, so no attempt is made; the row stops as ``failed`` and
    the run goes to an operator."""
    now = now or clock.now()
    with transaction.atomic():
        run, message = _locked_outbox(claim)
        before = {"outbox": message.state, "attempts": message.attempts}
        message.attempts -= 1
        message.state = OutboxState.FAILED
        message.claimed_by, message.claimed_until, message.next_attempt_at = "", None, None
        message.last_error_kind = ErrorKind.UNKNOWN_OUTCOME
        message.last_error = reason
        message.updated_at = now
        message.save(
            update_fields=[
                "attempts",
                "state",
                "claimed_by",
                "claimed_until",
                "next_attempt_at",
                "last_error_kind",
                "last_error",
                "updated_at",
            ]
        )
        _audit(
            run,
            AuditAction.OUTBOX_FAIL,
            actor=None,
            step_name=message.step_name,
            reason=reason,
            before=before,
            after={"outbox": message.state, "attempts": message.attempts, "error_kind": message.last_error_kind},
            now=now,
        )
        _wake(run, now)


def outbox_cancel(*, lease: Lease, step_name: str, now: datetime | None = None) -> OutboxMessage:
    """Compensating an undelivered message: stop its delivery. Refused (the row is returned
    unchanged) while a publisher holds it."""
    now = now or clock.now()
    with transaction.atomic():
        run = _locked_run(lease)
        message = OutboxMessage.objects.select_for_update().get(run=run, step_name=step_name)
        claimed = message.claimed_until is not None and message.claimed_until > now
        if message.state in (OutboxState.PENDING, OutboxState.FAILED) and not claimed:
            before = {"outbox": message.state}
            message.state = OutboxState.CANCELLED
            message.claim_generation += 1  # fences a publisher whose claim expired mid-call
            if _settle_from_lost_publisher(message):
                message.claimed_by, message.claimed_until = "", None
            message.next_attempt_at = None
            message.updated_at = now
            message.save(
                update_fields=[
                    "state",
                    "claim_generation",
                    "settle_from",
                    "claimed_by",
                    "claimed_until",
                    "next_attempt_at",
                    "updated_at",
                ]
            )
            _renew(run, now)
            _save_run(run, ["lease_expires_at"], now)
            _audit(
                run,
                AuditAction.OUTBOX_CANCEL,
                actor=None,
                step_name=step_name,
                before=before,
                after={"outbox": message.state, "attempts": message.attempts},
                now=now,
            )
        return message
