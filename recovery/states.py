"""The words a run's life is told in: the states of a run and of a step, and why a run is stuck.
The models store them, the console and the metrics show them, and a workflow's author names the
stuck causes (``Workflow(stuck_after=…)``), so they live here, below all of them: no model, no
query (``recovery.counts`` holds the queries that find each stuck cause)."""

from __future__ import annotations

from django.db import models


class RunState(models.TextChoices):
    PENDING = "pending"
    RUNNING = "running"
    WAITING = "waiting"  # a retry is scheduled
    NEEDS_REVIEW = "needs_review"
    COMPLETED = "completed"
    FAILED = "failed"
    PAUSED = "paused"  # an operator paused it: no new attempt starts until it is unpaused
    COMPENSATING = "compensating"
    COMPENSATED = "compensated"
    COMPENSATION_FAILED = "compensation_failed"
    TERMINATED = "terminated"


# The states an executor takes a run forward from by itself (the claim, run_in_progress_idx), and
# those of a finished run.
IN_PROGRESS_RUN_STATES = [RunState.PENDING, RunState.WAITING, RunState.COMPENSATING, RunState.RUNNING]
TERMINAL_RUN_STATES = frozenset({RunState.COMPLETED, RunState.COMPENSATED, RunState.TERMINATED})
AGENT_STOPPED = "agent_stopped"  # the rule of the hold an operator's stop puts on an agent step (its refusal)


class StepState(models.TextChoices):
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    UNKNOWN = "unknown"
    COMPENSATING = "compensating"
    COMPENSATED = "compensated"
    COMPENSATION_FAILED = "compensation_failed"
    SKIPPED = "skipped"
    WAITING = "waiting"  # a wait step, for its event or its time (recovery.waiting): no worker held


class StuckCause(models.TextChoices):
    """Why a person must act on a run, or something is wrong with it, in the order the console
    lists them. ``recovery.counts.stuck_causes`` says how each is found."""

    NEEDS_REVIEW = "needs_review", "Needs review"
    UNKNOWN = "unknown", "Unknown outcome"
    LEASE_EXPIRED = "lease_expired", "Lease expired"
    EXHAUSTED = "exhausted", "Retries exhausted"
    AGENT_STOPPED = "agent_stopped", "Agent stopped"
    FAILED_WITH_EFFECTS = "failed_with_effects", "Failed, effects stand"
    COMPENSATION_FAILED = "compensation_failed", "Compensation failed"
    POLICY_REFUSED = "policy_refused", "Policy refused"
    MODEL_OUTPUT = "model_output", "Paused for model output"
    MESSAGE_UNDELIVERED = "message_undelivered", "Message undelivered"
    APPROVAL = "approval", "Waiting for approval"
    VERSION_NOT_DEPLOYED = "version_not_deployed", "Version not deployed"
    NO_EXECUTOR = "no_executor", "No executor"


STUCK_LABELS: dict[str, str] = dict(StuckCause.choices)  # cause -> its label, in the console's order


class AuditAction(models.TextChoices):
    """What an audit event records, as an auditor reads it: every name the engine, the alerts
    and four-eyes write. An operator action (recovery.actions) is audited under its own name and
    label unless its transition names one of these (``acting(audit_as=…)``): ``resolve`` for both
    answers to an unknown outcome, ``policy_override`` for accepting a refusal, and so on."""

    # a run's life under an executor
    START = "start", "run started"
    CLAIM = "claim", "claimed by an executor"
    LEASE_TAKEOVER = "lease_takeover", "taken over after a lease expired"
    RELEASE = "release", "released by the executor"
    WAIT = "wait", "waiting to try again"
    REVIEW = "review", "stopped for review"
    COMPLETE = "complete", "run completed"
    PAUSE_REACHED = "pause_reached", "paused at a step boundary"
    # a step's call
    STEP_BEGIN = "step_begin", "attempt begun"
    STEP_SUCCEED = "step_succeed", "step succeeded"
    STEP_FAIL = "step_fail", "attempt failed"
    STEP_UNKNOWN = "step_unknown", "outcome unknown"
    DECISION_REUSED = "decision_reused", "accepted decision reused"
    POLICY_REFUSED = "policy_refused", "refused by a guard"
    CHECK_DEFERRED = "check_deferred", "guard could not check; tried again later"
    RECONCILED = "reconciled", "found at the receiver"
    RECONCILED_ABSENT = "reconciled_absent", "not found at the receiver"
    RECONCILE_WAIT = "reconcile_wait", "look-up waits for the in-flight window"
    RECONCILE_DEFERRED = "reconcile_deferred", "look-up failed; tried again later"
    # an outbox step's message
    STEP_ENQUEUE = "step_enqueue", "message queued"
    OUTBOX_DELIVERED = "outbox_delivered", "message delivered"
    OUTBOX_RETRY = "outbox_retry", "delivery failed; tried again later"
    OUTBOX_FAIL = "outbox_fail", "delivery failed"
    OUTBOX_CANCEL = "outbox_cancel", "delivery cancelled"
    OUTBOX_SETTLE_WAIT = "outbox_settle_wait", "delivery look-up waits for the in-flight window"
    # an agent's journal
    AGENT_TURN_ADD = "agent_turn_add", "agent turn added"
    AGENT_TURN = "agent_turn", "agent turn recorded"
    # compensation
    COMPENSATION_BEGIN = "compensation_begin", "compensation begun"
    COMPENSATION_SUCCEED = "compensation_succeed", "compensated"
    COMPENSATION_FAIL = "compensation_fail", "compensation failed"
    COMPENSATION_REFUSED = "compensation_refused", "compensation refused: not the run's own object"
    COMPENSATION_RETRY = "compensation_retry", "compensation failed; tried again later"
    COMPENSATION_DONE = "compensation_done", "compensation finished"
    # durable waits (recovery.waiting)
    WAIT_BEGIN = "wait_begin", "waiting for an event or a time"
    EVENT_RECEIVED = "event_received", "event received"
    EVENT_APPLIED = "event_applied", "event applied"
    WAIT_TIMEOUT = "wait_timeout", "wait timed out"
    WAIT_SKIPPED = "wait_skipped", "not needed: went on without waiting"
    CALL_HELD = "call_held", "tool call waits for a person's approval"
    APPROVAL_ESCALATED = "approval_escalated", "escalated at its deadline"
    # operators' actions audited under a name of their own
    RESOLVE = "resolve", "outcome settled by an operator"
    POLICY_OVERRIDE = "policy_override", "refusal overridden"
    DECISION_SUPERSEDE = "decision_supersede", "decision replaced"
    AGENT_STOP = "agent_stop", "agent stopped"
    AGENT_FORK = "agent_fork", "agent forked from a turn"
    ALERT_SNOOZED = "alert_snoozed", "alerts snoozed"
    # alerts and four-eyes
    ALERT_RAISED = "alert_raised", "alert raised"
    ALERT_RESOLVED = "alert_resolved", "alert resolved"
    ALERT_SENT = "alert_sent", "alert sent"
    ALERT_FAILED = "alert_failed", "alert delivery failed"
    APPROVAL_REQUEST = "approval_request", "approval requested"
    APPROVAL_GRANT = "approval_grant", "approval granted"
    APPROVAL_REJECT = "approval_reject", "approval turned down"


# Failed or unknown call attempts (the dashboard's failure counts; audit_failures_at_idx).
FAILURE_ACTIONS = [AuditAction.STEP_FAIL.value, AuditAction.STEP_UNKNOWN.value, AuditAction.OUTBOX_RETRY.value]
# The executor's routine events: logged at DEBUG (recovery.engine.observed).
ROUTINE_ACTIONS = frozenset(
    {
        AuditAction.CLAIM,
        AuditAction.STEP_BEGIN,
        AuditAction.STEP_SUCCEED,
        AuditAction.STEP_ENQUEUE,
        AuditAction.DECISION_REUSED,
        AuditAction.COMPLETE,
        AuditAction.WAIT,
        AuditAction.RELEASE,
    }
)


def pause_scope(workflow: str, step_name: str = "") -> str:
    """What a pause of a workflow or of one of its steps covers, as every surface says it:
    "workflow invoice", "step post_ledger_entry of invoice" (WorkflowPause.scope)."""
    return f"step {step_name} of {workflow}" if step_name else f"workflow {workflow}"
