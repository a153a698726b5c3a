"""Events delivered to runs (issue 38): what a durable wait (recovery.waiting) waits for. Each is
kept as it came, insert-only: whether a wait used it is the wait step's own record (its
``remote_ref`` is the event's key). Written only by recovery.engine.transitions; re-exported by
recovery.models."""

from __future__ import annotations

from django.db import models


class RunEvent(models.Model):
    """An event a run was sent, by name, under the sender's idempotency key: the same key again is
    this event, not another. ``late``: it came after the wait it was for had ended (recorded and
    shown, never applied)."""

    run = models.ForeignKey("recovery.WorkflowRun", on_delete=models.CASCADE, related_name="events", db_index=False)
    name = models.CharField(max_length=100)
    key = models.CharField(max_length=200)
    payload = models.JSONField(default=dict)
    payload_hash = models.CharField(max_length=64)
    received_at = models.DateTimeField()
    sent_by = models.CharField(max_length=150)  # "api:tracker", a user name, "manage.py"
    late = models.BooleanField(default=False)
    # The wait step it was for when it came ("" for an early event, before any wait on it was reached).
    step_name = models.CharField(max_length=100, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["run", "key"], name="one_event_per_key")]
        indexes = [models.Index(fields=["run", "name", "received_at"], name="run_event_name_idx")]

    def __str__(self) -> str:
        return f"{self.name} ({self.key})"
