"""The run page's timeline of the attempts: its read model (positions for a small SVG drawn on
the server, and the same events as a list)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db.models import Q
from django.utils.timezone import localtime

from recovery.models import StepExecution, WorkflowRun

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
