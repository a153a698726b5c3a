"""Executor health, read: which executors are live, what each holds, and which runs wait for one.

An executor is *live* while it has beaten (``Executor.last_beat_at``, written by
recovery.engine.transitions.executors) within RECOVERY_EXECUTOR_SILENT_SECONDS and has not
stopped; *silent* otherwise. A run is *unclaimed* when it has been due for longer than that
(pending, waiting or compensating with its wake time passed, or running with its lease expired;
a reservation for one executor counts from its end) and nobody holds it. With no executor live,
an unclaimed run is stuck for the cause ``no_executor`` (recovery.counts), and its "why" sentence
says so (recovery.why): ``unclaimed`` and ``unclaimed_since`` are the same rule, once in SQL and
once in Python."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import Count, Exists, Max, Q

from recovery.models import IN_PROGRESS_RUN_STATES, Executor, RunState, WorkflowRun

LISTED = 50  # executors on the dashboard, the most recently beaten first
START_HINT = "start manage.py run_executor (or the Celery workers and beat)"

_WAKING = [RunState.PENDING, RunState.WAITING, RunState.COMPENSATING]  # due once next_wake_at passed


def silent_after() -> timedelta:
    return timedelta(seconds=settings.RECOVERY_EXECUTOR_SILENT_SECONDS)


def live(now: datetime) -> Q:
    """Executors that beat within the silent threshold and did not stop."""
    return Q(stopped_at__isnull=True, last_beat_at__gt=now - silent_after())


def none_live(now: datetime) -> Q:
    """A condition on any row that holds while no executor is live: one ``NOT EXISTS`` over the
    few executors' rows (PostgreSQL evaluates it once per statement, not per row)."""
    return ~Q(Exists(Executor.objects.filter(live(now))))


def unclaimed(now: datetime) -> Q:
    """Runs due for longer than the silent threshold that no executor holds: index-friendly (the
    in-progress states first, then the wake time or the lease's expiry)."""
    cutoff = now - silent_after()
    free = Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lte=now)
    unreserved = Q(reserved_for__isnull=True) | Q(reserved_until__isnull=True) | Q(reserved_until__lte=cutoff)
    woke = Q(next_wake_at__lte=cutoff) | Q(next_wake_at__isnull=True, updated_at__lte=cutoff)
    return (
        Q(state__in=IN_PROGRESS_RUN_STATES)
        & ((Q(state__in=_WAKING) & woke & free) | Q(state=RunState.RUNNING, lease_expires_at__lte=cutoff))
        & unreserved
    )


def unclaimed_since(run: WorkflowRun, now: datetime) -> datetime | None:
    """When the run became due, if it is ``unclaimed`` now (the same rule, on one run), else None."""
    if run.state == RunState.RUNNING:
        since = run.lease_expires_at
    elif run.state in _WAKING and (run.lease_expires_at is None or run.lease_expires_at <= now):
        since = run.next_wake_at or run.updated_at
    else:
        return None
    if since is not None and run.reserved_for and run.reserved_until:  # others could not take it before
        since = max(since, run.reserved_until)
    return since if since is not None and since <= now - silent_after() else None


@dataclass(frozen=True)
class Health:
    live: bool  # some executor beat within the silent threshold and did not stop
    last_beat_at: datetime | None  # the latest beat of any executor (None: none ever registered)


def health(now: datetime) -> Health:
    """One small query (the console's banner on every page)."""
    found = Executor.objects.aggregate(
        latest=Max("last_beat_at"), live=Max("last_beat_at", filter=Q(stopped_at__isnull=True))
    )
    return Health(live=bool(found["live"] and found["live"] > now - silent_after()), last_beat_at=found["latest"])


def any_live(now: datetime) -> bool:
    return Executor.objects.filter(live(now)).exists()


def listing(now: datetime) -> list[dict[str, Any]]:
    """The executors the dashboard lists, the most recently beaten first: each with ``silent``,
    ``beat_age`` (seconds since its last beat) and ``runs_held`` (runs whose live lease it owns:
    read from the runs, one grouped query over the runs in progress)."""
    executors = list(Executor.objects.order_by("-last_beat_at", "owner")[:LISTED])
    held = dict(
        WorkflowRun.objects.filter(
            state__in=IN_PROGRESS_RUN_STATES,
            lease_expires_at__gt=now,
            lease_owner__in=[e.owner for e in executors],
        )
        .values_list("lease_owner")
        .annotate(n=Count("pk"))
        .order_by()
    )
    threshold = silent_after()
    return [
        {
            "executor": e,
            "stopped": e.stopped_at is not None,
            "silent": e.stopped_at is None and now - e.last_beat_at >= threshold,
            "beat_age": max(0, int((now - e.last_beat_at).total_seconds())),
            "runs_held": held.get(e.owner, 0),
            "workflows": ", ".join(f"{name} v{'/'.join(map(str, v))}" for name, v in sorted(e.workflows.items())),
        }
        for e in executors
    ]
