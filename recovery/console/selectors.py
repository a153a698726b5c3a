"""Reads for commands, views and exports."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db.models import Q
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
from recovery.counts import STUCK_LABELS, stuck_causes
from recovery.models import (
    DecisionState,
    StepExecution,
    WorkflowRun,
)
from recovery.why import why_not_moving


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
    from recovery.workflow import all_workflows

    return counts.workflow_names([wf.name for wf in all_workflows()])


def unregistered(workflows: list[str]) -> set[str]:
    """Those of ``workflows`` no longer registered: the console marks them "(not registered)"."""
    from recovery.workflow import all_workflows

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
# The timeline plots at most the newest TIMELINE_POINTS attempt events (a retry storm of
# thousands would be an unreadable smear and a slow page); its axis then starts at the oldest shown.
TIMELINE_POINTS = 100
TIMELINE_ACTIONS = {
    "step_begin": "begin",
    "step_enqueue": "ok",
    "step_succeed": "ok",
    "decision_reused": "ok",
    "reconciled": "ok",
    "reconciled_absent": "begin",
    "outbox_delivered": "ok",
    "step_fail": "fail",
    "policy_refused": "fail",
    "check_deferred": "fail",
    "outbox_retry": "fail",
    "outbox_fail": "fail",
    "step_unknown": "unknown",
    "reconcile_deferred": "unknown",
    "compensation_begin": "compensate",
    "compensation_succeed": "compensate",
    "compensation_retry": "fail",
    "compensation_fail": "fail",
}


def run_detail(workflow_id: str) -> dict[str, Any]:
    """Everything the run page shows, in a constant number of queries."""
    from recovery.workflow import workflow_of

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
    }


def conversations(workflow: Any, steps: list[StepExecution]) -> list[dict[str, Any]]:
    """Each agent step's journal as the run page shows it: its model turns in order, each with
    the model's reply and the tool calls it asked for (arguments, state, key, remote reference,
    attempts, error or refusal), and the agent's final answer."""
    from recovery.workflow import journal_rows, parse_journal_name

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


def timeline(run: WorkflowRun, steps: list[StepExecution]) -> dict[str, Any]:
    """The attempts of each step and the operators' actions over time, as positions for a small
    SVG (no JavaScript), and the same events as a list (keyboard and screen reader). The newest
    TIMELINE_POINTS events at most (``truncated`` says when there were more; the axis then starts
    at the oldest one shown rather than at the run's creation). Long quiet gaps are compressed
    to a fixed width and labelled with their length, so seconds stay readable in a run that
    spans hours; ticks mark the start, the end and the time after each gap."""
    newest = list(
        run.audit_events.filter(Q(action__in=TIMELINE_ACTIONS) | Q(actor_user__isnull=False))
        .order_by("-at", "-id")
        .values("at", "action", "step_name", "actor", "actor_user_id")[: TIMELINE_POINTS + 1]
    )
    truncated = len(newest) > TIMELINE_POINTS
    events = newest[:TIMELINE_POINTS][::-1]
    lanes = {s.step_name: i for i, s in enumerate(steps)}
    width, lane_height, left = 640, 22, 170
    start = events[0]["at"] if truncated else run.created_at
    end = max([e["at"] for e in events] + [start])
    scale = _TimeScale([start, *(e["at"] for e in events)], left + 8, width - 8)
    bottom = len(steps) * lane_height
    marks, operators, listed = [], [], []
    for e in events:
        e["at"] = localtime(e["at"])
        when = f"{e['at']:%Y-%m-%d %H:%M:%S %Z}"
        if e["actor_user_id"] is not None:
            x = scale.x(e["at"])
            on = f" {e['step_name']}" if e["step_name"] else ""
            operators.append({"x": x, "title": f"{when} {e['actor']}: {e['action']}{on}", "actor": e["actor"]})
            listed.append({**_at(e["at"]), "what": f"{e['action']}{on}", "who": e["actor"], "kind": "operator"})
            continue
        if e["step_name"] not in lanes:
            continue
        kind = TIMELINE_ACTIONS[e["action"]]
        marks.append(
            {
                "x": scale.x(e["at"]),
                "y": lanes[e["step_name"]] * lane_height + lane_height // 2 + 4,
                "kind": kind,
                "title": f"{when} {e['step_name']}: {e['action']}",
            }
        )
        listed.append({**_at(e["at"]), "what": f"{e['step_name']}: {e['action']}", "who": e["actor"], "kind": kind})
    return {
        "width": width,
        "height": bottom + 40,
        "left": left,
        "lanes": [{"name": s.step_name, "y": i * lane_height + lane_height // 2 + 8} for i, s in enumerate(steps)],
        "marks": marks,
        "operators": operators,
        "bottom": bottom,
        "gaps": scale.gaps(bottom),
        "ticks": scale.ticks(),
        "events": listed,
        "truncated": truncated,
        "points": TIMELINE_POINTS,
        "start": start,
        "end": end,
        "axis_y": bottom + 16,
        "label_y": bottom + 30,
    }


def _at(when: datetime) -> dict[str, Any]:
    """An event's time as the page prints it: whole, for machines, and the time of day."""
    return {"at": when, "at_iso": when.isoformat(), "at_hms": f"{when:%H:%M:%S %Z}"}


class _TimeScale:
    """Time to x: linear, except that a quiet gap longer than a tenth of the whole span (and
    than five seconds) is drawn GAP pixels wide whatever its length."""

    GAP = 26
    MIN_TICK_SPACING = 70

    def __init__(self, times: list[datetime], x0: float, x1: float) -> None:
        self.times = sorted(set(times))
        self.x0, self.x1 = x0, x1
        span = (self.times[-1] - self.times[0]).total_seconds() if len(self.times) > 1 else 0.0
        self.limit = max(span / 10, 5.0)
        pairs = list(zip(self.times, self.times[1:], strict=False))
        self.long = [(a, b) for a, b in pairs if (b - a).total_seconds() > self.limit]
        short = sum((b - a).total_seconds() for a, b in pairs if (b - a).total_seconds() <= self.limit)
        room = max((x1 - x0) - self.GAP * len(self.long), 10.0)
        self.per_second = room / short if short > 0 else 0.0
        self.even = room / max(len(pairs), 1) if short == 0 else 0.0
        self.positions: dict[datetime, float] = {}
        x = x0
        for i, t in enumerate(self.times):
            if i:
                gap = (t - self.times[i - 1]).total_seconds()
                x += self.GAP if gap > self.limit else (gap * self.per_second or self.even)
            self.positions[t] = x

    def x(self, t: datetime) -> float:
        return round(self.positions.get(t, self.x0), 1)

    def gaps(self, bottom: int) -> list[dict[str, Any]]:
        return [
            {"x": round((self.x(a) + self.x(b)) / 2, 1), "label": f"+{duration((b - a).total_seconds())}"}
            for a, b in self.long
        ]

    def ticks(self) -> list[dict[str, Any]]:
        """The start, the end, and the time after each compressed gap, where they fit: the start
        always; the end instead of a tick too close to it (but never instead of the start)."""
        wanted = [*(b for _, b in self.long), self.times[-1]]
        ticks: list[dict[str, Any]] = [{"x": self.x(self.times[0]), "label": f"{self.times[0]:%H:%M:%S}"}]
        for t in dict.fromkeys(wanted):
            x = self.x(t)
            if x - ticks[-1]["x"] < self.MIN_TICK_SPACING:
                if t != self.times[-1] or len(ticks) == 1:
                    continue
                ticks.pop()
            ticks.append({"x": x, "label": f"{t:%H:%M:%S}"})
        return ticks


def duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    minutes = seconds / 60
    if minutes < 120:
        return f"{minutes:.0f} min"
    hours, rest = divmod(int(minutes), 60)
    return f"{hours} h {rest} min" if rest else f"{hours} h"
