"""The console's view of an incident's pauses (issue 37): the pauses of a workflow or of one of
its steps in force, with how many runs each holds and keeps pending — the banner at the top of
the runs list and the dashboard — and what a supervisor may pause."""

from __future__ import annotations

from typing import Any

from django.db.models import Count

from recovery.engine.transitions import workflow_pauses_in_force
from recovery.models import RunState, WorkflowRun
from recovery.registry import all_workflows


def pauses() -> list[dict[str, Any]]:
    """Each pause in force, oldest first: ``{"pause", "target", "held", "kept_pending"}`` —
    runs it stopped, and (a whole workflow's) runs not started that wait for it. Three queries."""
    found = workflow_pauses_in_force()
    if not found:
        return []
    held = dict(
        WorkflowRun.objects.filter(state=RunState.PAUSED, workflow_pause__in=found)
        .values_list("workflow_pause")
        .annotate(n=Count("id"))
    )
    whole = [p.workflow_name for p in found if not p.step_name]
    pending = dict(
        WorkflowRun.objects.filter(state=RunState.PENDING, workflow_name__in=whole)
        .values_list("workflow_name")
        .annotate(n=Count("id"))
    )
    return [
        {
            "pause": p,
            "target": target(p.workflow_name, p.step_name),
            "held": held.get(p.pk, 0),
            "kept_pending": 0 if p.step_name else pending.get(p.workflow_name, 0),
        }
        for p in found
    ]


def target(workflow: str, step: str = "") -> str:
    """What the pause form posts: ``invoice`` or ``invoice:post_ledger_entry``."""
    return f"{workflow}:{step}" if step else workflow


def parse_target(value: str) -> tuple[str, str]:
    workflow, _, step = (value or "").partition(":")
    return workflow, step


def choices() -> list[tuple[str, str]]:
    """What may be paused: each workflow deployed here, whole, then each of its steps that makes
    an attempt to stop before (a local step makes none)."""
    out = []
    for wf in sorted(all_workflows(), key=lambda w: w.name):
        out.append((target(wf.name), f"{wf.name} — the whole workflow"))
        out.extend((target(wf.name, s.name), f"{wf.name} · step {s.name}") for s in wf.steps if not s.local)
    return out
