"""The engine's own measurements, as Prometheus counters and histograms (prometheus-client).

What is counted is what was committed: a transition's counter moves when its transaction
commits (``transaction.on_commit``), never for a transition that rolled back or whose fenced
write matched nothing. A call's duration is measured around the call itself.

Labels are bounded: a workflow's name, a declared step's name, an outcome, an error kind, a
guard's rule, an action's name, a role. Never a workflow id, a key or a user name.

With ``PROMETHEUS_MULTIPROC_DIR`` set (before the first import of prometheus_client), every
process — gunicorn's workers, Celery's, ``run_executor`` — writes its values to files there,
and ``/metrics`` adds them up (recovery.observability). ``RECOVERY_METRICS=0`` records nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from functools import partial
from typing import Any

from django.conf import settings
from django.db import transaction
from prometheus_client import Counter, Histogram

from recovery.actions import CALL_DECISIONS
from recovery.contract import metric_label
from recovery.states import AuditAction

STEP_ATTEMPTS = Counter(
    "recovery_step_attempts",
    "Step attempts by how they ended: succeeded, failed (with its error kind) or unknown.",
    ["workflow", "step", "outcome", "error_kind"],
)
STEP_DURATION = Histogram(
    "recovery_step_duration_seconds",
    "How long a step's call took (the call only, without the engine's checkpoints).",
    ["workflow", "step"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
SCHEDULE_TO_START = Histogram(
    "recovery_step_schedule_to_start_seconds",
    "From a run being due (started, woken, or its lease expired) to an executor claiming it.",
    ["workflow"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600),
)
UNKNOWN_OUTCOMES = Counter(
    "recovery_unknown_outcomes",
    "Step attempts whose outcome is unknown (the call may or may not have happened).",
    ["workflow", "step"],
)
RECONCILES = Counter(
    "recovery_reconciles",
    "Look-ups of unknown outcomes by result: happened, absent, wait (the request may still "
    "commit) or failed (the look-up itself failed).",
    ["workflow", "step", "result"],
)
LEASE_TAKEOVERS = Counter(
    "recovery_lease_takeovers",
    "Runs taken over from an executor whose lease expired (it died, hung or lost the database).",
    ["workflow"],
)
POLICY_REFUSALS = Counter(
    "recovery_policy_refusals",
    "Steps a guard refused before anything was written or sent, by the guard's rule.",
    ["workflow", "rule"],
)
ALERTS_SENT = Counter(
    "recovery_alerts_sent",
    "Alerts about stuck runs sent, by channel (webhook, email).",
    ["channel"],
)
WAIT_DURATION = Histogram(
    "recovery_wait_seconds",
    "How long a durable wait lasted: from the run reaching it to its event applied (outcome event; 0 for an "
    "event that came first) or to its deadline (outcome deadline: what the wait declares, or a timer's time); "
    "for a tool call held for a person (step: the tool), to its decision (approve, edit, reject, answer).",
    ["workflow", "step", "outcome"],
    buckets=(1, 10, 60, 300, 900, 3600, 4 * 3600, 86400, 3 * 86400, 7 * 86400, 30 * 86400),
)
EVENTS_RECEIVED = Counter(
    "recovery_events_received",
    "Events delivered to runs, by event and whether they came late (after their wait ended: recorded, not applied).",
    ["workflow", "event", "late"],
)
OPERATOR_ACTIONS = Counter(
    "recovery_operator_actions",
    "Operator actions performed (console, bulk, manage.py recover, approved requests), by role.",
    ["action", "role"],
)


def _enabled() -> bool:
    return settings.RECOVERY_METRICS


def outcome(action: str, after: Mapping[str, Any]) -> tuple[str, str] | None:
    """What a transition's audit action (with the state it left, ``after``) says of a step's
    call: ``("attempt", succeeded | failed | unknown)``, ``("reconcile", happened | absent |
    wait | failed)``, ``("refusal", "refused")``; None for any other transition. An outbox
    step's delivery is its call: a message found delivered by its look-up is a reconcile."""
    match action:
        case AuditAction.STEP_SUCCEED:
            return "attempt", "succeeded"
        case AuditAction.STEP_FAIL:
            return "attempt", "failed"
        case AuditAction.STEP_UNKNOWN:
            return "attempt", "unknown"
        case AuditAction.OUTBOX_RETRY | AuditAction.OUTBOX_FAIL:
            # a delivery attempt (or its look-up) failed, or its answer was lost
            return "attempt", "unknown" if after.get("error_kind") == "unknown_outcome" else "failed"
        case AuditAction.OUTBOX_DELIVERED:
            return ("attempt", "succeeded") if after.get("how") == "delivered" else ("reconcile", "happened")
        case AuditAction.RECONCILED:
            return "reconcile", "happened"
        case AuditAction.RECONCILED_ABSENT:
            return "reconcile", "absent"
        case AuditAction.RECONCILE_WAIT | AuditAction.OUTBOX_SETTLE_WAIT:
            return "reconcile", "wait"
        case AuditAction.RECONCILE_DEFERRED:
            return "reconcile", "failed"
        case AuditAction.POLICY_REFUSED:
            return "refusal", "refused"
    return None


def _record(workflow: str, action: str, step: str, after: Mapping[str, Any], found: tuple[str, str] | None) -> None:
    if action == AuditAction.LEASE_TAKEOVER:
        LEASE_TAKEOVERS.labels(workflow).inc()
        return
    kind, result = found
    if kind == "attempt":
        STEP_ATTEMPTS.labels(workflow, step, result, after.get("error_kind", "") if result != "succeeded" else "").inc()
        if result == "unknown":
            UNKNOWN_OUTCOMES.labels(workflow, step).inc()
    elif kind == "reconcile":
        RECONCILES.labels(workflow, step, result).inc()
    else:
        POLICY_REFUSALS.labels(workflow, (after.get("refusal") or {}).get("rule", "")).inc()


def _waited(workflow: str, action: str, step: str, after: Mapping[str, Any]) -> None:
    if action == AuditAction.EVENT_RECEIVED:
        EVENTS_RECEIVED.labels(workflow, after.get("event", ""), "true" if after.get("late") else "false").inc()
        return
    # a held tool call's decision (its outcome: approve, edit, reject, answer), labelled by its tool
    ended = after.get("decision") or ("event" if action == AuditAction.EVENT_APPLIED else "deadline")
    WAIT_DURATION.labels(workflow, metric_label(step), ended).observe(after.get("waited_seconds", 0.0))


# A held tool call's decisions (recovery.engine.transitions.call_approvals): time to decision.
DECISION_ACTIONS = frozenset(CALL_DECISIONS)
WAIT_ACTIONS = frozenset({AuditAction.EVENT_RECEIVED, AuditAction.EVENT_APPLIED, AuditAction.WAIT_TIMEOUT}) | (
    DECISION_ACTIONS
)


def transition(workflow: str, action: str, step: str, after: Mapping[str, Any]) -> None:
    """A transition wrote its audit event ``action``: count it once its transaction commits."""
    if action in WAIT_ACTIONS:
        if _enabled():
            transaction.on_commit(partial(_waited, workflow, action, step, after))
        return
    found = outcome(action, after)
    if (found is not None or action == AuditAction.LEASE_TAKEOVER) and _enabled():
        transaction.on_commit(partial(_record, workflow, action, step, after, found))


def claimed(workflow: str, *, due_at: datetime | None, now: datetime) -> None:
    """An executor claimed a run that was due at ``due_at``."""
    if due_at is not None and _enabled():
        waited = max(0.0, (now - due_at).total_seconds())
        transaction.on_commit(partial(SCHEDULE_TO_START.labels(workflow).observe, waited))


def call_took(workflow: str, step: str, seconds: float) -> None:
    if _enabled():
        STEP_DURATION.labels(workflow, step).observe(seconds)


def operator_action(action: str, role: str) -> None:
    """An operator's action was performed: count it once its transaction commits."""
    if _enabled():
        transaction.on_commit(partial(OPERATOR_ACTIONS.labels(action, role).inc))


def alert_sent(channel: str) -> None:
    """An alert was sent through ``channel``: count it once its transaction commits."""
    if _enabled():
        transaction.on_commit(partial(ALERTS_SENT.labels(channel).inc))
