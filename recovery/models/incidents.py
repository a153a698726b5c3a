"""What incidents leave on record: a pause of a workflow or of one of its steps (``WorkflowPause``),
and a run restarted from a step with corrected input (``RunRestart``). Written only by
recovery.engine.transitions; re-exported by recovery.models."""

from __future__ import annotations

from django.db import models

from recovery.states import pause_scope


class WorkflowPause(models.Model):
    """A pause of a whole workflow (``step_name`` empty) or of one of its steps, by a supervisor or
    by the engine (recovery.engine.transitions.workflow_pauses); kept once released: the record."""

    workflow_name = models.CharField(max_length=100)
    step_name = models.CharField(max_length=100, blank=True)
    paused_by = models.CharField(max_length=150)
    reason = models.TextField()
    paused_at = models.DateTimeField()
    released_at = models.DateTimeField(null=True, blank=True)
    released_by = models.CharField(max_length=150, blank=True)
    release_reason = models.TextField(blank=True)
    # Paused by the engine (``pause_after``) after a failure of trigger_run: its alert's run.
    automatic = models.BooleanField(default=False)
    trigger_run = models.ForeignKey(
        "recovery.WorkflowRun", null=True, blank=True, on_delete=models.SET_NULL, related_name="+", db_index=False
    )

    class Meta:
        constraints = [
            # Pausing what is paused already is refused; the index is also what the executor's
            # write of a new attempt looks in (storage: the fence's ``Unpaused`` condition).
            models.UniqueConstraint(
                fields=["workflow_name", "step_name"],
                condition=models.Q(released_at__isnull=True),
                name="one_pause_in_force",
            )
        ]

    def __str__(self) -> str:
        return f"{self.workflow_name}.{self.step_name}" if self.step_name else self.workflow_name

    @property
    def scope(self) -> str:
        """ "workflow invoice", "step post_ledger_entry of invoice" """
        return pause_scope(self.workflow_name, self.step_name)


class RunRestart(models.Model):
    """A run restarted from one of its steps with a corrected input, or a corrected intent of that
    step (recovery.engine.transitions.restarts), by a supervisor with a reason: what was overwritten
    (``before``), what replaced it (``after``), the difference, and what became of each effect from
    that step on (``effects``: undone first, undone already, or standing beside a second one). The
    run's steps go back to pending when it is applied: at once, or once the effects to undo first
    are compensated (``applied_at`` empty until then). Kept: the run's lineage."""

    run = models.ForeignKey("recovery.WorkflowRun", on_delete=models.CASCADE, related_name="restarts")
    step_name = models.CharField(max_length=100)
    edited = models.CharField(max_length=8)  # "input" (the run's) or "intent" (the step's)
    before = models.JSONField()
    after = models.JSONField()
    diff = models.JSONField()  # [{"path": "amount", "before": "1200.00", "after": "1250.00"}, …]
    # [{"step", "rule", "text", "remote_ref", "key_version"}, …]: recovery.engine.transitions.restarts.Effect
    effects = models.JSONField()
    requested_by = models.CharField(max_length=150)
    reason = models.TextField()
    requested_at = models.DateTimeField()
    applied_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["run", "requested_at", "id"]
        constraints = [
            models.UniqueConstraint(
                fields=["run"], condition=models.Q(applied_at__isnull=True), name="one_restart_waiting_per_run"
            )
        ]

    def __str__(self) -> str:
        return f"restart of {self.run_id} from {self.step_name}"

    @classmethod
    def waiting(cls, run_id: int) -> RunRestart | None:
        """The run's restart not applied yet (it waits for its compensations), if any: at most one."""
        return cls.objects.filter(run_id=run_id, applied_at__isnull=True).first()
