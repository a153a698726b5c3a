"""Reads for commands, views and exports."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.utils.timezone import localtime

from recovery import counts, registry
from recovery.console.runs_query import (  # noqa: F401  (the runs list, kept importable from here)
    AGES,
    PAGE_SIZE,
    RUN_LIST_FIELDS,
    RunFilters,
    _distinctive,
    runs_page,
    total,
)
from recovery.console.timeline import (  # noqa: F401  (the run page's timeline, kept importable from here)
    TIMELINE_ACTIONS,
    TIMELINE_POINTS,
    _TimeScale,
    duration,
    timeline,
)
from recovery.counts import STUCK_LABELS, stuck_causes
from recovery.models import (
    DecisionState,
    RunEvent,
    StepExecution,
    StepState,
    WorkflowRun,
)
from recovery.why import why_not_moving
from recovery.workflow import all_workflows, journal_rows, parse_journal_name, workflow_of


def run_document(workflow_id: str, *, now: datetime) -> dict[str, Any]:
    """The run as ``show_run --json`` prints it (docs/operating.md "Commands")."""
    run = WorkflowRun.objects.get(workflow_id=workflow_id)
    steps = list(run.steps.order_by("position", "id"))
    approvals = run.approvals.filter(state="pending").select_related("requested_by")
    return {
        "workflow_id": run.workflow_id,
        "workflow": run.workflow_name,
        "workflow_version": run.workflow_version,
        "state": run.state,
        "current_step": run.current_step,
        "status_reason": run.status_reason,
        "why": why_not_moving(run, steps, now=now, approvals=approvals, outbox=run.outbox.all()),
        "incident": run.incident,
        "lease_owner": run.lease_owner,
        "lease_expires_at": run.lease_expires_at.isoformat() if run.lease_expires_at else None,
        "next_wake_at": run.next_wake_at.isoformat() if run.next_wake_at else None,
        "steps": [
            {
                "name": s.step_name,
                "position": s.position,
                "key_version": s.key_version,
                "restarts": s.restarts or 0,
                "correction": s.correction,
                "state": s.state,
                "attempts": s.attempts,
                "idempotency_key": s.idempotency_key,
                "remote_ref": s.remote_ref,
                "last_error_kind": s.last_error_kind,
                "last_error": s.last_error,
                "next_attempt_at": s.next_attempt_at.isoformat() if s.next_attempt_at else None,
                "compensation_ref": s.compensation_ref,
                "refusal": s.refusal,
                "overrides": s.overrides,
            }
            for s in steps
        ],
        # The accepted decision of each model step: with the steps, what a replay before a deploy
        # checks against the code (recovery.replay).
        "decisions": {
            d.step_name: {"version": d.version, "schema_version": d.schema_version, "accepted": d.accepted}
            for d in run.decisions.filter(state=DecisionState.ACCEPTED)
        },
        # Events sent to the run (durable waits), each with what became of it (run_events).
        "events": [
            {
                "event": e.name,
                "key": e.key,
                "sent_by": e.sent_by,
                "received_at": e.received_at.isoformat(),
                "late": e.late,
                "fate": e.fate,
            }
            for e in run_events(run, _workflow_or_none(run), steps)
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


def _workflow_or_none(run: WorkflowRun) -> Any:
    try:
        return workflow_of(run)
    except LookupError:
        return None


# --- the console ------------------------------------------------------------------------


def uncounted() -> dict[str, list[dict[str, Any]]]:
    """The state and stuck chips without their numbers (``count`` None), for a page whose counts
    are fetched apart."""
    return {
        "state_counts": [
            {"state": s, "label": lb, "count": None, "capped": False} for s, lb in counts.list_states().items()
        ],
        "stuck_counts": [
            {"cause": key, "label": label, "count": None, "capped": False} for key, label in STUCK_LABELS.items()
        ],
    }


def workflow_names() -> list[str]:
    """The registered workflows, then those only old runs still name (``counts.workflow_names``)."""
    return counts.workflow_names([wf.name for wf in all_workflows()])


def unregistered(workflows: list[str]) -> set[str]:
    """Those of ``workflows`` no longer registered: the console marks them "(not registered)"."""
    return set(workflows) - {wf.name for wf in all_workflows()}


def workflow_versions(workflows: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Per workflow (``workflows`` first, then any other name unfinished runs hold), every
    version this deployment has or unfinished runs execute on, oldest first: ``{"version",
    "runs"`` (not finished), ``"oldest"`` (when the oldest of them started, or None),
    ``"deployed", "current"}``. One query (``counts.unfinished_by_version``); a version only
    finished runs hold is not listed (nothing waits on it)."""
    unfinished = {(r["workflow"], r["version"]): r for r in counts.unfinished_by_version()}
    names = list(dict.fromkeys([*workflows, *(name for name, _ in unfinished)]))
    found: dict[str, list[dict[str, Any]]] = {}
    for name in names:
        numbers = sorted({*registry.versions_of(name), *(v for n, v in unfinished if n == name)})
        found[name] = [
            {
                "version": v,
                "runs": unfinished[(name, v)]["runs"] if (name, v) in unfinished else 0,
                "oldest": unfinished[(name, v)]["oldest"] if (name, v) in unfinished else None,
                "deployed": registry.has(name, v),
                "current": registry.current_version(name) == v,
            }
            for v in numbers
        ]
    return found


def version_label(name: str, version: int) -> str:
    """ "v2 (current)", "v1", "v0 (not deployed)": a version of a workflow as the console names it."""
    if registry.current_version(name) == version:
        return f"v{version} (current)"
    return f"v{version}" if registry.has(name, version) else f"v{version} (not deployed)"


def version_choices(filters: RunFilters, *, now: datetime) -> list[tuple[int, str]]:
    """The runs list's version filter: the versions this deployment has and those of runs stuck
    because their version is not deployed (stuck_causes: in flight, so one short walk of the
    runs in progress, run_in_progress_idx; never a count); of the chosen workflow only, each
    marked current or not deployed, when a workflow is chosen. The version the filter holds is
    always among them."""
    stranded = WorkflowRun.objects.filter(stuck_causes(now)["version_not_deployed"][1])
    pairs = {(w.name, w.version) for w in registry.all_versions()}
    pairs |= set(stranded.values_list("workflow_name", "workflow_version").distinct().order_by())
    if filters.workflow:
        choices = {v: version_label(name, v) for name, v in pairs if name == filters.workflow}
    else:
        choices = {v: f"v{v}" for _, v in pairs}
    if filters.version is not None:
        choices.setdefault(filters.version, f"v{filters.version}")
    return sorted(choices.items())


# --- one run ---------------------------------------------------------------------------

# The run page shows the newest AUDIT_SHOWN audit events and saved versions; older events are in
# the full trail the page links (CSV / JSON Lines export). Rendering hundreds of rows cost more
# than every query of the page together.
AUDIT_SHOWN = 50
ALERTS_SHOWN = 10  # the newest alerts of a run (each also in its audit trail)


def run_detail(workflow_id: str) -> dict[str, Any]:
    """Everything the run page shows, in a constant number of queries."""
    run = WorkflowRun.objects.get(workflow_id=workflow_id)
    steps = list(run.steps.order_by("position", "id"))
    try:
        workflow = workflow_of(run)
        contract = workflow.contract()
    except LookupError:
        workflow, contract = None, []
    audit = list(run.audit_events.order_by("-at", "-id")[: AUDIT_SHOWN + 1])
    decisions = list(run.decisions.order_by("step_name", "created_at"))
    outbox = list(run.outbox.order_by("pk"))
    alerts = list(run.alerts.prefetch_related("deliveries").order_by("-raised_at", "-pk")[:ALERTS_SHOWN])
    versions = list(
        run.history.select_related("history_user").order_by("-history_date", "-history_id")[: AUDIT_SHOWN + 1]
    )
    for event in audit:  # what its row shows, formatted once here rather than by template filters
        at = localtime(event.at)
        event.when, event.when_iso, event.diff = f"{at:%Y-%m-%d %H:%M:%S %Z}", at.isoformat(), event.changes()
    return {
        "run": run,
        "steps": steps,
        "workflow": workflow,
        "contract": contract,
        "audit": audit[:AUDIT_SHOWN],
        "audit_truncated": len(audit) > AUDIT_SHOWN,
        "decisions": decisions,
        "accepted": [d for d in decisions if d.state == DecisionState.ACCEPTED],
        "superseded": [d for d in decisions if d.state == DecisionState.SUPERSEDED],
        "invalid": [d for d in decisions if d.state == DecisionState.INVALID],
        "outbox": outbox,
        "alerts": alerts,
        "versions": versions[:AUDIT_SHOWN],
        "versions_truncated": len(versions) > AUDIT_SHOWN,
        "audit_shown": AUDIT_SHOWN,
        "timeline": timeline(run, steps),
        "conversations": conversations(workflow, steps),
        "events": run_events(run, workflow, steps),
    }


def run_events(run: WorkflowRun, workflow: Any, steps: list[StepExecution]) -> list[RunEvent]:
    """The events sent to the run, oldest first, each with what became of it (``fate``): applied by
    its wait, late (recorded, never applied), kept for a wait not reached yet, or not used. No
    query for a workflow that waits for no event."""
    waits = [s for s in getattr(workflow, "steps", []) if s.wait is not None and not s.wait.is_timer]
    if not waits:
        return []
    states = {s.step_name: s for s in steps}
    applied = {states[w.name].remote_ref: w.name for w in waits if w.name in states and states[w.name].remote_ref}
    events = list(run.events.order_by("received_at", "pk"))
    for event in events:
        if event.key in applied:
            event.fate = f"applied by {applied[event.key]}"
        elif event.late:
            event.fate = "late: recorded, not applied"
        elif any(states[w.name].state in (StepState.PENDING, StepState.WAITING) for w in waits if w.name in states):
            event.fate = "kept: to be applied by its wait"
        else:
            event.fate = "not used: its wait had taken another"
    return events


def conversations(workflow: Any, steps: list[StepExecution]) -> list[dict[str, Any]]:
    """Each agent step's journal as the run page shows it: its model turns in order, each with
    the model's reply and the tool calls it asked for (arguments, state, key, remote reference,
    attempts, error or refusal), and the agent's final answer."""
    if workflow is None:
        return []
    shown = []
    for spec in workflow.steps:
        if not spec.is_agent:
            continue
        turns: list[dict[str, Any]] = []
        for row in journal_rows(spec.name, steps):
            entry = parse_journal_name(row.step_name)
            if entry.tool is None:
                reply = row.result or {}
                turns.append({"number": entry.turn, "row": row, "content": reply.get("content") or "", "calls": []})
            elif turns:
                turns[-1]["calls"].append({"tool": entry.tool, "row": row})
        shown.append({"step": spec.name, "turns": turns, "max_turns": spec.agent.max_turns})
    return shown
