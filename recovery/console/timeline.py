"""The run page's timeline of the attempts: its read model, positions for a small SVG drawn on
the server (no JavaScript), and the same events as a list (keyboard and screen reader).

Each attempt is a bar from its start (``step_begin``, ``compensation_begin``) to its outcome (the
next event of the same step: succeeded, failed, unknown, …), as long as it took; an event that is
no part of such a pair (an attempt whose outcome was never recorded, a reconcile, a delivery) is a
point. Long quiet gaps between attempts are compressed to a fixed width and labelled with their
length; those labels are laid out here so that no two overlap (``stack``)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db.models import Q
from django.utils.timezone import localtime

from recovery.clock import time_of_day
from recovery.models import StepExecution, WorkflowRun
from recovery.states import AuditAction

# The timeline plots at most the newest TIMELINE_POINTS attempt events (a retry storm of
# thousands would be an unreadable smear and a slow page); its axis then starts at the oldest shown.
TIMELINE_POINTS = 100
TIMELINE_ACTIONS = {
    AuditAction.STEP_BEGIN: "begin",
    AuditAction.STEP_ENQUEUE: "ok",
    AuditAction.STEP_SUCCEED: "ok",
    AuditAction.DECISION_REUSED: "ok",
    AuditAction.RECONCILED: "ok",
    AuditAction.RECONCILED_ABSENT: "begin",
    AuditAction.OUTBOX_DELIVERED: "ok",
    AuditAction.STEP_FAIL: "fail",
    AuditAction.POLICY_REFUSED: "fail",
    AuditAction.CHECK_DEFERRED: "fail",
    AuditAction.OUTBOX_RETRY: "fail",
    AuditAction.OUTBOX_FAIL: "fail",
    AuditAction.STEP_UNKNOWN: "unknown",
    AuditAction.RECONCILE_DEFERRED: "unknown",
    AuditAction.COMPENSATION_BEGIN: "compensate",
    AuditAction.COMPENSATION_SUCCEED: "compensate",
    AuditAction.COMPENSATION_RETRY: "fail",
    AuditAction.COMPENSATION_FAIL: "fail",
    AuditAction.COMPENSATION_REFUSED: "fail",  # not sent: not the run's own object
}
# An attempt starts with one of these; the next event of its step is its outcome.
ATTEMPT_STARTS = frozenset({AuditAction.STEP_BEGIN, AuditAction.COMPENSATION_BEGIN})

WIDTH, LANE_HEIGHT, LEFT = 640, 22, 170
BAR_HEIGHT, MIN_BAR = 10, 4  # px: an attempt of no measurable length is still a visible bar
# The gap labels are set in a monospace font of GAP_FONT px (console.css .gap-label), so that
# their width is known here: at most CHAR_WIDTH px a character (DejaVu Sans Mono: 0.6 em).
GAP_FONT, CHAR_WIDTH, LABEL_PAD, ROW_HEIGHT = 10, 6.5, 6, 12
# The axis labels ("12:03:04 UTC", 11 px system-ui): at most this wide.
TICK_WIDTH = 84


def timeline(run: WorkflowRun, steps: list[StepExecution]) -> dict[str, Any]:
    """The attempts of each step and the operators' actions over time. The newest TIMELINE_POINTS
    events at most (``truncated`` says when there were more; the axis then starts at the oldest
    one shown rather than at the run's creation). Ticks mark the start, the end and the time
    after each gap, where they fit."""
    newest = list(
        run.audit_events.filter(Q(action__in=TIMELINE_ACTIONS) | Q(actor_user__isnull=False))
        .order_by("-at", "-id")
        .values("at", "action", "step_name", "actor", "actor_user_id")[: TIMELINE_POINTS + 1]
    )
    truncated = len(newest) > TIMELINE_POINTS
    events = newest[:TIMELINE_POINTS][::-1]
    lanes = {s.step_name: i for i, s in enumerate(steps)}
    start = events[0]["at"] if truncated else run.created_at
    end = max([e["at"] for e in events] + [start])
    pairs = attempts([e for e in events if e["actor_user_id"] is None and e["step_name"] in lanes])
    scale = _TimeScale(
        [start, *(e["at"] for e in events)], LEFT + 8, WIDTH - 8, spans=[(b["at"], o["at"]) for b, o in pairs]
    )
    bottom = len(steps) * LANE_HEIGHT
    outcome_of = {id(b): o for b, o in pairs}
    took_of = {id(o): (o["at"] - b["at"]).total_seconds() for b, o in pairs}
    bars, marks, operators, listed = [], [], [], []
    for e in events:
        when = f"{localtime(e['at']):%Y-%m-%d %H:%M:%S %Z}"
        if e["actor_user_id"] is not None:
            on = f" {e['step_name']}" if e["step_name"] else ""
            operators.append(
                {"x": scale.x(e["at"]), "title": f"{when} {e['actor']}: {e['action']}{on}", "actor": e["actor"]}
            )
            listed.append({**_at(e["at"]), "what": f"{e['action']}{on}", "who": e["actor"], "kind": "operator"})
            continue
        if e["step_name"] not in lanes:
            continue
        lane_y = lanes[e["step_name"]] * LANE_HEIGHT + LANE_HEIGHT // 2 + 4
        kind = TIMELINE_ACTIONS[e["action"]]
        took = ""
        if id(e) in outcome_of:  # an attempt: its bar, drawn once, from here to its outcome
            outcome = outcome_of[id(e)]
            seconds = (outcome["at"] - e["at"]).total_seconds()
            x0, x1 = scale.x(e["at"]), scale.x(outcome["at"])
            bars.append(
                {
                    "x": x0,
                    "y": lane_y - BAR_HEIGHT // 2,
                    "width": round(max(x1 - x0, MIN_BAR), 1),
                    "height": BAR_HEIGHT,
                    "kind": TIMELINE_ACTIONS[outcome["action"]],
                    "seconds": seconds,
                    "title": f"{when} {e['step_name']}: attempt of {took_text(seconds)}, then {outcome['action']}",
                }
            )
        elif id(e) in took_of:  # an attempt's outcome: drawn as its bar's end
            took = took_text(took_of[id(e)])
        else:
            marks.append(
                {"x": scale.x(e["at"]), "y": lane_y, "kind": kind, "title": f"{when} {e['step_name']}: {e['action']}"}
            )
        listed.append(
            {**_at(e["at"]), "what": f"{e['step_name']}: {e['action']}", "who": e["actor"], "kind": kind, "took": took}
        )
    labels_at = [(g["x"], g["label"]) for g in scale.gaps()]
    placed, rows = stack(labels_at, LEFT, WIDTH, char_width=CHAR_WIDTH, pad=LABEL_PAD)
    label_y = bottom + 30
    return {
        "width": WIDTH,
        "height": label_y + max(rows - 1, 0) * ROW_HEIGHT + 10,
        "left": LEFT,
        "lanes": [{"name": s.step_name, "y": i * LANE_HEIGHT + LANE_HEIGHT // 2 + 8} for i, s in enumerate(steps)],
        "bars": bars,
        "marks": marks,
        "operators": operators,
        "bottom": bottom,
        "gaps": [
            {**g, "label_x": p["x"], "label_y": label_y + p["row"] * ROW_HEIGHT}
            for g, p in zip(scale.gaps(), placed, strict=True)
        ],
        "ticks": scale.ticks(),
        "events": listed,
        "truncated": truncated,
        "points": TIMELINE_POINTS,
        "start": start,
        "end": end,
        "axis_y": bottom + 16,
    }


def attempts(events: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The (start, outcome) pairs among a run's step events, oldest first: a start and the next
    event of the same step, if that is not itself a start (then the first attempt's outcome was
    never recorded: a crash, a lost lease)."""
    open_: dict[str, dict[str, Any]] = {}
    pairs = []
    for e in events:
        began = open_.pop(e["step_name"], None)
        if e["action"] in ATTEMPT_STARTS:
            open_[e["step_name"]] = e
        elif began is not None:
            pairs.append((began, e))
    return pairs


def took_text(seconds: float) -> str:
    """How long an attempt took: "0.4 s", "3.2 s", "45 s", "3 min"."""
    return f"{seconds:.1f} s" if seconds < 10 else duration(seconds)


def stack(
    labels: list[tuple[float, str]], x0: float, x1: float, *, char_width: float, pad: float
) -> tuple[list[dict[str, Any]], int]:
    """Lay out centred text labels (x, text) on rows so that no two overlap: each keeps its x if
    it fits between x0 and x1 (else it is moved inside), and goes on the first row where it
    clears the labels already there by ``pad``. The labels in the order given, each with its
    ``x``, ``row`` and extent (``left``, ``right``, as estimated from ``char_width``), and the
    number of rows used."""
    ends: list[float] = []  # the right edge of the last label on each row
    placed = []
    for x, text in labels:
        width = len(text) * char_width
        centre = min(max(x, x0 + width / 2), x1 - width / 2)
        left, right = centre - width / 2, centre + width / 2
        row = next((i for i, edge in enumerate(ends) if left >= edge + pad), len(ends))
        if row == len(ends):
            ends.append(right)
        else:
            ends[row] = max(ends[row], right)
        placed.append({"x": round(centre, 1), "row": row, "left": left, "right": right, "text": text})
    return placed, len(ends)


def _at(when: datetime) -> dict[str, Any]:
    """An event's time as the page prints it: whole, for machines, and the time of day."""
    return {"at": when, "at_iso": localtime(when).isoformat(), "at_hms": time_of_day(when)}


class _TimeScale:
    """Time to x: linear, except that a quiet gap longer than a tenth of the whole span (and
    than five seconds) is drawn GAP pixels wide whatever its length. A gap within an attempt
    (``spans``: its start and its outcome) is never compressed: an attempt's bar is as long as
    it took, on the same scale as the others."""

    GAP = 26

    def __init__(
        self, times: list[datetime], x0: float, x1: float, *, spans: list[tuple[datetime, datetime]] = ()
    ) -> None:
        self.times = sorted(set(times))
        self.x0, self.x1 = x0, x1
        span = (self.times[-1] - self.times[0]).total_seconds() if len(self.times) > 1 else 0.0
        self.limit = max(span / 10, 5.0)
        pairs = list(zip(self.times, self.times[1:], strict=False))

        def compressed(a: datetime, b: datetime) -> bool:
            inside = any(s <= a and b <= e for s, e in spans)
            return (b - a).total_seconds() > self.limit and not inside

        self.long = [(a, b) for a, b in pairs if compressed(a, b)]
        short = sum((b - a).total_seconds() for a, b in pairs if not compressed(a, b))
        room = max((x1 - x0) - self.GAP * len(self.long), 10.0)
        self.per_second = room / short if short > 0 else 0.0
        self.even = room / max(len(pairs), 1) if short == 0 else 0.0
        self.positions: dict[datetime, float] = {}
        x = x0
        for i, t in enumerate(self.times):
            if i:
                a = self.times[i - 1]
                x += self.GAP if compressed(a, t) else ((t - a).total_seconds() * self.per_second or self.even)
            self.positions[t] = x

    def x(self, t: datetime) -> float:
        return round(self.positions.get(t, self.x0), 1)

    def gaps(self) -> list[dict[str, Any]]:
        return [
            {"x": round((self.x(a) + self.x(b)) / 2, 1), "label": f"+{duration((b - a).total_seconds())}"}
            for a, b in self.long
        ]

    def ticks(self) -> list[dict[str, Any]]:
        """The start, the end, and the time after each compressed gap, each "HH:MM:SS UTC", where
        their labels fit without touching: the start always (its label reads rightwards), the end
        if it clears the start (its label reads leftwards), the others centred between them."""
        first, last = self.times[0], self.times[-1]
        pad = 6
        ticks = [
            {"x": self.x(first), "label": time_of_day(first), "anchor": "start", "right": self.x(first) + TICK_WIDTH}
        ]
        end = None
        if last != first and self.x(last) - TICK_WIDTH >= ticks[0]["right"] + pad:
            end = {"x": self.x(last), "label": time_of_day(last), "anchor": "end", "left": self.x(last) - TICK_WIDTH}
        for t in dict.fromkeys(b for _, b in self.long):
            x = self.x(t)
            if t in (first, last) or x - TICK_WIDTH / 2 < ticks[-1]["right"] + pad:
                continue
            if end is not None and x + TICK_WIDTH / 2 > end["left"] - pad:
                continue
            ticks.append({"x": x, "label": time_of_day(t), "anchor": "middle", "right": x + TICK_WIDTH / 2})
        if end is not None:
            ticks.append(end)
        return [{"x": t["x"], "label": t["label"], "anchor": t["anchor"]} for t in ticks]


def duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    minutes = seconds / 60
    if minutes < 120:
        return f"{minutes:.0f} min"
    hours, rest = divmod(int(minutes), 60)
    return f"{hours} h {rest} min" if rest else f"{hours} h"
