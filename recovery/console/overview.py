"""The dashboard's read model: runs by state and stuck runs by cause (the numbers ``/metrics``
serves, per workflow), retries and unknown outcomes per hour, the workflow versions in flight,
the engine's counters, the alerts firing and the executors, laid out for small server-rendered
SVG charts."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.db.models import Count
from django.db.models.functions import TruncHour

from recovery import counts, executors
from recovery.console import selectors
from recovery.models import FAILURE_ACTIONS, Alert, AlertState, AuditEvent, RunState
from recovery.observability import alerts, exposition


def dashboard(*, now: datetime) -> dict[str, Any]:
    """Runs by state, stuck runs by cause, and retries / unknown outcomes per hour over the
    last 24 hours, laid out for small server-rendered SVG bar charts; and the numbers
    ``/metrics`` serves, per workflow: the same gauges and the engine's counters."""
    since = now - timedelta(hours=24)
    per_hour = (
        AuditEvent.objects.filter(at__gte=since, action__in=FAILURE_ACTIONS)  # audit_failures_at_idx
        .annotate(hour=TruncHour("at"))
        .values("hour", "action")
        .annotate(n=Count("id"))
    )
    hours = [(since + timedelta(hours=i + 1)).replace(minute=0, second=0, microsecond=0) for i in range(24)]
    retries = dict.fromkeys(hours, 0)
    unknown = dict.fromkeys(hours, 0)
    for row in per_hour:
        bucket = unknown if row["action"] == "step_unknown" else retries
        if row["hour"] in bucket:
            bucket[row["hour"]] += row["n"]
    workflows = selectors.workflow_names()
    # The numbers /metrics serves: its gauges (recovery.counts) and its counters.
    found = counts.by_workflow(workflows, now=now)
    states = [(s.value, s.label, [found["states"][(w, s.value)] for w in workflows]) for s in RunState]
    stuck = [(c, label, [found["stuck"][(w, c)] for w in workflows]) for c, label in counts.STUCK_LABELS.items()]
    return {
        "states": _bars([(label, _total(cells), f"?state={state}") for state, label, cells in states]),
        "stuck": _bars([(label, _total(cells), f"?stuck={cause}") for cause, label, cells in stuck]),
        "retries": _columns([(h, retries[h]) for h in hours]),
        "unknown": _columns([(h, unknown[h]) for h in hours]),
        "workflows": workflows,
        "unregistered": selectors.unregistered(workflows),
        "by_workflow": [{"label": label, "cells": cells} for _, label, cells in states + stuck],
        "versions": version_lines(selectors.workflow_versions(workflows), now=now),
        "engine": _engine_counters(workflows),
        "oldest_undelivered": round(counts.oldest_undelivered(now)),
        "firing": _firing(),
        "executors": executors.listing(now),  # recovery.executors: who advances runs, and what each holds
        "now": now,
    }


def version_lines(versions: dict[str, list[dict[str, Any]]], *, now: datetime) -> list[dict[str, Any]]:
    """Per workflow, one line per version (``selectors.workflow_versions``): its runs in flight
    and the oldest, and what taking it out of the code would do. An older version no run needs
    is safe to remove; one that runs need but this deployment lacks has stranded them (they
    wait until it is deployed again or they are moved). The current version is never "safe to
    remove": new runs start on it."""
    shown = []
    for name, found in versions.items():
        lines = []
        for v in found:
            label = selectors.version_label(name, v["version"])
            runs = "none in flight"
            if v["runs"]:
                runs = f"{v['runs']} in flight, oldest {selectors.duration((now - v['oldest']).total_seconds())}"
            if not v["deployed"]:
                kind, then = "stranded", "; stranded: deploy it again, or move them to a deployed version"
            elif v["current"]:
                kind, then = "current", ""
            else:
                kind, then = ("draining", "; safe to remove at 0") if v["runs"] else ("removable", "; safe to remove")
            lines.append({**v, "kind": kind, "text": f"{label}: {runs}{then}"})
        if lines:
            shown.append({"workflow": name, "versions": lines})
    return shown


FIRING_SHOWN = 20


def _firing() -> dict[str, Any]:
    """The alerts firing now (not snoozed, not resolved), newest first, and how many (capped)."""
    firing = Alert.objects.filter(state=AlertState.FIRING)
    (count, capped), *_ = counts.capped_counts([firing])
    newest = list(firing.select_related("run").prefetch_related("deliveries").order_by("-raised_at")[:FIRING_SHOWN])
    for alert in newest:
        alert.label = alerts.label(alert.cause)
    return {"count": count, "capped": capped, "alerts": newest}


def _total(cells: list[tuple[int, bool]]) -> int:
    return sum(n for n, _ in cells)


# The dashboard's rows of the engine's counters: (label, counter, label to split by, its value;
# "" and "" for a counter counted whole).
ENGINE_ROWS = (
    ("Attempts that succeeded", "recovery_step_attempts_total", "outcome", "succeeded"),
    ("Attempts that failed", "recovery_step_attempts_total", "outcome", "failed"),
    ("Attempts with an unknown outcome", "recovery_step_attempts_total", "outcome", "unknown"),
    ("Look-ups: it happened", "recovery_reconciles_total", "result", "happened"),
    ("Look-ups: it did not", "recovery_reconciles_total", "result", "absent"),
    ("Look-ups: may still commit", "recovery_reconciles_total", "result", "wait"),
    ("Look-ups that failed", "recovery_reconciles_total", "result", "failed"),
    ("Runs taken over", "recovery_lease_takeovers_total", "", ""),
    ("Policy refusals", "recovery_policy_refusals_total", "", ""),
)


def _engine_counters(workflows: list[str]) -> dict[str, Any]:
    """The engine's counters since its processes started (every process's, through
    PROMETHEUS_MULTIPROC_DIR): per workflow, and operator actions by action and role."""
    samples = exposition.counter_samples()
    rows = []
    for label, name, split, value in ENGINE_ROWS:
        by = exposition.totals(samples, name, "workflow", split)  # no split: "" for every sample
        rows.append({"label": label, "cells": [int(by.get((w, value), 0)) for w in workflows]})
    actions = exposition.totals(samples, "recovery_operator_actions_total", "action", "role")
    return {
        "rows": rows,
        "actions": [{"action": a, "role": r, "count": int(n)} for (a, r), n in sorted(actions.items())],
    }


def _bars(items: list[tuple[str, int, str]]) -> dict[str, Any]:
    top = max([n for _, n, _ in items] + [1])
    rows = [
        {"label": label, "count": n, "href": href, "y": i * 22, "width": round(300 * n / top, 1)}
        for i, (label, n, href) in enumerate(items)
    ]
    return {"rows": rows, "height": len(rows) * 22}


def _columns(items: list[tuple[datetime, int]]) -> dict[str, Any]:
    top = max([n for _, n in items] + [1])
    cols = [
        {"hour": h, "count": n, "x": i * 20, "height": round(80 * n / top, 1), "y": round(80 - 80 * n / top, 1)}
        for i, (h, n) in enumerate(items)
    ]
    return {"cols": cols, "total": sum(n for _, n in items), "max": top}
