"""The engine's durable state. Only ``recovery.engine.transitions`` changes a run or a step."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from simple_history.models import HistoricalRecords

from recovery.errors import ErrorKind
from recovery.fields import CanonicalJSONField
from recovery.states import (  # noqa: F401  (re-exported: the words a run's life is told in, recovery.states)
    AGENT_STOPPED,
    FAILURE_ACTIONS,
    IN_PROGRESS_RUN_STATES,
    TERMINAL_RUN_STATES,
    AuditAction,
    RunState,
    StepState,
    StuckCause,
)

from .incidents import RunRestart, WorkflowPause  # noqa: F401  (the records of incidents: pauses and restarts)
from .waits import RunEvent  # noqa: F401  (events delivered to runs: what durable waits wait for)


class WorkflowRun(models.Model):
    workflow_id = models.CharField(max_length=255, unique=True)
    workflow_name = models.CharField(max_length=100)
    workflow_version = models.PositiveIntegerField()
    state = models.CharField(max_length=24, choices=RunState.choices, default=RunState.PENDING)
    current_step = models.CharField(max_length=100, blank=True)
    input = models.JSONField()
    input_hash = models.CharField(max_length=64)
    status_reason = models.TextField(blank=True)
    incident = models.TextField(blank=True)  # marked by compensations that had to correct something visible
    # Set when the run fails: a completed step of it wrote elsewhere (its workflow's declaration
    # says which steps write), so the failed run waits for a person (compensate, or terminate to
    # keep them): the stuck cause "failed, effects stand", counted from a small partial index.
    # Nullable (None: never failed) so that SQLite adds the column in place: rebuilding the runs
    # table would break the triggers that name it (the audit chain's, the run search's).
    effects_stand = models.BooleanField(null=True, blank=True, default=None)
    lease_owner = models.CharField(max_length=200, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    lease_generation = models.BigIntegerField(default=0)
    next_wake_at = models.DateTimeField(null=True, blank=True)
    # When a task for this run was last put on the broker; a claim clears it. The sweeper
    # sends another only once it is RECOVERY_REDISPATCH_SECONDS old (presumed lost).
    dispatched_at = models.DateTimeField(null=True, blank=True)
    # A run started for one executor (``run_start(reserve=…)``): no other executor claims it
    # before ``reserved_until`` (real time), unless the reservation is released first. A script
    # that drives runs itself (the demo's seed) keeps the running executors off them.
    # Nullable: SQLite adds the columns in place (see effects_stand).
    reserved_for = models.CharField(max_length=200, null=True, blank=True)
    # The W3C traceparent of the span its start was part of (recovery.tracing): every advance of the
    # run continues that trace. Empty (null) when tracing is off.
    traceparent = models.CharField(max_length=55, null=True, blank=True)
    reserved_until = models.DateTimeField(null=True, blank=True)
    # An operator's pause (recovery.engine.transitions.pauses): who, when, why. Set while the run
    # is paused, or (held by a live executor) until that executor reaches its next step boundary;
    # cleared by unpausing. Nullable: SQLite adds the columns in place (see effects_stand).
    paused_at = models.DateTimeField(null=True, blank=True)
    paused_by = models.CharField(max_length=150, null=True, blank=True)
    pause_reason = models.TextField(null=True, blank=True)
    # The workflow's (or one step's) pause that stopped the run (WorkflowPause), once reached: unpausing the
    # workflow releases the runs it holds. Unindexed: every checkpoint rewrites the run's indexes.
    workflow_pause = models.ForeignKey(
        "WorkflowPause", null=True, blank=True, on_delete=models.PROTECT, related_name="+", db_index=False
    )
    # Bumped by every transition that saves the run, which every change of one of its steps
    # does too: while it is what an executor last wrote, the executor's copy of the run and
    # its steps is current and it need not read them again.
    revision = models.BigIntegerField(default=0)
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()
    # Versions saved by people (operators); starts and the executor's changes are in the audit trail.
    history = HistoricalRecords(
        excluded_fields=["lease_expires_at", "dispatched_at", "revision", "reserved_for", "reserved_until"]
    )

    class Meta:
        indexes = [
            models.Index(fields=["state", "next_wake_at"], name="run_due_idx"),
            models.Index(fields=["state", "id"], name="run_state_id_idx"),  # a state's runs, newest first
            models.Index(fields=["workflow_name", "state"], name="run_workflow_state_idx"),
            models.Index(
                fields=["id"], name="run_failed_effects_idx", condition=models.Q(state="failed", effects_stand=True)
            ),
            # Executors claim the oldest due run: a short walk over the runs still in progress,
            # however many have finished.
            models.Index(
                fields=["id"],
                name="run_in_progress_idx",
                condition=models.Q(state__in=IN_PROGRESS_RUN_STATES),
            ),
            # The claim's walk by id over the runs in progress but not waiting: a waiting run (for
            # its retry, or for days for an event) is found by run_due_idx once its time has come,
            # never walked before (transitions.leases._pick_in_two_walks).
            models.Index(
                fields=["id"],
                name="run_active_idx",
                condition=models.Q(state__in=["pending", "compensating", "running"]),
            ),
        ]

    def __str__(self) -> str:
        return self.workflow_id

    @property
    def business_key(self) -> str:
        """The business event's own key: the workflow id without the workflow's name."""
        return self.workflow_id.split(":", 1)[1] if ":" in self.workflow_id else self.workflow_id


class RunSearch(models.Model):
    """A run's workflow id, for the console's substring search (migration 0019): written once, by
    a database trigger, when the run is inserted — so that the run's own row, rewritten by every
    checkpoint, carries no trigram index (pg_trgm's GIN on PostgreSQL is on this table)."""

    run = models.OneToOneField(WorkflowRun, on_delete=models.CASCADE, primary_key=True, related_name="+")
    workflow_id = models.CharField(max_length=255)

    class Meta:
        db_table = "recovery_runsearch"


class StepExecution(models.Model):
    # Indexed by one_execution_per_step (run, step_name): every index here is written again
    # by each checkpoint (a step's state changes, so its updates are never HOT).
    run = models.ForeignKey(WorkflowRun, on_delete=models.CASCADE, related_name="steps", db_index=False)
    step_name = models.CharField(max_length=100)
    position = models.PositiveSmallIntegerField()
    state = models.CharField(max_length=24, choices=StepState.choices, default=StepState.PENDING)
    key_version = models.PositiveIntegerField()
    # Unique (step_idempotency_key_unique): an adapter's key -> remote object record can never
    # be written twice. A constraint, not unique=True, which on PostgreSQL adds a second
    # (pattern) index that nothing uses: keys are looked up whole.
    idempotency_key = models.CharField(max_length=64)
    intent = models.JSONField(null=True, blank=True)  # saved (committed) before the call
    request_hash = models.CharField(max_length=64, blank=True)  # hash of the intent sent with the key
    remote_ref = models.CharField(max_length=255, blank=True)  # saved as soon as the call returns
    result = models.JSONField(null=True, blank=True)
    attempts = models.PositiveIntegerField(default=0)
    budget_start_attempt = models.PositiveIntegerField(default=0)  # attempts before the current budget
    budget_started_at = models.DateTimeField(null=True, blank=True)
    format_failures = models.PositiveIntegerField(default=0)  # schema-invalid model outputs
    reconcile_attempts = models.PositiveIntegerField(default=0)  # failed look-ups of an unknown outcome
    first_attempt_at = models.DateTimeField(null=True, blank=True)
    last_attempt_at = models.DateTimeField(null=True, blank=True)
    last_error_kind = models.CharField(max_length=24, choices=ErrorKind.choices, blank=True)
    last_error = models.TextField(blank=True)
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    # The compensation of this step's effect (rule 10), with its own key and evidence.
    compensation_attempts = models.PositiveIntegerField(default=0)
    compensation_ref = models.CharField(max_length=255, blank=True)
    compensation_result = models.JSONField(null=True, blank=True)
    compensation_restored = models.BooleanField(default=False)  # the previous state is truly back
    # When the latest compensation request was sent, while its outcome is unknown (its answer
    # was lost, or its executor died): it is not sent again before the in-flight bound has passed.
    compensation_sent_at = models.DateTimeField(null=True, blank=True)
    # A guard's refusal that holds the step (rule, message, values), until an operator
    # overrides it, supersedes the decision or the guard passes; nothing was sent for it.
    refusal = models.JSONField(null=True, blank=True)
    # Rules a supervisor overrode for this step (rule, by, reason, at): their guards no longer hold it.
    overrides = models.JSONField(default=list, blank=True)
    # A restart from a corrected input or intent (RunRestart): how many times the step was made
    # again under a new key (its key version is its declared one plus these; None: never), and the
    # intent's fields a supervisor corrected, laid over the intent the step builds. Nullable: SQLite
    # adds the columns in place.
    restarts = models.PositiveSmallIntegerField(null=True, blank=True)
    correction = models.JSONField(null=True, blank=True)
    # A tool call waiting for a person (recovery.waiting.ToolApproval), then decided: role, asked_at,
    # escalated_at; decision, by, at, reason, key, changes (transitions.call_approvals).
    approval = models.JSONField(null=True, blank=True)
    updated_at = models.DateTimeField()
    history = HistoricalRecords()

    class Meta:
        ordering = ["run", "position", "id"]
        constraints = [
            models.UniqueConstraint(fields=["run", "step_name"], name="one_execution_per_step"),
            models.UniqueConstraint(fields=["idempotency_key"], name="step_idempotency_key_unique"),
        ]
        indexes = [
            models.Index(fields=["remote_ref"], name="step_remote_ref_idx"),
            # stuck causes; with run_id, their counts never read the table
            models.Index(fields=["state", "last_error_kind"], name="step_state_kind_idx", include=["run"]),
        ]

    def __str__(self) -> str:
        return f"{self.run_id}:{self.step_name}"

    @property
    def order(self) -> tuple[int, int]:
        """Where the step stands in its run: its workflow position, then the order rows were
        written in (an agent's journal rows share their agent's position)."""
        return (self.position, self.pk or 0)


class DecisionState(models.TextChoices):
    ACCEPTED = "accepted"
    SUPERSEDED = "superseded"
    INVALID = "invalid"  # a schema-invalid proposal, kept for diagnosis


class ModelDecision(models.Model):
    run = models.ForeignKey(WorkflowRun, on_delete=models.CASCADE, related_name="decisions")
    step_name = models.CharField(max_length=100)
    version = models.PositiveIntegerField()  # 0 for invalid outputs
    state = models.CharField(max_length=12, choices=DecisionState.choices)
    schema_version = models.PositiveIntegerField()
    proposal = models.JSONField(null=True, blank=True)
    accepted = models.JSONField(null=True, blank=True)
    invalid_output = models.TextField(blank=True)
    validation_error = models.TextField(blank=True)
    superseded_reason = models.TextField(blank=True)
    created_at = models.DateTimeField()

    class Meta:
        ordering = ["run", "step_name", "created_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["run", "step_name", "version"],
                condition=~models.Q(state="invalid"),
                name="one_decision_per_version",
            ),
            models.UniqueConstraint(
                fields=["run", "step_name"],
                condition=models.Q(state="accepted"),
                name="one_accepted_decision_per_step",
            ),
        ]


_STATE_KEYS = {"run": RunState, "step": StepState}  # the audit's snapshot keys that hold a state


def _said(key: str, value):
    """A snapshot value as people read it: a state by its label, anything else as it is."""
    kind = _STATE_KEYS.get(key)
    return kind(value).label if kind is not None and value in kind.values else value


class AuditEvent(models.Model):
    """Append-only: one row per transition, written in the transition's transaction. The
    database refuses to update or delete one (triggers, recovery.engine.audit.chain), and chains each
    run's events by hash."""

    # Indexes cost every checkpoint: run is indexed by audit_run_id_idx, actor_user only where set.
    run = models.ForeignKey(WorkflowRun, on_delete=models.CASCADE, related_name="audit_events", db_index=False)
    step_name = models.CharField(max_length=100, blank=True)
    actor = models.CharField(max_length=150)  # a username, or "executor"
    actor_user = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT, db_index=False
    )
    action = models.CharField(max_length=50)  # an AuditAction, or an operator action's name (audit_label)
    reason = models.TextField(blank=True)
    # Canonical text (the export streams it as stored): see recovery.fields.
    before = CanonicalJSONField(default=dict)
    after = CanonicalJSONField(default=dict)
    at = models.DateTimeField()
    # Tamper evidence (recovery.engine.audit.chain): set by the database as the row is inserted, over
    # the event's content and the hash of the run's previous event. Never written by Python.
    prev_hash = models.CharField(max_length=64, blank=True, default="", db_default="", editable=False)
    hash = models.CharField(max_length=64, blank=True, default="", db_default="", editable=False)

    class Meta:
        ordering = ["run", "at", "id"]
        indexes = [
            models.Index(fields=["at", "id"], name="audit_at_id_idx"),  # the export's keyset
            # One run's events in chain order: the chain trigger finds a run's last event through
            # it at every insert, in one step however long the run's history.
            models.Index(fields=["run", "id"], name="audit_run_id_idx"),
            models.Index(
                fields=["actor_user"], name="audit_actor_user_idx", condition=models.Q(actor_user__isnull=False)
            ),
            # the dashboard's failures per hour
            models.Index(fields=["at"], name="audit_failures_at_idx", condition=models.Q(action__in=FAILURE_ACTIONS)),
        ]

    def changes(self) -> list[str]:
        """The before → after difference, one "key: old → new" per changed key, a run's and a
        step's state by its label (what the console shows people; the export keeps the values)."""
        before, after = self.before or {}, self.after or {}
        keys = [k for k in {**before, **after} if before.get(k) != after.get(k)]
        return [f"{k}: {_said(k, before.get(k, '—'))} → {_said(k, after.get(k, '—'))}" for k in keys]

    def save(self, *args, **kwargs):
        if self.pk is not None:
            raise ValueError("audit events are append-only")
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        raise ValueError("audit events are append-only")


class OutboxState(models.TextChoices):
    PENDING = "pending"  # committed with the step's state; not yet delivered
    DELIVERED = "delivered"
    FAILED = "failed"  # not delivered, and the publisher stopped trying
    CANCELLED = "cancelled"  # compensated before delivery: nothing was ever sent


class OutboxMessage(models.Model):
    """A message written in the same transaction as its step's state (rule 5), delivered
    later by the publisher with retries, effectively once: a delivery attempt after a crash
    looks the message up by its key before sending again."""

    run = models.ForeignKey(WorkflowRun, on_delete=models.CASCADE, related_name="outbox")
    step_name = models.CharField(max_length=100)
    idempotency_key = models.CharField(max_length=64, unique=True)
    payload = models.JSONField()
    state = models.CharField(max_length=12, choices=OutboxState.choices, default=OutboxState.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    budget_start_attempt = models.PositiveIntegerField(default=0)  # attempts before an operator's resume
    budget_started_at = models.DateTimeField(null=True, blank=True)
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    claimed_by = models.CharField(max_length=200, blank=True)
    claimed_until = models.DateTimeField(null=True, blank=True)
    claim_generation = models.BigIntegerField(default=0)
    dispatched_at = models.DateTimeField(null=True, blank=True)  # as WorkflowRun.dispatched_at
    provider_ref = models.CharField(max_length=255, blank=True)
    # When the latest delivery attempt was sent (its claim), and when the latest attempt whose
    # outcome is unknown was sent: a look-up that misses proves nothing before settle_from plus
    # the step's in-flight bound.
    last_attempt_at = models.DateTimeField(null=True, blank=True)
    settle_from = models.DateTimeField(null=True, blank=True)
    last_error_kind = models.CharField(max_length=24, choices=ErrorKind.choices, blank=True)
    last_error = models.TextField(blank=True)
    created_at = models.DateTimeField()
    delivered_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField()

    class Meta:
        indexes = [models.Index(fields=["state", "next_attempt_at"], name="outbox_due_idx")]

    def __str__(self) -> str:
        return f"outbox {self.pk} ({self.step_name}, {self.state})"


class ApiToken(models.Model):
    """A bearer token that lets one external system start runs of one workflow through the
    event API. Only the token's sha256 is stored: the token itself is shown once, when it is
    issued, and cannot be recovered from this row."""

    name = models.CharField(max_length=100, unique=True)
    token_hash = models.CharField(max_length=64, unique=True)  # sha256 hex of the token
    prefix = models.CharField(max_length=8)  # the token's first characters, to tell tokens apart
    workflow_name = models.CharField(max_length=100)  # the one workflow it may start
    # It may also pause and release that workflow (or a step of it) during an incident (recovery.api.incidents).
    may_pause = models.BooleanField(default=False)
    # It may also decide held tool calls for the people it names (recovery.api.decisions): a chat bot.
    may_decide = models.BooleanField(default=False)
    created_at = models.DateTimeField()
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(condition=~models.Q(workflow_name=""), name="api_token_has_workflow"),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…, {self.workflow_name})"


class LoginFailure(models.Model):
    """One failed login (or one attempt being checked) for a username from a client address, kept
    in the database so that every web process counts the same failures
    (recovery.console.login_throttle). No password: the name, the address and the time."""

    username = models.CharField(max_length=150)  # casefolded, as login_throttle.normalise makes it
    address = models.CharField(max_length=45, blank=True, default="")  # the client's IP address
    at = models.DateTimeField()

    class Meta:
        indexes = [
            models.Index(fields=["username", "at"], name="login_failure_user_at_idx"),
            models.Index(fields=["address", "at"], name="login_failure_address_at_idx"),
            models.Index(fields=["at"], name="login_failure_at_idx"),
        ]

    def __str__(self) -> str:
        return f"login failure {self.username} at {self.at:%Y-%m-%d %H:%M:%S}"


class ApprovalState(models.TextChoices):
    PENDING = "pending"
    APPROVED = "approved"  # and the action ran, in the same transaction
    REJECTED = "rejected"  # by another supervisor, or withdrawn by the requester


class ApprovalRequest(models.Model):
    """Four-eyes (``Workflow(four_eyes=…)``): an operator action on a run that waits for a
    second supervisor. Written only by recovery.engine.transitions (approval_request, approval_grant,
    approval_reject), each with its own audit event."""

    run = models.ForeignKey(WorkflowRun, on_delete=models.CASCADE, related_name="approvals")
    action = models.CharField(max_length=24)  # recovery.workflow.FOUR_EYES_ACTIONS
    step_name = models.CharField(max_length=100, blank=True)
    remote_ref = models.CharField(max_length=255, blank=True)  # the evidence of "mark succeeded"
    # The action's other arguments, performed with it on approval: {"version": 2, "effects_stand": true}
    # for a move to another version. Nullable so that SQLite adds the column in place.
    options = models.JSONField(null=True, blank=True)
    reason = models.TextField()
    state = models.CharField(max_length=12, choices=ApprovalState.choices, default=ApprovalState.PENDING)
    requested_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+")
    requested_at = models.DateTimeField()
    decided_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    decided_at = models.DateTimeField(null=True, blank=True)
    decision_reason = models.TextField(blank=True)

    class Meta:
        ordering = ["run", "requested_at", "id"]
        constraints = [
            models.UniqueConstraint(
                fields=["run", "action", "step_name"],
                condition=models.Q(state="pending"),
                name="one_pending_approval_per_action",
            ),
            models.CheckConstraint(
                # the database's own four-eyes rule: nobody approves their own request
                condition=~models.Q(state="approved") | ~models.Q(decided_by=models.F("requested_by")),
                name="approval_by_another_user",
            ),
        ]

    def __str__(self) -> str:
        target = f" {self.step_name}" if self.step_name else ""
        return f"{self.action}{target} on {self.run_id} ({self.state})"


class SweeperBeat(models.Model):
    """When a sweeper last looked for due work: Celery beat's ``sweep`` task, or an embedded
    executor's loop (``name`` says which). ``/readyz`` and ``check_health`` read it: runs whose
    retry time came are picked up only while some sweeper beats."""

    name = models.CharField(max_length=40, primary_key=True)
    at = models.DateTimeField()
    by = models.CharField(max_length=200)  # host:pid of the process that swept

    def __str__(self) -> str:
        return f"{self.name} swept at {self.at:%Y-%m-%d %H:%M:%S} by {self.by}"


class AlertState(models.TextChoices):
    FIRING = "firing"  # the run is stuck for this cause: its notifications are sent
    SNOOZED = "snoozed"  # a supervisor silenced it, with a reason, until snoozed_until
    RESOLVED = "resolved"  # the run moved on (or was changed): nothing more is sent


class Alert(models.Model):
    """A run that stayed stuck for one cause longer than its workflow allows (``stuck_after``):
    raised once per run and episode (``revision``: the run's revision when it was raised; a change
    of the run ends the episode), for its most specific overdue cause, audited on the run, sent
    through every configured channel (AlertDelivery), resolved when the run is no longer stuck
    for that cause."""

    run = models.ForeignKey(WorkflowRun, on_delete=models.CASCADE, related_name="alerts")
    cause = models.CharField(max_length=40)
    revision = models.BigIntegerField()
    state = models.CharField(max_length=10, choices=AlertState.choices, default=AlertState.FIRING)
    why = models.TextField()  # "why is this run not moving", when it was raised
    stuck_since = models.DateTimeField()  # the run's last change before it was raised
    raised_at = models.DateTimeField()
    resolved_at = models.DateTimeField(null=True, blank=True)
    snoozed_until = models.DateTimeField(null=True, blank=True)
    snoozed_by = models.CharField(max_length=150, blank=True)
    snooze_reason = models.TextField(blank=True)
    # The one alert of a step that paused itself (cause ``auto_paused``): raised on the run whose
    # failure tripped the policy, resolved when the pause is released, not when that run moves.
    workflow_pause = models.OneToOneField(
        "WorkflowPause", null=True, blank=True, on_delete=models.PROTECT, related_name="alert"
    )

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["run", "revision"],
                condition=models.Q(workflow_pause__isnull=True),
                name="one_alert_per_run_episode",
            )
        ]
        indexes = [models.Index(fields=["state", "raised_at"], name="alert_state_idx")]

    def __str__(self) -> str:
        return f"alert {self.pk} ({self.cause}, {self.state})"


class DeliveryState(models.TextChoices):
    PENDING = "pending"
    SENT = "sent"
    FAILED = "failed"  # gave up after its attempts
    CANCELLED = "cancelled"  # the alert was resolved or snoozed before it was sent


class AlertDelivery(models.Model):
    """One alert through one channel ("webhook", "email"): sent once, retried with backoff."""

    alert = models.ForeignKey(Alert, on_delete=models.CASCADE, related_name="deliveries")
    channel = models.CharField(max_length=20)
    state = models.CharField(max_length=10, choices=DeliveryState.choices, default=DeliveryState.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    sent_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["alert", "channel"], name="one_delivery_per_channel")]
        indexes = [models.Index(fields=["state", "next_attempt_at"], name="alert_delivery_due_idx")]

    def __str__(self) -> str:
        return f"alert {self.alert_id} by {self.channel} ({self.state})"


class ExecutorMode(models.TextChoices):
    EMBEDDED = "embedded", "embedded loop"  # manage.py run_executor
    CELERY = "celery", "celery worker"  # the worker that ran recovery.tasks.sweep


class Executor(models.Model):
    """A process that advances runs, as it last reported itself (recovery.engine.transitions.
    executors: registered when it starts, beaten at least once per sweep interval, stopped on a
    clean exit; pruned a day after its last beat). ``owner`` is the string it writes as a run's
    ``lease_owner``: the runs it holds are read from the runs' leases, never counted here."""

    owner = models.CharField(max_length=200, unique=True)
    host = models.CharField(max_length=200)
    pid = models.PositiveIntegerField()
    mode = models.CharField(max_length=10, choices=ExecutorMode.choices)
    version = models.CharField(max_length=40)  # the code's version (the package's)
    workflows = models.JSONField(default=dict)  # {name: [versions it has]} (recovery.registry)
    started_at = models.DateTimeField()
    last_beat_at = models.DateTimeField()
    stopped_at = models.DateTimeField(null=True, blank=True)  # a clean exit; None while it runs (or died)

    class Meta:
        indexes = [models.Index(fields=["last_beat_at"], name="executor_last_beat_idx")]

    def __str__(self) -> str:
        return f"{self.mode} executor {self.owner}"


class AccountAction(models.TextChoices):
    CREATED = "created"  # after: the role
    ROLE_CHANGED = "role_changed"  # before → after: the roles
    PASSWORD_CHANGED = "password_changed"
    ACTIVATED = "activated"  # an inactive user made active again
    DEACTIVATED = "deactivated"


class AccountEvent(models.Model):
    """One change to a console account: when, who made it (``actor``: the console user, or the
    name a command was given with ``--by``, else the OS user), from where (``via``: the command
    or page; ``os_user``: the OS account a command ran as), whose account, what changed and
    why. Append-only: the database refuses UPDATE, DELETE and TRUNCATE (triggers in
    recovery.accounts, migration 0030). No password or hash is ever stored here."""

    at = models.DateTimeField()
    actor = models.CharField(max_length=150)
    os_user = models.CharField(max_length=150, blank=True, default="")
    via = models.CharField(max_length=50)
    username = models.CharField(max_length=150)
    action = models.CharField(max_length=20, choices=AccountAction.choices)
    before = models.CharField(max_length=50, blank=True, default="")
    after = models.CharField(max_length=50, blank=True, default="")
    reason = models.TextField()

    class Meta:
        ordering = ["at", "id"]
        indexes = [models.Index(fields=["username", "at"], name="account_event_user_at_idx")]

    def __str__(self) -> str:
        change = f" {self.before or '-'} → {self.after or '-'}" if self.before or self.after else ""
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.actor} {self.action} {self.username}{change}: {self.reason}"
