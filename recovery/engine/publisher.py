"""The outbox publisher: delivers each committed outbox message effectively once. A message whose
earlier attempt may have been delivered is looked up by its key before it is sent again, and
sent again only once that attempt can no longer commit (the in-flight window)."""

from __future__ import annotations

import logging
from datetime import datetime

from django.db import InterfaceError, OperationalError

from recovery import clock, registry
from recovery.engine import failpoints, transitions
from recovery.engine.calls import as_outcome, database_unavailable, invoke, working_on
from recovery.errors import LeaseLost
from recovery.models import OutboxMessage, StepExecution, StepState
from recovery.workflow import StepContext, StepSpec, workflow_of

log = logging.getLogger("recovery.executor")


def publish(outbox_pk: int, *, owner: str | None = None) -> str | None:
    """One delivery attempt of one outbox row, effectively once: if an earlier attempt may
    have sent it (its answer lost, or its publisher killed), look the message up by its key
    before sending. Returns the row's state afterwards, or None if it was not claimable.
    Raises DatabaseUnavailable when the database cannot be reached (the claim then expires)."""
    try:
        claim = transitions.outbox_claim(pk=outbox_pk, owner=owner)
        if claim is None:
            return None
        _deliver(claim)
        return _outbox_state(outbox_pk)
    except (OperationalError, InterfaceError) as exc:
        raise database_unavailable(exc, f"outbox message {outbox_pk}") from exc


def _deliver(claim: transitions.OutboxClaim) -> None:
    message = OutboxMessage.objects.select_related("run").get(pk=claim.pk)
    run = message.run
    name = message.step_name
    with working_on(
        f"deliver {name}",
        run,
        parent=run.traceparent or "",
        step=name,
        attempt=message.attempts,
        key=message.idempotency_key,
    ):
        _deliver_bound(claim, message, run)


def _deliver_bound(claim: transitions.OutboxClaim, message: OutboxMessage, run) -> None:
    spec = workflow_of(run).get_step(message.step_name)
    rows = list(StepExecution.objects.filter(run=run).values_list("step_name", "state", "result", "key_version"))
    results = {name: result for name, state, result, _ in rows if state == StepState.SUCCEEDED}
    ctx = StepContext(
        workflow_id=run.workflow_id,
        input=run.input,
        step=message.step_name,
        idempotency_key=message.idempotency_key,
        results=results,
        intent=message.payload,
        key_versions={name: version for name, _, _, version in rows},
    )
    try:
        if message.attempts > 1:
            found, error = invoke(spec.lookup_fn, ctx, claim=claim)
            if error is not None:
                transitions.outbox_failed_attempt(claim=claim, error=error, spec=spec)
                return
            if found is not None:
                transitions.outbox_delivered(
                    claim=claim, outcome=as_outcome(found), how="found by key after a lost answer"
                )
                return
            if claim.settle_from is not None and not _may_send_again(claim, spec):
                return
        raw, error = invoke(spec.call, ctx, claim=claim, point=message.step_name, timed=run.workflow_name)
        if error is None:
            transitions.outbox_delivered(claim=claim, outcome=as_outcome(raw), how="delivered")
        else:
            transitions.outbox_failed_attempt(claim=claim, error=error, spec=spec)
        failpoints.hit(message.step_name, "after_outcome")
    except LeaseLost as exc:
        log.warning("stopped publishing: %s", exc)


def _may_send_again(claim: transitions.OutboxClaim, spec: StepSpec) -> bool:
    """The look-up missed; an earlier attempt (sent at ``claim.settle_from``) got no answer.
    Send again only once that request can no longer be delivered; until then, look again at
    the window's end (with no bound, never: an operator decides)."""
    until = spec.in_flight_until(claim.settle_from)
    if until is None:
        transitions.outbox_unresolved(
            claim=claim,
            reason=(
                f"{spec.name}: a delivery attempt's outcome is unknown, the look-up found nothing, and the "
                "receiver may still deliver it at any time (no in-flight bound): an operator must check"
            ),
        )
        return False
    if clock.now() < until:
        transitions.outbox_await_settle(claim=claim, until=until, sent_at=claim.settle_from)
        return False
    return True


def _outbox_state(pk: int) -> str | None:
    return OutboxMessage.objects.filter(pk=pk).values_list("state", flat=True).first()


def due_outbox_ids(*, now: datetime | None = None, limit: int = 100) -> list[int]:
    now = now or clock.now()
    qs = OutboxMessage.objects.filter(transitions.outbox_due(now), registry.deployed_filter(prefix="run__"))
    qs = qs.order_by("next_attempt_at", "pk")
    return list(qs.values_list("pk", flat=True)[:limit])


def publish_due(*, owner: str | None = None, limit: int = 100) -> int:
    """Attempt every outbox row due now, once. Returns how many were attempted."""
    return sum(publish(pk, owner=owner) is not None for pk in due_outbox_ids(limit=limit))
