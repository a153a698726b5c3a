"""Reads for commands, views and exports."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlencode

from django.db.models import Q, Value
from django.db.models.functions import StrIndex, Upper
from django.utils.timezone import localtime

from recovery import counts, registry
from recovery.counts import STUCK_LABELS, stuck_causes
from recovery.models import (
    DecisionState,
    RunSearch,
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

PAGE_SIZE = 50

AGES = {"1h": timedelta(hours=1), "24h": timedelta(hours=24), "7d": timedelta(days=7), "30d": timedelta(days=30)}


@dataclass(frozen=True)
class RunFilters:
    """The runs list's filters, as the URL carries them (a shared link shows the same list)."""

    state: str = ""
    workflow: str = ""
    version: int | None = None  # the workflow version the runs execute on (of any workflow, unless one is chosen)
    stuck: str = ""  # a cause from STUCK_LABELS, or "any"
    q: str = ""  # a part of a workflow id, business key or remote reference; the beginning of a key
    key: str = ""  # business key: the beginning of the workflow id, e.g. "invoice:tenant-42"
    age: str = ""  # created more than this long ago (AGES)
    after: int | None = None  # keyset cursor: the last run id of the previous page

    @classmethod
    def from_params(cls, params) -> RunFilters:
        def text(name: str, limit: int = 255) -> str:
            return (params.get(name) or "").strip()[:limit]

        state = text("state")
        stuck = text("stuck")
        age = text("age")
        after = text("after")
        return cls(
            state=state if state in counts.list_states() else "",
            workflow=text("workflow", 100),
            version=_version(text("version", 20)),
            stuck=stuck if stuck in STUCK_LABELS or stuck == "any" else "",
            q=text("q"),
            key=text("key"),
            age=age if age in AGES else "",
            after=_cursor(after),
        )

    def query(self, **changes: Any) -> str:
        """This filter set as a query string, with ``changes`` applied (the cursor is reset
        unless given)."""
        values = {**asdict(self), "after": None, **changes}
        return urlencode({k: v for k, v in values.items() if v not in ("", None)})

    def describe(self) -> str:
        """The filters other than the search, in words ("that are failed, of invoice, older
        than 24h"), for a page that found nothing; "" when there are none."""
        parts = []
        if self.state:
            parts.append(f"that are {counts.list_states()[self.state].lower()}")
        if self.stuck:
            parts.append("stuck" if self.stuck == "any" else f"stuck: {STUCK_LABELS[self.stuck].lower()}")
        if self.workflow:
            parts.append(f"of {self.workflow}" + (f" v{self.version}" if self.version is not None else ""))
        elif self.version is not None:
            parts.append(f"on version {self.version}")
        if self.key:
            parts.append(f"whose business key begins {self.key}")
        if self.age:
            parts.append(f"older than {self.age}")
        if self.after is not None:
            parts.append("on this page")
        return ", ".join(parts)

    def query_items(self) -> list[tuple[str, str]]:
        """The filters (without the cursor) as form fields, so a POST keeps them."""
        return [(k, str(v)) for k, v in asdict(self).items() if v not in ("", None) and k != "after"]

    def _narrowed(self, now: datetime, *, before: int | None = None):
        """The runs matching every filter but the search (``q``), with ``id < before``."""
        qs = WorkflowRun.objects.all()
        if self.state:
            qs = qs.filter(counts.state_filter(self.state))
        if self.workflow:
            qs = qs.filter(workflow_name=self.workflow)
        if self.version is not None:
            qs = qs.filter(workflow_version=self.version)
        if self.key:
            qs = qs.filter(workflow_id__startswith=self.key)
        if self.age:
            qs = qs.filter(created_at__lte=now - AGES[self.age])
        if self.stuck:
            causes = stuck_causes(now)
            if self.stuck == "any":
                cond = Q()
                for _, q in causes.values():
                    cond |= q
                qs = qs.filter(cond)
            else:
                qs = qs.filter(causes[self.stuck][1])
        if before is not None:
            qs = qs.filter(pk__lt=before)
        return qs

    def _search_branches(self, qs) -> list:
        """``qs`` narrowed to each way a run matches the search, case-insensitively: ``q`` is in
        its workflow id (and so its business key), or in one of its steps' remote references or
        compensation references, or begins one of its steps' idempotency keys (the workflow id is
        searched in RunSearch, written once per run). Kept apart (never OR-ed in one WHERE with
        the runs): each branch has its own index (pg_trgm on PostgreSQL, migration 0019),
        whereas the OR makes the database walk every run newest first looking for the few that
        match."""
        q = self.q
        # "<> ''" lets PostgreSQL use the partial indexes (a step with no reference has no entry).
        by_ref = (
            Q(idempotency_key=q)
            | (Q(remote_ref__icontains=q) & ~Q(remote_ref=""))
            | (Q(compensation_ref__icontains=q) & ~Q(compensation_ref=""))
        )
        key = q.lower()
        if _HEX.fullmatch(key):
            # Keys are lowercase hex: those beginning with ``key`` lie in [key, key + "g"), a
            # range of the keys' unique index.
            by_ref |= Q(idempotency_key__gte=key, idempotency_key__lt=key + "g")
        by_step = StepExecution.objects.filter(by_ref).values("run_id")
        by_id = RunSearch.objects.filter(workflow_id__icontains=_distinctive(q))
        if _distinctive(q) != q:  # the index finds the candidates, the whole text decides
            by_id = by_id.alias(at=StrIndex(Upper("workflow_id"), Upper(Value(q)))).filter(at__gt=0)
        return [qs.filter(pk__in=by_id.values("run_id")), qs.filter(pk__in=by_step)]

    def queryset(self, now: datetime):
        """Every matching run, unordered and unlimited (for a page or a bulk action, use
        ``newest``)."""
        qs = self._narrowed(now)
        if not self.q:
            return qs
        branches = [branch.values("pk") for branch in self._search_branches(qs)]
        return WorkflowRun.objects.filter(pk__in=branches[0].union(*branches[1:]))

    def newest(self, now: datetime, *, limit: int, before: int | None = None):
        """The ``limit`` newest matching runs with ``id < before`` (a keyset cursor), newest
        first, as a sliced queryset (``.only()`` and ``.values_list()`` still apply).

        A search is the union of its branches, each cut to its own ``limit`` newest (the
        ``limit`` newest of a union are among the ``limit`` newest of each part): one query,
        in which every branch reads at most ``limit`` rows from its own index. A branch's
        slice is wrapped in ``pk__in`` because SQLite refuses LIMIT in the arms of a UNION."""
        qs = self._narrowed(now, before=before)
        if not self.q:
            return qs.order_by("-pk")[:limit]
        limited = [
            WorkflowRun.objects.filter(pk__in=branch.order_by("-pk").values("pk")[:limit]).values("pk")
            for branch in self._search_branches(qs)
        ]
        return WorkflowRun.objects.filter(pk__in=limited[0].union(*limited[1:])).order_by("-pk")[:limit]


_HEX = re.compile(r"[0-9a-f]{1,64}")
_WORD = re.compile(r"[^\W_]+")
DISTINCTIVE_LENGTH = 12


def _distinctive(q: str) -> str:
    """The part of a long search text the trigram index looks up: of its words that hold a
    digit (the numbers in ids), the one with the most digits, the last of equals, at most
    DISTINCTIVE_LENGTH characters of its end; else the whole text. Every trigram of a pattern
    is a posting list the index must read, and the workflow name and tenant that begin every
    workflow id ("invoice:acme-…") are in a large share of the runs: at a million runs,
    "invoice:wayne-logistics:INV-2024-0050000" read 5,700 index pages, "0050000" 500. A run
    whose id holds the whole text holds this part too; the whole text is checked after."""
    if len(q) <= DISTINCTIVE_LENGTH:
        return q
    numbered = [w for w in _WORD.findall(q) if len(w) >= 3 and any(c.isdigit() for c in w)]
    if not numbered:
        return q
    best = max(reversed(numbered), key=lambda w: sum(c.isdigit() for c in w))
    return best[-DISTINCTIVE_LENGTH:]


MAX_CURSOR = 2**63 - 1  # a run id is a 64-bit integer


def _cursor(value: str) -> int | None:
    """A keyset cursor from the URL: a run id in ASCII digits (``str.isdigit`` also accepts
    "²" or "١", which ``int`` refuses or reads), within the 64-bit range of the ids; anything
    else means the first page."""
    if not (value.isascii() and value.isdigit()):
        return None
    cursor = int(value)
    return cursor if cursor <= MAX_CURSOR else None


def _version(value: str) -> int | None:
    """A workflow version from the URL ("2", or "v2" as the console writes it): up to 9 ASCII
    digits; anything else means no version filter, as a bad state or age does."""
    return registry.version_number(value.removeprefix("v"))


RUN_LIST_FIELDS = (
    "pk",
    "workflow_id",
    "workflow_name",
    "workflow_version",
    "state",
    "current_step",
    "status_reason",
    "created_at",
    "updated_at",
    "lease_owner",
    "lease_expires_at",
    "next_wake_at",
    "reserved_for",
    "reserved_until",
)


def runs_page(filters: RunFilters, *, now: datetime) -> tuple[list[WorkflowRun], int | None]:
    """One page of runs, newest first, by keyset (``id < after``): as fast on page 500 as on
    page 1. Returns the runs and the cursor of the next page (None on the last page)."""
    rows = list(filters.newest(now, limit=PAGE_SIZE + 1, before=filters.after).only(*RUN_LIST_FIELDS))
    return rows[:PAGE_SIZE], (rows[PAGE_SIZE - 1].pk if len(rows) > PAGE_SIZE else None)


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
        event.when, event.when_iso, event.diff = f"{at:%Y-%m-%d %H:%M:%S}", at.isoformat(), event.changes()
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
        when = f"{e['at']:%Y-%m-%d %H:%M:%S}"
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
    return {"at": when, "at_iso": when.isoformat(), "at_hms": f"{when:%H:%M:%S}"}


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
