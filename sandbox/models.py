"""The simulated external systems' state: a task tracker (Jira), a messenger (Slack), a ledger
(an ERP), and the faults scripted into them. Everything here lives in the ``sandbox`` database
(see ``sandbox/routers.py``), never the engine's.

Every public id is a prefixed string (``task_12``, ``msg_3``, ``le_7``) built from the primary key.
"""

from django.db import models
from django.utils import timezone


def parse_public_id(prefix: str, public_id: str) -> int | None:
    """The primary key behind ``<prefix>_<pk>``, or None when the id is not of that shape."""
    head, _, tail = public_id.partition("_")
    if head != prefix or not tail.isdigit():
        return None
    return int(tail)


class TaskStatus(models.TextChoices):
    OPEN = "open"
    DONE = "done"  # worked through by its assignee: no longer open, and not cancelled
    CANCELLED = "cancelled"


class Task(models.Model):
    """A task in the tracker. Its idempotency key is UNIQUE: one key, at most one task."""

    PREFIX = "task"

    title = models.CharField(max_length=500)
    assignee = models.CharField(max_length=200)
    payload = models.JSONField(default=dict, blank=True)
    status = models.CharField(max_length=16, choices=TaskStatus.choices, default=TaskStatus.OPEN)
    cancel_reason = models.TextField(blank=True, default="")
    idempotency_key = models.CharField(max_length=255, unique=True)
    created_at = models.DateTimeField(default=timezone.now)
    # The assignee's decision (approve/reject), and where the tracker calls back with it: the run's
    # events endpoint its creator gave (sandbox.services.decide_task), and how that call went.
    decision = models.CharField(max_length=16, blank=True, default="")
    decided_by = models.CharField(max_length=200, blank=True, default="")
    decision_note = models.TextField(blank=True, default="")
    decided_at = models.DateTimeField(null=True, blank=True)
    callback_url = models.URLField(max_length=500, blank=True, default="")
    callback_status = models.CharField(max_length=300, blank=True, default="")

    class Meta:
        ordering = ["pk"]

    def __str__(self) -> str:
        return f"{self.public_id} {self.title}"

    @property
    def public_id(self) -> str:
        return f"{self.PREFIX}_{self.pk}"

    def as_json(self) -> dict:
        return {
            "id": self.public_id,
            "title": self.title,
            "assignee": self.assignee,
            "payload": self.payload,
            "status": self.status,
            "cancel_reason": self.cancel_reason,
            "idempotency_key": self.idempotency_key,
            "created_at": self.created_at.isoformat(),
            "decision": self.decision,
            "decided_by": self.decided_by,
            "callback_url": self.callback_url,
            "callback_status": self.callback_status,
        }


class IdempotencyRecord(models.Model):
    """What the task service remembers about an Idempotency-Key: the hash of the request that
    first used it and the response it got, replayed verbatim for the same request. The key is
    UNIQUE, so two concurrent requests with one key cannot both create."""

    key = models.CharField(max_length=255, unique=True)
    request_hash = models.CharField(max_length=64)
    response_status = models.PositiveSmallIntegerField(null=True, blank=True)
    response_body = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return self.key


class MessageKind(models.TextChoices):
    MESSAGE = "message"
    CORRECTION = "correction"


class Message(models.Model):
    """A message in the messenger. Nothing dedupes: every send is a new message; a mistake is
    amended by a correction (a new message pointing at the one it corrects), never an edit."""

    PREFIX = "msg"

    to = models.CharField(max_length=200)
    text = models.TextField()
    client_ref = models.CharField(max_length=255, blank=True, default="", db_index=True)
    kind = models.CharField(max_length=16, choices=MessageKind.choices, default=MessageKind.MESSAGE)
    corrects = models.ForeignKey("self", null=True, blank=True, on_delete=models.PROTECT, related_name="corrections")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["created_at", "pk"]

    def __str__(self) -> str:
        return f"{self.public_id} to {self.to}"

    @property
    def public_id(self) -> str:
        return f"{self.PREFIX}_{self.pk}"

    def as_json(self) -> dict:
        return {
            "id": self.public_id,
            "to": self.to,
            "text": self.text,
            "client_ref": self.client_ref,
            "kind": self.kind,
            "corrects": f"{self.PREFIX}_{self.corrects_id}" if self.corrects_id else None,
            "created_at": self.created_at.isoformat(),
        }


class LedgerKind(models.TextChoices):
    ENTRY = "entry"
    REVERSAL = "reversal"


class LedgerEntry(models.Model):
    """A ledger line. The reference is UNIQUE (a duplicate post is refused, not doubled); a
    posted entry is never deleted or edited, only reversed, at most once (``reverses`` is
    one-to-one)."""

    PREFIX = "le"

    reference = models.CharField(max_length=255, unique=True)
    amount = models.DecimalField(max_digits=18, decimal_places=2)
    currency = models.CharField(max_length=3)
    account = models.CharField(max_length=200)
    memo = models.TextField(blank=True, default="")
    kind = models.CharField(max_length=16, choices=LedgerKind.choices, default=LedgerKind.ENTRY)
    reverses = models.OneToOneField("self", null=True, blank=True, on_delete=models.PROTECT, related_name="reversal")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["pk"]
        verbose_name_plural = "ledger entries"

    def __str__(self) -> str:
        return f"{self.public_id} {self.reference}"

    @property
    def public_id(self) -> str:
        return f"{self.PREFIX}_{self.pk}"

    def as_json(self) -> dict:
        return {
            "id": self.public_id,
            "reference": self.reference,
            "amount": str(self.amount),
            "currency": self.currency,
            "account": self.account,
            "memo": self.memo,
            "kind": self.kind,
            "reverses": f"{self.PREFIX}_{self.reverses_id}" if self.reverses_id else None,
            "reversed_by": reversal.public_id if (reversal := getattr(self, "reversal", None)) else None,
            "created_at": self.created_at.isoformat(),
        }


class Service(models.TextChoices):
    TASKS = "tasks"
    MESSAGES = "messages"
    LEDGER = "ledger"


class Operation(models.TextChoices):
    CREATE = "create"  # tasks: POST /tasks/
    CANCEL = "cancel"  # tasks: POST /tasks/<id>/cancel (the compensation)
    SEND = "send"  # messages: POST /messages/
    POST = "post"  # ledger: POST /ledger/entries/
    FIND = "find"  # every service: the GET look-up (by idempotency key, client_ref, reference)
    GET = "get"  # every service: GET one object by its own id (how an operator's evidence is checked)
    CORRECT = "correct"  # messages: POST /messages/<id>/corrections (the compensation)
    REVERSE = "reverse"  # ledger: POST /ledger/entries/<id>/reverse (the compensation)


# The faultable (service, operation) pairs: every operation of every service, writes, look-ups and
# compensations alike, so that each unknown-outcome path (including a reconciling look-up that
# itself times out) can be reproduced.
FAULTABLE = {
    Service.TASKS: (Operation.CREATE, Operation.CANCEL, Operation.FIND, Operation.GET),
    Service.MESSAGES: (Operation.SEND, Operation.FIND, Operation.GET, Operation.CORRECT),
    Service.LEDGER: (Operation.POST, Operation.FIND, Operation.GET, Operation.REVERSE),
}


class FaultMode(models.TextChoices):
    """What a scripted fault does to one call (``sandbox.services.run_faultable``).

    The three modes that answer late differ in *when* the request commits:

    - ``commit_then_drop`` commits at once, then holds the answer past the caller's read timeout:
      the answer is lost, the effect is there the moment the caller gives up;
    - ``late_commit`` waits first and only then performs the request, which commits after the
      caller gave up (a receiver that finishes a queued or slow request late: the commonest
      unknown outcome in production); a look-up right after the timeout finds nothing yet;
    - ``slow`` waits ``delay_ms``, then performs and answers. Below the caller's read timeout that
      is a slow success; above it, it is a late commit too (the caller gives up, the write lands).

    On a look-up (GET) nothing is written: ``commit_then_drop`` and ``late_commit`` mean the
    answer comes after the caller's timeout (it is dropped), ``slow`` a late answer."""

    FAIL_BEFORE_COMMIT = "fail_before_commit"  # 500, nothing written
    COMMIT_THEN_DROP = "commit_then_drop"  # written and committed at once, the answer comes too late
    LATE_COMMIT = "late_commit"  # waits past the caller's timeout, then writes and commits
    RATE_LIMIT = "rate_limit"  # 429 with Retry-After, nothing written
    FORBIDDEN = "forbidden"  # 403, nothing written
    UNAVAILABLE = "unavailable"  # 503, nothing written
    SLOW = "slow"  # sleeps delay_ms, then proceeds normally (past the timeout: a late commit)


class Fault(models.Model):
    """A scripted fault for the next ``remaining`` calls of one (service, operation). Stored in
    the sandbox database so that it works across processes; consumed by a conditional UPDATE,
    so two processes never consume the same unit twice."""

    service = models.CharField(max_length=16, choices=Service.choices)
    operation = models.CharField(max_length=16, choices=Operation.choices)
    mode = models.CharField(max_length=32, choices=FaultMode.choices)
    remaining = models.PositiveIntegerField(default=1)
    retry_after = models.PositiveIntegerField(default=1)
    delay_ms = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["created_at", "pk"]
        indexes = [models.Index(fields=["service", "operation", "remaining"], name="sandbox_fault_active")]

    def __str__(self) -> str:
        return f"{self.service} {self.operation} {self.mode} ×{self.remaining}"
