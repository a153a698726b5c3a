"""Reads for commands, views and exports."""

from __future__ import annotations

from typing import Any

from .models import WorkflowRun


def run_document(workflow_id: str) -> dict[str, Any]:
    """The run as ``show_run --json`` prints it (SPEC §6)."""
    run = WorkflowRun.objects.get(workflow_id=workflow_id)
    return {
        "workflow_id": run.workflow_id,
        "workflow": run.workflow_name,
        "workflow_version": run.workflow_version,
        "state": run.state,
        "current_step": run.current_step,
        "status_reason": run.status_reason,
        "incident": run.incident,
        "lease_owner": run.lease_owner,
        "lease_expires_at": run.lease_expires_at.isoformat() if run.lease_expires_at else None,
        "next_wake_at": run.next_wake_at.isoformat() if run.next_wake_at else None,
        "steps": [
            {
                "name": s.step_name,
                "state": s.state,
                "attempts": s.attempts,
                "idempotency_key": s.idempotency_key,
                "remote_ref": s.remote_ref,
                "last_error_kind": s.last_error_kind,
                "last_error": s.last_error,
                "next_attempt_at": s.next_attempt_at.isoformat() if s.next_attempt_at else None,
                "compensation_ref": s.compensation_ref,
            }
            for s in run.steps.order_by("position")
        ],
        "audit": [
            {
                "at": e.at.isoformat(),
                "actor": e.actor,
                "action": e.action,
                "step": e.step_name,
                "reason": e.reason,
                "before": e.before,
                "after": e.after,
            }
            for e in run.audit_events.order_by("at", "id")
        ],
    }
