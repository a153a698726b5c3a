"""Claiming runs: the executor's lease on a run (claim, takeover of an expired lease), and the
sweeper's bookkeeping of which runs and outbox messages have a task queued."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from functools import cache
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Exists, OuterRef, Q

from recovery import clock, registry
from recovery.engine import metrics, storage
from recovery.models import (
    OutboxMessage,
    RunState,
    StepExecution,
    SweeperBeat,
    WorkflowPause,
    WorkflowRun,
)
from recovery.states import AuditAction

from ._core import (
    RUN_LEASE_FIELDS,
    Lease,
    _audit,
    _check,
    _observed,
    _renew,
    _save_run,
    _snap,
    default_owner,
    lease_duration,
)
from .checkpoints import _copy
from .outbox import locked_rows, outbox_due
from .tables import EXECUTOR, RUN_TRANSITIONS


def _undispatched(now: datetime) -> Q:
    """No task queued for it, or the one queued is old enough to be presumed lost."""
    stale = now - timedelta(seconds=settings.RECOVERY_REDISPATCH_SECONDS)
    return Q(dispatched_at__isnull=True) | Q(dispatched_at__lte=stale)


def _dispatch(qs, limit: int, now: datetime) -> list[int]:
    with transaction.atomic():
        pks = list(locked_rows(qs).values_list("pk", flat=True)[:limit])
        qs.model.objects.filter(pk__in=pks).update(dispatched_at=now)
    return pks


def runs_dispatch(*, limit: int, now: datetime | None = None) -> list[int]:
    """Pick up to ``limit`` runs that are due and have no task on the broker, and stamp them
    as dispatched; the caller queues one task for each. Bookkeeping for the sweeper, not a
    transition: no state changes and nothing is audited. A duplicate task is harmless (the
    lease refuses it); this keeps a backlog from being multiplied by every sweep."""
    now = now or clock.now()
    qs = WorkflowRun.objects.filter(claimable(now), _undispatched(now)).order_by("next_wake_at", "pk")
    return _dispatch(qs, limit, now)


def outbox_dispatch(*, limit: int, now: datetime | None = None) -> list[int]:
    """As ``runs_dispatch``, for outbox messages due for a delivery attempt."""
    now = now or clock.now()
    qs = OutboxMessage.objects.filter(outbox_due(now), _undispatched(now)).order_by("next_attempt_at", "pk")
    return _dispatch(qs, limit, now)


def sweeper_beat(*, name: str, by: str | None = None, now: datetime | None = None) -> None:
    """Record that the sweeper ``name`` (Celery beat's sweep, an embedded executor's loop)
    looked for due work now: what ``/readyz`` checks. Bookkeeping, like the dispatch stamp:
    no run changes and nothing is audited."""
    SweeperBeat.objects.update_or_create(name=name, defaults={"at": now or clock.now(), "by": by or default_owner()})


# --- executor transitions --------------------------------------------------------------


def claimable(now: datetime, owner: str | None = None) -> Q:
    """Runs an executor may take now: due and unowned, or owned by a lease that expired; and
    not reserved for another executor (``owner``: the one asking; None: any executor). A pending
    run of a workflow a supervisor paused (WorkflowPause, whole) stays pending until it is
    unpaused; a run already under way is taken, and stops before its next attempt."""
    return _active(now, owner) | _waiting(now, owner)


# The states a claim walks by id (run_active_idx); a waiting run is found by its wake-up time.
ACTIVE_RUN_STATES = [RunState.PENDING, RunState.COMPENSATING, RunState.RUNNING]


def _free(now: datetime, owner: str | None) -> Q:
    """Not reserved for another executor."""
    free = Q(reserved_for__isnull=True) | Q(reserved_until__lte=now)
    return free | Q(reserved_for=owner) if owner is not None else free


def _waiting(now: datetime, owner: str | None) -> Q:
    """Claimable waiting runs: their wake-up time has come — always set: for a retry, a look-up,
    an event's deadline, a timer (run_due_idx: state, next_wake_at <= now, a range)."""
    unowned = Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lte=now)
    return Q(state=RunState.WAITING, next_wake_at__lte=now) & unowned & _free(now, owner)


def _active(now: datetime, owner: str | None) -> Q:
    """Claimable pending and compensating runs (due, unowned) and running ones whose lease
    expired, written without a condition on one state as an alternative of its own: so
    PostgreSQL walks run_active_idx by id and stops at the first (alternatives on one state each
    are served by a bitmap of every such run, read whole then sorted: a backlog of 400 pending
    runs was 400 rows a claim). The states come first, as literals (``_states_inline``), to match
    that index's predicate."""
    paused = WorkflowPause.objects.filter(workflow_name=OuterRef("workflow_name"), step_name="", released_at=None)
    released = Exists(paused.filter(pk=OuterRef("workflow_pause_id")))  # a canary of the pause in force
    return (
        Q(state__in=ACTIVE_RUN_STATES)
        & (Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lte=now))
        & (~Q(state=RunState.RUNNING) | Q(lease_expires_at__lte=now))  # taken over: its lease expired
        & (Q(state=RunState.RUNNING) | Q(next_wake_at__isnull=True) | Q(next_wake_at__lte=now))  # due
        & (~Q(state=RunState.PENDING) | ~Exists(paused) | released)  # not kept pending by a pause
        & _free(now, owner)
    )


def _pick_in_two_walks(
    deployed: tuple[tuple[str, tuple[int, ...]], ...], columns: tuple[str, ...]
) -> tuple[str, tuple[Any, ...]]:
    """PostgreSQL's pick of the next run, as two walks that each stop at the first run they can
    lock: a waiting run whose time has come (run_due_idx: state, next_wake_at <= now, a range),
    else the oldest pending, compensating or running one (run_active_idx, by id). A run waiting
    for days is in neither: 100,000 of them cost a claim nothing (bench/waits.py), where one walk
    by id over every run in progress read them all. The second walk runs only when the first
    found nothing (its one-time filter)."""
    base = WorkflowRun.objects.filter(registry.deployed_filter(deployed))
    now, owner = _SENTINEL_TIME, _SENTINEL_OWNER
    skip = connection.features.has_select_for_update_skip_locked
    waiting = base.filter(_waiting(now, owner)).order_by("next_wake_at", "pk")
    first_found = "NOT EXISTS (SELECT 1 FROM due_waiting)"  # the second walk only if the first found none
    active = base.filter(_active(now, owner)).extra(where=[first_found]).order_by("pk")
    parts = []
    for qs in (waiting, active):
        with transaction.atomic():  # Django compiles FOR UPDATE only inside a transaction; nothing runs here
            parts.append(qs.select_for_update(skip_locked=skip).values(*columns)[:1].query.sql_with_params())
    (w_sql, w_params), (a_sql, a_params) = parts
    sql = f"WITH due_waiting AS ({w_sql}), oldest AS ({a_sql}) SELECT * FROM due_waiting UNION ALL SELECT * FROM oldest"
    return _states_inline(sql, (*w_params, *a_params))


def runs_release_reservation(*, run_pks: Iterable[int], owner: str) -> int:
    """Give the runs reserved for ``owner`` back to every executor (bookkeeping, like the
    dispatch stamp: no state changes and nothing is audited). Returns how many were released."""
    return WorkflowRun.objects.filter(pk__in=list(run_pks), reserved_for=owner).update(
        reserved_for=None, reserved_until=None
    )


def run_claim(*, run_pk: int, owner: str | None = None, now: datetime | None = None) -> Lease | None:
    """Take the run with a fresh lease generation, or return None if it is not claimable
    (another executor holds a live lease, it is not due, or it is finished)."""
    return _claim_one(owner, now or clock.now(), run_pk)


def run_claim_next(*, owner: str | None = None, now: datetime | None = None) -> Lease | None:
    """Take the oldest run that is due, skipping runs another executor is claiming right now;
    None when nothing is due."""
    return _claim_one(owner, now or clock.now())


# The claim's state switch, from the table: which kind of claim a run in each state takes.
CLAIMS = ("claim_compensation", "claim")


def _claim_kind(state: str) -> str:
    return next((kind for kind in CLAIMS if state in RUN_TRANSITIONS[kind][0]), "claim")


@cache
def _claim_moves() -> tuple[tuple[tuple[str, ...], str], ...]:
    """The same switch as data for the one-statement claim: ((from states), to) per kind."""
    return tuple((tuple(sorted(RUN_TRANSITIONS[k][0])), RUN_TRANSITIONS[k][1]) for k in CLAIMS)


def _claim_one(owner: str | None, now: datetime, run_pk: int | None = None) -> Lease | None:
    owner = owner or default_owner()
    if connection.vendor == "postgresql":
        return _claim_in_one_statement(owner, now, run_pk)
    return _claim_in_transaction(owner, now, run_pk)


def _claim_in_one_statement(owner: str, now: datetime, run_pk: int | None) -> Lease | None:
    """PostgreSQL: the claim in one round trip (storage.claim)."""
    sql, params = _pick_sql(connection.vendor, run_pk is not None, registry.deployed(), _PICKED)
    pick = _pick_params(params, now, run_pk, owner)
    claimed = storage.claim(sql, pick, _claim_moves(), owner, now + lease_duration(), now)
    if claimed is None:
        return None
    run, steps, taken_over, due_at = claimed
    _observed(run, AuditAction.LEASE_TAKEOVER if taken_over else AuditAction.CLAIM, "", {"run": run.state}, EXECUTOR)
    metrics.claimed(run.workflow_name, due_at=due_at, now=now)
    return _lease(run, steps, taken_over=taken_over)


# What the one-statement claim reads of the run it picks, before changing it.
_PICKED = ("id", "state", "lease_owner", "next_wake_at", "lease_expires_at", "updated_at")


def _claim_in_transaction(owner: str, now: datetime, run_pk: int | None) -> Lease | None:
    """Any database: pick, check, save and audit in one transaction."""
    with transaction.atomic():
        sql, params = _pick_sql(connection.vendor, run_pk is not None, registry.deployed())
        run = next(iter(WorkflowRun.objects.raw(sql, _pick_params(params, now, run_pk, owner))), None)
        return _claim(run, owner, now)


_SENTINEL_TIME = datetime(1970, 1, 2, tzinfo=UTC)
_SENTINEL_OWNER = "\x00the claiming executor"


@cache
def _pick_sql(
    vendor: str, one_run: bool, deployed: tuple[tuple[str, tuple[int, ...]], ...], columns: tuple[str, ...] = ()
) -> tuple[str, tuple[Any, ...]]:
    """The SQL of ``claimable()`` among the runs whose (name, version) this process has
    (``deployed``: a run of another version waits for a process that has it, in its state),
    locked, oldest first, one row; compiled once per registry with a placeholder time: compiling
    that Q costs an executor more than running the query."""
    qs = WorkflowRun.objects.filter(claimable(_SENTINEL_TIME, _SENTINEL_OWNER), registry.deployed_filter(deployed))
    if one_run:
        qs = qs.filter(pk=-1)
    elif vendor == "postgresql" and columns:
        return _pick_in_two_walks(deployed, columns)
    qs = qs.order_by("pk").select_for_update(skip_locked=connection.features.has_select_for_update_skip_locked)
    if columns:
        qs = qs.values(*columns)
    with transaction.atomic():  # Django compiles FOR UPDATE only inside a transaction; nothing runs here
        return _states_inline(*qs[:1].query.sql_with_params())


def _states_inline(sql: str, params: tuple[Any, ...]) -> tuple[str, tuple[Any, ...]]:
    """The run states written into the statement as literals, the other values left as
    parameters. A prepared claim runs on a generic plan after its fifth execution, and there
    PostgreSQL matches run_in_progress_idx's predicate (``state IN (…)``) only against literals:
    with the states as parameters it walks every finished run instead."""
    parts = sql.split("%s")
    assert len(parts) == len(params) + 1, "a placeholder the claim did not compile"
    out, kept = [parts[0]], []
    for value, part in zip(params, parts[1:], strict=True):
        if isinstance(value, RunState):
            out.append(f"'{value.value}'")  # a fixed enum value: letters and underscores
        else:
            out.append("%s")
            kept.append(value)
        out.append(part)
    return "".join(out), tuple(kept)


def _pick_params(template: tuple[Any, ...], now: datetime, run_pk: int | None, owner: str) -> list[Any]:
    sentinels = {_SENTINEL_TIME, connection.ops.adapt_datetimefield_value(_SENTINEL_TIME)}
    at = connection.ops.adapt_datetimefield_value(now)
    return [at if p in sentinels else run_pk if p == -1 else owner if p == _SENTINEL_OWNER else p for p in template]


@cache
def _steps_sql(vendor: str) -> str:
    """A run's steps, in order; compiled once (one parameter: the run's id)."""
    sql, params = StepExecution.objects.filter(run_id=-1).query.sql_with_params()
    assert list(params) == [-1]
    return sql


def _lease(run: WorkflowRun, steps: Iterable[StepExecution], *, taken_over: bool) -> Lease:
    return Lease(
        run_pk=run.pk,
        owner=run.lease_owner,
        generation=run.lease_generation,
        seen=_copy(run, steps),
        taken_over=taken_over,
    )


def _take_lease(run: WorkflowRun, owner: str, now: datetime) -> None:
    """A claim's changes to the run, in memory (the caller saves them, which bumps its revision):
    the state the transitions' table gives, a new lease for ``owner``, no wake-up time."""
    run.state = _check(RUN_TRANSITIONS, _claim_kind(run.state), run.state, "run")
    run.lease_owner = owner
    run.lease_generation += 1
    run.next_wake_at = None
    run.dispatched_at = None  # the queued task (if any) is consumed: the sweeper may queue another
    _renew(run, now)


def _claim(run: WorkflowRun | None, owner: str, now: datetime) -> Lease | None:
    if run is None:
        return None
    before = _snap(run)
    takeover = run.lease_owner != ""
    due_at = run.next_wake_at or run.lease_expires_at or run.updated_at  # as storage.claim reads it
    action = AuditAction.LEASE_TAKEOVER if takeover else AuditAction.CLAIM
    if takeover:
        before["lease_owner"] = run.lease_owner
    _take_lease(run, owner, now)
    _save_run(run, [*RUN_LEASE_FIELDS, "dispatched_at"], now)
    _audit(run, action, actor=None, before=before, after={**_snap(run), "lease_owner": owner}, now=now)
    metrics.claimed(run.workflow_name, due_at=due_at, now=now)
    # The executor's copy, read under the run's lock: it needs no other read while it holds the run.
    return _lease(run, StepExecution.objects.raw(_steps_sql(connection.vendor), [run.pk]), taken_over=takeover)
