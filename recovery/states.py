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
