"""The console's view of an incident's pauses (issue 37): the pauses of a workflow or of one of
its steps in force, with how many runs each holds and keeps pending — the banner at the top of
the runs list and the dashboard — and what a supervisor may pause."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.db.models import Count

from recovery.engine.transitions import Waves, workflow_pauses_in_force
from recovery.errors import InvalidTransition
from recovery.models import RunState, WorkflowRun
from recovery.registry import all_workflows


def pauses() -> list[dict[str, Any]]:
    """Each pause in force, oldest first: ``{"pause", "target", "held", "canary", "kept_pending"}``
    — runs it stopped, the canaries released from it by state ("2 completed, 1 waiting"), and (a
    whole workflow's) runs not started that wait for it. Three queries."""
    found = workflow_pauses_in_force()
    if not found:
        return []
    held: dict[int, int] = {}
    canaries: dict[int, dict[str, int]] = {}  # released from it while it stays in force, by state
    named = WorkflowRun.objects.filter(workflow_pause__in=found).values_list("workflow_pause", "state")
    for pk, state, n in named.annotate(n=Count("id")).order_by("workflow_pause", "state"):
        if state == RunState.PAUSED:
            held[pk] = n
        else:
            canaries.setdefault(pk, {})[state] = n
    whole = [p.workflow_name for p in found if not p.step_name]
    pending = dict(
        WorkflowRun.objects.filter(state=RunState.PENDING, workflow_name__in=whole)
        .exclude(workflow_pause__in=found)  # its canaries, released
        .values_list("workflow_name")
        .annotate(n=Count("id"))
    )
    return [
        {
            "pause": p,
            "target": target(p.workflow_name, p.step_name),
            "held": held.get(p.pk, 0),
            "canary": ", ".join(f"{n} {state}" for state, n in canaries.get(p.pk, {}).items()),
            "kept_pending": 0 if p.step_name else pending.get(p.workflow_name, 0),
        }
        for p in found
    ]


def release_options(form: Mapping[str, str]) -> dict[str, Any]:
    """The unpause form's choice: ``{"canary": N}`` (release N runs first, the pause in force), or
    ``{"waves": Waves}`` (the rest, in waves; empty fields: at once). InvalidTransition if bad."""
    if form.get("release") == "canary":
        try:
            return {"canary": int(form.get("canary", ""))}
        except ValueError:
            raise InvalidTransition("a canary is a whole number of runs") from None
    return {"waves": Waves.parse(form.get("wave_size"), form.get("wave_seconds"))}


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
