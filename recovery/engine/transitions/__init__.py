"""Transition functions: the only code that changes a run or a step.

Each one runs in one ``transaction.atomic()``: it locks the run row (always the run first,
then its steps), checks the allowed-transitions table, saves with ``update_fields`` and
writes exactly one audit event with the state before and after. None does network I/O.

Executor transitions take a ``Lease``: they write only while the run's
``lease_generation`` is still the lease's (a fencing token), so a worker that wakes up after
another executor took its run over cannot write anything (``LeaseLost``). Each fenced write
also renews the lease.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import cache
from typing import Any

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, connection, transaction
from django.db.models import Max, Q

from recovery import clock, permissions, redaction
from recovery.engine import dispatch, storage
from recovery.errors import (
    ApprovalRequired,
    ErrorKind,
    InvalidTransition,
    LeaseLost,
    RunChanged,
    StartConflict,
    StepError,
    TransientError,
)
from recovery.models import (
    ApprovalRequest,
    ApprovalState,
    AuditEvent,
    DecisionState,
    ModelDecision,
    OutboxMessage,
    OutboxState,
    RunState,
    StepExecution,
    StepState,
    WorkflowRun,
)
from recovery.redaction import redact_text
from recovery.workflow import Outcome, Reconcile, StepSpec, Workflow, get_workflow, idempotency_key, payload_hash

log = logging.getLogger("recovery.transitions")

EXECUTOR = "executor"

# action -> (states it may start from, state it leads to)
RUN_TRANSITIONS: dict[str, tuple[frozenset[RunState], RunState]] = {
    "claim": (frozenset({RunState.PENDING, RunState.WAITING, RunState.RUNNING}), RunState.RUNNING),
    "claim_compensation": (frozenset({RunState.COMPENSATING}), RunState.COMPENSATING),
    "wait": (frozenset({RunState.RUNNING}), RunState.WAITING),
    "release": (frozenset({RunState.RUNNING}), RunState.PENDING),
    "complete": (frozenset({RunState.RUNNING}), RunState.COMPLETED),
    "review": (frozenset({RunState.RUNNING, RunState.COMPENSATING}), RunState.NEEDS_REVIEW),
    "fail": (frozenset({RunState.RUNNING}), RunState.FAILED),
    "resume": (frozenset({RunState.NEEDS_REVIEW, RunState.FAILED, RunState.WAITING}), RunState.PENDING),
    "terminate": (
        frozenset(
            {
                RunState.PENDING,
                RunState.RUNNING,
                RunState.WAITING,
                RunState.NEEDS_REVIEW,
                RunState.FAILED,
                RunState.COMPENSATION_FAILED,
            }
        ),
        RunState.TERMINATED,
    ),
    "compensate": (
        frozenset(
            {
                RunState.PENDING,
                RunState.WAITING,
                RunState.NEEDS_REVIEW,
                RunState.FAILED,
                RunState.COMPLETED,
                RunState.COMPENSATION_FAILED,
                RunState.TERMINATED,
            }
        ),
        RunState.COMPENSATING,
    ),
    "compensation_wait": (frozenset({RunState.COMPENSATING}), RunState.COMPENSATING),
    "compensation_fail": (frozenset({RunState.COMPENSATING}), RunState.COMPENSATION_FAILED),
    # the target depends on what is left: compensated, completed, or needs_review
    "compensation_done": (frozenset({RunState.COMPENSATING}), RunState.COMPENSATED),
}

STEP_TRANSITIONS: dict[str, tuple[frozenset[StepState], StepState]] = {
    "begin": (frozenset({StepState.PENDING, StepState.FAILED, StepState.UNKNOWN}), StepState.RUNNING),
    "succeed": (frozenset({StepState.RUNNING, StepState.UNKNOWN, StepState.PENDING}), StepState.SUCCEEDED),
    # a local step's attempt and its success in one commit: from wherever "begin" may start
    "attempt_succeed": (frozenset({StepState.PENDING, StepState.FAILED, StepState.UNKNOWN}), StepState.SUCCEEDED),
    # from pending/failed: refused before the call (an intent that cannot be built or conflicts)
    "fail": (frozenset({StepState.RUNNING, StepState.PENDING, StepState.FAILED}), StepState.FAILED),
    "mark_unknown": (frozenset({StepState.RUNNING}), StepState.UNKNOWN),
    "defer_reconcile": (frozenset({StepState.UNKNOWN}), StepState.UNKNOWN),
    # a look-up missed while the request may still commit: look again at the window's end
    "await_settle": (frozenset({StepState.UNKNOWN}), StepState.UNKNOWN),
    "reset": (frozenset({StepState.UNKNOWN, StepState.FAILED}), StepState.PENDING),
    "skip": (frozenset({StepState.PENDING}), StepState.SKIPPED),
    "compensate": (frozenset({StepState.SUCCEEDED, StepState.COMPENSATION_FAILED}), StepState.COMPENSATING),
    "compensation_begin": (frozenset({StepState.COMPENSATING}), StepState.COMPENSATING),
    "compensation_succeed": (frozenset({StepState.COMPENSATING}), StepState.COMPENSATED),
    "compensation_fail": (frozenset({StepState.COMPENSATING}), StepState.COMPENSATION_FAILED),
}
LEASED_RUN_STATES = frozenset({RunState.RUNNING, RunState.COMPENSATING})

TERMINAL_RUN_STATES = frozenset({RunState.COMPLETED, RunState.COMPENSATED, RunState.TERMINATED})
DONE_STEP_STATES = frozenset({StepState.SUCCEEDED, StepState.SKIPPED})


@dataclass(frozen=True)
class Lease:
    """An executor's claim on a run: the fencing token every executor transition checks.

    ``seen`` is the executor's copy of the run and its steps as its own transitions last left
    them (``leased_run``); it is dropped as soon as a transition finds that someone else has
    saved the run since (``WorkflowRun.revision``)."""

    run_pk: int
    owner: str
    generation: int
    seen: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    # The claim took the run over from an executor whose lease expired (it died, or hung):
    # whatever it was doing may have killed it, so this executor checkpoints every attempt
    # before making it, local steps included (see executor._execute).
    taken_over: bool = False


def default_owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def lease_duration() -> timedelta:
    return timedelta(seconds=settings.RECOVERY_LEASE_SECONDS)


# --- helpers ---------------------------------------------------------------------------


def _check(table: dict, action: str, current: str, what: str) -> Any:
    allowed, target = table[action]
    if current not in allowed:
        raise InvalidTransition(f"cannot {action.replace('_', ' ')} a {what} that is {current}")
    return target


def _redacted(run: WorkflowRun, value: Any) -> Any:
    """``value`` as it may be persisted: credentials replaced, with the run's workflow's own
    sensitive fields (recovery.redaction). Everything a transition stores that came from a
    step, a remote system, an exception or an operator goes through this or ``redact_text``
    — before any truncation, so that no cut leaves half a secret behind."""
    try:
        fields = get_workflow(run.workflow_name).redact_fields
    except LookupError:
        fields = ()
    return redaction.redact(value, fields=fields)


def _error_text(error: StepError, limit: int) -> str:
    return redact_text(error.message)[:limit]


def _actor_fields(actor: AbstractBaseUser | str | None) -> dict[str, Any]:
    """A user, a system's label (``"api:erp"``), or None for the executor."""
    if actor is None:
        return {"actor": EXECUTOR, "actor_user": None}
    if isinstance(actor, str):
        return {"actor": actor, "actor_user": None}
    return {"actor": actor.get_username(), "actor_user": actor}


def _audit(
    run: WorkflowRun,
    action: str,
    *,
    actor: AbstractBaseUser | str | None,
    before: dict,
    after: dict,
    now: datetime,
    step_name: str = "",
    reason: str = "",
) -> None:
    storage.insert(AuditEvent, _audit_row(run, action, _actor_fields(actor), step_name, reason, before, after, now))


def _audit_row(
    run: WorkflowRun,
    action: str,
    who: dict[str, Any],
    step_name: str,
    reason: str,
    before: dict,
    after: dict,
    now: datetime,
) -> dict[str, Any]:
    user = who["actor_user"]
    return {
        "run_id": run.pk,
        "step_name": step_name,
        "action": action,
        "reason": redact_text(reason),
        "before": redaction.redact(before),
        "after": redaction.redact(after),
        "at": now,
        "actor": who["actor"],
        "actor_user_id": user.pk if user is not None else None,
    }


def _snap(run: WorkflowRun, step: StepExecution | None = None) -> dict[str, Any]:
    snap: dict[str, Any] = {"run": run.state}
    if step is not None:
        snap["step"] = step.state
        snap["attempts"] = step.attempts
        if step.remote_ref:
            snap["remote_ref"] = step.remote_ref
        if step.last_error_kind:
            snap["error_kind"] = step.last_error_kind
    return snap


def _history_user(obj: Any, actor: AbstractBaseUser | None) -> None:
    # django-simple-history records who made a change only when told (no request under Celery).
    # It keeps the versions people saved; the executor's own changes are in the audit trail,
    # and a history row per checkpoint would double the executor's writes.
    obj._history_user = actor
    obj.skip_history_when_saving = actor is None


RUN_LEASE_FIELDS = ["state", "lease_owner", "lease_expires_at", "lease_generation", "next_wake_at", "updated_at"]


def _locked_run(lease: Lease) -> WorkflowRun:
    """Lock the run and check the fencing token. Raises LeaseLost if another executor took it.

    The run's row lock is what every writer of the run or of its steps takes first; if the
    run's revision is the one this executor last wrote, nobody else has changed either since,
    and ``lease.seen`` stays; otherwise it is dropped."""
    run = WorkflowRun.objects.select_for_update().filter(pk=lease.run_pk).first()
    if run is None or run.lease_generation != lease.generation or run.state not in LEASED_RUN_STATES:
        lease.seen.clear()
        raise LeaseLost(f"lease {lease.generation} on run {lease.run_pk} is no longer held")
    seen = lease.seen.get("run")
    if seen is None or seen.revision != run.revision:
        lease.seen.clear()
    lease.seen["run"] = run  # saved by the transition, it is again what this executor last wrote
    return run


def _locked_step(run: WorkflowRun, step_name: str, lease: Lease | None = None) -> StepExecution:
    """The step, locked — or, under a lease whose copy is current, that copy: the run's lock,
    already held, keeps every other writer of the step out."""
    steps = lease.seen.get("steps") if lease is not None else None
    step = steps.get(step_name) if steps else None
    if step is None:
        step = StepExecution.objects.select_for_update().get(run=run, step_name=step_name)
        if steps is not None:
            steps[step_name] = step
    step.run = run
    return step


def leased_run(lease: Lease) -> tuple[WorkflowRun, list[StepExecution]] | None:
    """The run and its steps (in order) as the lease holder sees them: its own copy while it is
    current, else read again (one statement, one snapshot). None if the lease is lost."""
    run, steps = lease.seen.get("run"), lease.seen.get("steps")
    if run is None or steps is None:
        rows = list(StepExecution.objects.filter(run_id=lease.run_pk).select_related("run").order_by("position"))
        if not rows:
            run = WorkflowRun.objects.filter(pk=lease.run_pk).first()
            if run is None:
                return None
        else:
            run = rows[0].run
        lease.seen.update(_copy(run, rows))
        steps = lease.seen["steps"]
    if run.lease_generation != lease.generation or run.state not in LEASED_RUN_STATES:
        return None
    return run, sorted(steps.values(), key=lambda s: s.position)


@dataclass
class _StepChange:
    run: WorkflowRun
    step: StepExecution
    now: datetime
    action: str
    reason: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


@contextmanager
def _leased_step(lease: Lease, step_name: str, action: str, now: datetime | None) -> Iterator[_StepChange]:
    """One executor transition of one step: in one transaction, lock the run (fenced by the
    lease) and then the step, let the body change them, and write the audit event with the
    state before and after (plus ``change.extra``). An exception writes nothing."""
    now = now or clock.now()
    try:
        with transaction.atomic():
            run = _fenced_run(lease, now, step_name)
            step = _locked_step(run, step_name, lease)
            before = _snap(run, step)
            change = _StepChange(run=run, step=step, now=now, action=action)
            yield change
            _audit(
                run,
                change.action,
                actor=None,
                step_name=step_name,
                reason=change.reason,
                before=before,
                after={**_snap(run, step), **change.extra},
                now=now,
            )
    except BaseException:
        lease.seen.clear()  # the copy may hold changes that were rolled back
        raise


def _step_transition(
    lease: Lease,
    step_name: str,
    action: str,
    now: datetime | None,
    body: Callable[[_StepChange], None],
    *,
    one_statement: bool = False,
) -> StepExecution:
    """Run ``body`` as a transition of one step (see ``_leased_step``). With ``one_statement``
    (a body that only changes the step, and the run through ``_save_run``), on PostgreSQL,
    under a current copy: the whole transition as one statement (``storage.checkpoint``); if
    its fence does not match, the copy is dropped and the transition runs the ordinary way."""
    now = now or clock.now()
    if one_statement and connection.vendor == "postgresql":
        step = _one_statement(lease, step_name, action, now, body)
        if step is not None:
            return step
    with _leased_step(lease, step_name, action, now) as change:
        body(change)
        return change.step


def _one_statement(
    lease: Lease, step_name: str, action: str, now: datetime, body: Callable[[_StepChange], None]
) -> StepExecution | None:
    run, steps = lease.seen.get("run"), lease.seen.get("steps")
    step = steps.get(step_name) if steps else None
    if run is None or step is None:
        return None
    revision, before = run.revision, _snap(run, step)
    renewal = _renewal(now, step_name)
    for name, value in renewal.items():
        setattr(run, name, value)
    change = _StepChange(run=run, step=step, now=now, action=action)
    collected: list[tuple[WorkflowRun | StepExecution, set[str]]] = []
    token = _COLLECTED.set(collected)
    try:
        try:
            body(change)
        except Exception:
            # Perhaps refused on a copy someone else has since changed: decide on fresh rows
            # (the ordinary way runs the body again, and raises again if it still must).
            lease.seen.clear()
            return None
        finally:
            _COLLECTED.reset(token)
        run_fields, step_fields = set(renewal), set()
        for obj, fields in collected:
            assert obj is run or obj is step, "a one-statement transition saves only its run and its step"
            (run_fields if obj is run else step_fields).update(fields)
        after = {**_snap(run, step), **change.extra}
        written = storage.checkpoint(
            run.pk,
            {name: getattr(run, name) for name in run_fields},
            {"lease_generation": lease.generation, "revision": revision, "state": LEASED_RUN_STATES},
            step.pk,
            {name: getattr(step, name) for name in step_fields or {"updated_at"}},
            _audit_row(run, action, _actor_fields(None), step_name, change.reason, before, after, now),
        )
    except BaseException:
        lease.seen.clear()  # the copy holds changes that were not written
        raise
    if not written:
        lease.seen.clear()  # someone else saved the run, or the lease is gone: the ordinary way decides
        return None
    return step


def _fenced_run(lease: Lease, now: datetime, step_name: str) -> WorkflowRun:
    """Lock the run for a transition of its step ``step_name``, renew the lease and mark the
    step as the run's current one. With a current copy (``lease.seen``) that is one fenced
    UPDATE, which matches only while this executor holds the lease and nobody else has saved
    the run since; otherwise ``_locked_run`` decides (LeaseLost, or a fresh copy)."""
    changes = _renewal(now, step_name)
    run = lease.seen.get("run")
    fenced = run is not None and "steps" in lease.seen
    if fenced:
        fence = {"lease_generation": lease.generation, "revision": run.revision, "state": LEASED_RUN_STATES}
        fenced = storage.update(WorkflowRun, lease.run_pk, changes, **fence) == 1
    if not fenced:
        run = _locked_run(lease)
        storage.update(WorkflowRun, run.pk, changes)
    for name, value in changes.items():
        setattr(run, name, value)
    return run


def _renewal(now: datetime, step_name: str) -> dict[str, Any]:
    """What every transition of a step writes on its run: the lease renewed, the step current."""
    return {"updated_at": now, "lease_expires_at": now + lease_duration(), "current_step": step_name}


# While set, the engine's own saves are collected here instead of written (_one_statement).
_COLLECTED: ContextVar[list[tuple[WorkflowRun | StepExecution, set[str]]] | None] = ContextVar(
    "recovery_collected_saves", default=None
)


def _save(obj: WorkflowRun | StepExecution, fields: set[str], actor: AbstractBaseUser | None) -> None:
    collected = _COLLECTED.get()
    if collected is not None and actor is None:
        collected.append((obj, fields))
        return
    if actor is None:
        # The engine's own checkpoint: one UPDATE, no saved version (see _history_user).
        storage.update(type(obj), obj.pk, {name: getattr(obj, name) for name in fields})
    else:
        _history_user(obj, actor)
        obj.save(update_fields=sorted(fields))


def _save_run(run: WorkflowRun, fields: list[str], now: datetime, actor: AbstractBaseUser | None = None) -> None:
    """Saves of a run bump its revision: an executor holding the run sees that someone else
    changed it (or one of its steps: whoever changes a step without holding the run's lease
    saves the run too) and reads it again."""
    run.updated_at = now
    run.revision += 1
    _save(run, {*fields, "updated_at", "revision"}, actor)


def _save_step(step: StepExecution, fields: list[str], now: datetime, actor: AbstractBaseUser | None = None) -> None:
    step.updated_at = now
    _save(step, {*fields, "updated_at"}, actor)


def _renew(run: WorkflowRun, now: datetime) -> None:
    run.lease_expires_at = now + lease_duration()


def _release_into(run: WorkflowRun, target: RunState, *, wake_at: datetime | None = None, reason: str = "") -> None:
    run.state = target
    run.lease_owner = ""
    run.lease_expires_at = None
    run.next_wake_at = wake_at
    run.status_reason = redact_text(reason)


def _undispatched(now: datetime) -> Q:
    """No task queued for it, or the one queued is old enough to be presumed lost."""
    stale = now - timedelta(seconds=settings.RECOVERY_REDISPATCH_SECONDS)
    return Q(dispatched_at__isnull=True) | Q(dispatched_at__lte=stale)


def _dispatch(qs, limit: int, now: datetime) -> list[int]:
    with transaction.atomic():
        locked = qs.select_for_update(skip_locked=connection.features.has_select_for_update_skip_locked)
        pks = list(locked.values_list("pk", flat=True)[:limit])
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


# --- starting a run --------------------------------------------------------------------


def run_start(
    *, workflow: Workflow | str, data: Any, actor: AbstractBaseUser | str | None = None, now: datetime | None = None
) -> tuple[WorkflowRun, bool]:
    """Create the run for a business event, or return the one that event already created.

    The workflow id comes from the event, never from a worker or an attempt. The unique
    constraint on ``workflow_id`` decides between concurrent starts, not a pre-check. The
    same id with a different input is a conflict, never a silent replay.
    """
    wf = get_workflow(workflow) if isinstance(workflow, str) else workflow
    # What is persisted is what is replayed: the run's input is kept redacted, and its id and
    # hash are taken from that, so a secret is neither stored nor hashed.
    validated = wf.redact(wf.validate_input(data))
    workflow_id = wf.workflow_id(validated)
    limit = WorkflowRun._meta.get_field("workflow_id").max_length
    if not isinstance(workflow_id, str) or not 0 < len(workflow_id) <= limit:
        length = len(workflow_id) if isinstance(workflow_id, str) else 0
        raise ValueError(
            f"the workflow id must be 1 to {limit} characters (the event's keys make it); this one has "
            f"{length:,} (at most {limit})"
        )
    input_hash = payload_hash(validated)
    now = now or clock.now()
    try:
        with transaction.atomic():
            run = WorkflowRun.objects.create(
                workflow_id=workflow_id,
                workflow_name=wf.name,
                workflow_version=wf.version,
                state=RunState.PENDING,
                input=validated,
                input_hash=input_hash,
                created_at=now,
                updated_at=now,
            )
            StepExecution.objects.bulk_create(
                StepExecution(
                    run=run,
                    step_name=spec.name,
                    position=spec.position,
                    key_version=spec.key_version,
                    idempotency_key=idempotency_key(workflow_id, spec.name, spec.key_version),
                    updated_at=now,
                )
                for spec in wf.steps
            )
            _audit(run, "start", actor=actor, before={}, after=_snap(run), now=now)
            dispatch.enqueue_run(run.pk)
    except IntegrityError:
        run = WorkflowRun.objects.get(workflow_id=workflow_id)
        if run.input_hash != input_hash:
            raise StartConflict(
                f"run {workflow_id} already exists with a different input; start a new business event instead"
            ) from None
        return run, False
    return run, True


# --- executor transitions --------------------------------------------------------------


def claimable(now: datetime) -> Q:
    """Runs an executor may take now: due and unowned, or owned by a lease that expired."""
    unowned = Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lte=now)
    due = Q(next_wake_at__isnull=True) | Q(next_wake_at__lte=now)
    in_progress = Q(state__in=[RunState.PENDING, RunState.WAITING, RunState.COMPENSATING, RunState.RUNNING])
    # in_progress is implied by the rest; stated, it lets PostgreSQL use run_in_progress_idx.
    return in_progress & (
        (Q(state__in=[RunState.PENDING, RunState.WAITING, RunState.COMPENSATING]) & due & unowned)
        | Q(state=RunState.RUNNING, lease_expires_at__lte=now)
    )


def run_claim(*, run_pk: int, owner: str | None = None, now: datetime | None = None) -> Lease | None:
    """Take the run with a fresh lease generation, or return None if it is not claimable
    (another executor holds a live lease, it is not due, or it is finished)."""
    return _claim_one(owner, now or clock.now(), run_pk)


def run_claim_next(*, owner: str | None = None, now: datetime | None = None) -> Lease | None:
    """Take the oldest run that is due, skipping runs another executor is claiming right now;
    None when nothing is due."""
    return _claim_one(owner, now or clock.now())


def _claim_one(owner: str | None, now: datetime, run_pk: int | None = None) -> Lease | None:
    owner = owner or default_owner()
    if connection.vendor == "postgresql":
        # One statement (storage.claim): the same transition as _claim, in one round trip.
        sql, params = _pick_sql(connection.vendor, run_pk is not None, ("id", "state", "lease_owner"))
        claimed = storage.claim(sql, _pick_params(params, now, run_pk), owner, now + lease_duration(), now)
        if claimed is None:
            return None
        run, steps, taken_over = claimed
        return _lease(run, steps, taken_over=taken_over)
    with transaction.atomic():
        sql, params = _pick_sql(connection.vendor, run_pk is not None)
        run = next(iter(WorkflowRun.objects.raw(sql, _pick_params(params, now, run_pk))), None)
        return _claim(run, owner, now)


_SENTINEL_TIME = datetime(1970, 1, 2, tzinfo=UTC)


@cache
def _pick_sql(vendor: str, one_run: bool, columns: tuple[str, ...] = ()) -> tuple[str, tuple[Any, ...]]:
    """The SQL of ``claimable()`` (locked, oldest first, one row), compiled once with a
    placeholder time: compiling that Q costs an executor more than running the query."""
    qs = WorkflowRun.objects.filter(claimable(_SENTINEL_TIME))
    if one_run:
        qs = qs.filter(pk=-1)
    qs = qs.order_by("pk").select_for_update(skip_locked=connection.features.has_select_for_update_skip_locked)
    if columns:
        qs = qs.values(*columns)
    with transaction.atomic():  # Django compiles FOR UPDATE only inside a transaction; nothing runs here
        return qs[:1].query.sql_with_params()


def _pick_params(template: tuple[Any, ...], now: datetime, run_pk: int | None) -> list[Any]:
    sentinels = {_SENTINEL_TIME, connection.ops.adapt_datetimefield_value(_SENTINEL_TIME)}
    at = connection.ops.adapt_datetimefield_value(now)
    return [at if p in sentinels else run_pk if p == -1 else p for p in template]


@cache
def _steps_sql(vendor: str) -> str:
    """A run's steps, in order; compiled once (one parameter: the run's id)."""
    sql, params = StepExecution.objects.filter(run_id=-1).query.sql_with_params()
    assert list(params) == [-1]
    return sql


def _copy(run: WorkflowRun, steps: Iterable[StepExecution]) -> dict[str, Any]:
    """``Lease.seen`` for a run and its steps, each step pointing at that run."""
    by_name = {}
    for step in steps:
        step.run = run
        by_name[step.step_name] = step
    return {"run": run, "steps": by_name}


def _lease(run: WorkflowRun, steps: Iterable[StepExecution], *, taken_over: bool) -> Lease:
    return Lease(
        run_pk=run.pk,
        owner=run.lease_owner,
        generation=run.lease_generation,
        seen=_copy(run, steps),
        taken_over=taken_over,
    )


def _claim(run: WorkflowRun | None, owner: str, now: datetime) -> Lease | None:
    if run is None:
        return None
    before = _snap(run)
    takeover = run.lease_owner != ""
    action = "lease_takeover" if takeover else "claim"
    if takeover:
        before["lease_owner"] = run.lease_owner
    kind = "claim_compensation" if run.state == RunState.COMPENSATING else "claim"
    run.state = _check(RUN_TRANSITIONS, kind, run.state, "run")
    run.lease_owner = owner
    run.lease_generation += 1
    run.next_wake_at = None
    run.dispatched_at = None  # the queued task (if any) is consumed: the sweeper may queue another
    _renew(run, now)
    _save_run(run, [*RUN_LEASE_FIELDS, "dispatched_at"], now)
    _audit(run, action, actor=None, before=before, after={**_snap(run), "lease_owner": owner}, now=now)
    # The executor's copy, read under the run's lock: it needs no other read while it holds the run.
    return _lease(run, StepExecution.objects.raw(_steps_sql(connection.vendor), [run.pk]), taken_over=takeover)


def _record_attempt(step: StepExecution, intent: dict[str, Any], request_hash: str, now: datetime) -> list[str]:
    """Checkpoint an attempt's intent and count it; returns the fields it changed. The intent
    is stored redacted; ``request_hash`` is the hash of that redacted intent (the executor
    redacts, hashes and calls with the redacted intent: redacting again changes nothing)."""
    step.intent = _redacted(step.run, intent)
    step.request_hash = request_hash
    step.attempts += 1
    step.first_attempt_at = step.first_attempt_at or now
    step.budget_started_at = step.budget_started_at or now
    step.last_attempt_at = now
    step.next_attempt_at = None
    return [
        "intent",
        "request_hash",
        "attempts",
        "first_attempt_at",
        "budget_started_at",
        "last_attempt_at",
        "next_attempt_at",
    ]


def step_begin(
    *, lease: Lease, step_name: str, intent: dict[str, Any], request_hash: str, now: datetime | None = None
) -> StepExecution:
    """Checkpoint the validated intent before the call (rule 5): after this commit a crash
    leaves evidence that the call may have been made."""

    def body(change: _StepChange) -> None:
        step = change.step
        step.state = _check(STEP_TRANSITIONS, "begin", step.state, "step")
        _save_step(step, ["state", *_record_attempt(step, intent, request_hash, change.now)], change.now)

    return _step_transition(lease, step_name, "step_begin", now, body, one_statement=True)


def step_succeed(
    *,
    lease: Lease,
    step_name: str,
    outcome: Outcome,
    complete_run: bool = False,
    decision: dict[str, Any] | None = None,
    spec: StepSpec | None = None,
    attempt: tuple[dict[str, Any], str] | None = None,
    action: str = "step_succeed",
    reason: str = "",
    now: datetime | None = None,
) -> StepExecution:
    """Checkpoint the observed result as soon as the call returns. ``decision`` (a model
    step's validated proposal) is accepted in the same transaction; ``complete_run`` marks
    the run completed in it too when this was the last step. ``attempt`` (intent, request
    hash) counts the attempt in this same checkpoint: for a local step whose effect is in the
    caller's transaction, where no intent was committed before (nothing could have happened
    without this commit)."""

    def body(change: _StepChange) -> None:
        run, step, now = change.run, change.step, change.now
        step.state = _check(STEP_TRANSITIONS, "succeed" if attempt is None else "attempt_succeed", step.state, "step")
        # The executor goes on with this copy (and a replay reads it back): the same values.
        step.remote_ref = redact_text(outcome.remote_ref)
        step.result = _redacted(run, outcome.result)
        step.next_attempt_at = None
        fields = ["state", "remote_ref", "result", "next_attempt_at"]
        if attempt is not None:
            fields += _record_attempt(step, *attempt, now)
        _save_step(step, fields, now)
        if decision is not None:
            assert spec is not None and spec.is_decision
            accepted = _redacted(run, decision)
            latest = ModelDecision.objects.filter(run=run, step_name=step_name).aggregate(v=Max("version"))["v"] or 0
            ModelDecision.objects.create(
                run=run,
                step_name=step_name,
                version=latest + 1,
                state=DecisionState.ACCEPTED,
                schema_version=spec.schema_version,
                proposal=accepted,
                accepted=accepted,
                created_at=now,
            )
        if complete_run:
            _check(RUN_TRANSITIONS, "complete", run.state, "run")
            _release_into(run, RunState.COMPLETED)
            run.current_step = ""
            _save_run(run, [*RUN_LEASE_FIELDS, "status_reason", "current_step"], now)
        change.reason = reason

    # A decision is accepted in the same transaction: not one statement.
    return _step_transition(lease, step_name, action, now, body, one_statement=decision is None)


def step_fail(
    *,
    lease: Lease,
    step_name: str,
    error: StepError,
    spec: StepSpec,
    auto_compensate: bool = False,
    now: datetime | None = None,
) -> StepExecution:
    """Record a failed attempt and decide what follows, by the error's kind and the step's
    budget: a scheduled retry (run waiting), a permanent stop (run failed, the transient
    budget untouched), or review (budget exhausted, unclassified, or too many invalid model
    outputs — the bad output kept when the step allows). With ``auto_compensate`` (the
    workflow's policy), a permanent failure starts compensating the completed steps; a
    technical error never does."""
    with transaction.atomic():  # the failure and an automatic compensation commit together
        with _leased_step(lease, step_name, "step_fail", now) as change:
            run, step, now = change.run, change.step, change.now
            step.state = _check(STEP_TRANSITIONS, "fail", step.state, "step")
            message = redact_text(error.message)
            step.last_error_kind = error.kind
            step.last_error = message[:4000]
            step.next_attempt_at = None
            step_fields = ["state", "last_error_kind", "last_error", "next_attempt_at"]
            policy = spec.retry
            delay: float | None = None
            if error.kind == ErrorKind.INVALID_MODEL_OUTPUT:
                step.format_failures += 1
                step_fields.append("format_failures")
                ModelDecision.objects.create(
                    run=run,
                    step_name=step_name,
                    version=0,
                    state=DecisionState.INVALID,
                    schema_version=spec.schema_version,
                    invalid_output=redact_text(error.raw_output or "")[:20000] if spec.keep_invalid_output else "",
                    validation_error=message[:4000],
                    created_at=now,
                )
                if step.format_failures < policy.maximum_format_failures:
                    delay = policy.backoff(step.format_failures)
                outcome, why = RunState.NEEDS_REVIEW, f"model output invalid {step.format_failures} times"
            elif error.kind == ErrorKind.PERMANENT or error.kind in policy.non_retryable_kinds:
                outcome, why = RunState.FAILED, f"{step_name}: permanent error, not retried: {message}"
            elif policy.retries(error.kind):
                elapsed = (now - step.budget_started_at).total_seconds() if step.budget_started_at else 0.0
                delay = policy.next_delay(step.attempts - step.budget_start_attempt, error, elapsed=elapsed)
                outcome, why = RunState.NEEDS_REVIEW, f"{step_name}: retry budget exhausted: {message}"
            else:
                outcome, why = RunState.NEEDS_REVIEW, f"{step_name}: {error.kind} error needs review: {message}"

            fields = ["status_reason"]
            if delay is not None:
                step.next_attempt_at = now + timedelta(seconds=delay)
                _check(RUN_TRANSITIONS, "wait", run.state, "run")
                _release_into(
                    run, RunState.WAITING, wake_at=step.next_attempt_at, reason=f"{step_name}: retry scheduled"
                )
            else:
                _check(RUN_TRANSITIONS, "review" if outcome == RunState.NEEDS_REVIEW else "fail", run.state, "run")
                _release_into(run, outcome, reason=why)
            _save_step(step, step_fields, now)
            _save_run(run, fields + RUN_LEASE_FIELDS, now)
            change.reason = message[:1000]
        if auto_compensate and outcome == RunState.FAILED and delay is None and _compensation_targets(run):
            _start_compensation(run, actor=None, reason=f"automatic: {step_name} failed permanently", now=now)
            lease.seen.clear()  # it marked other steps: the executor's copy of them is out of date
        return step


def step_mark_unknown(
    *, lease: Lease, step_name: str, error: StepError, spec: StepSpec, now: datetime | None = None
) -> StepExecution:
    """The call may have happened and nobody can prove it either way (rule 7). Never
    relabelled as failed: it is reconciled next, or goes to an operator when the step has
    no automatic way to find out."""
    with _leased_step(lease, step_name, "step_unknown", now) as change:
        run, step, now = change.run, change.step, change.now
        step.state = _check(STEP_TRANSITIONS, "mark_unknown", step.state, "step")
        step.last_error_kind = ErrorKind.UNKNOWN_OUTCOME
        step.last_error = _error_text(error, 4000)
        _save_step(step, ["state", "last_error_kind", "last_error"], now)
        if spec.reconcile in (None, Reconcile.OPERATOR):
            _check(RUN_TRANSITIONS, "review", run.state, "run")
            _release_into(run, RunState.NEEDS_REVIEW, reason=f"{step_name}: outcome unknown, operator must reconcile")
            _save_run(run, RUN_LEASE_FIELDS + ["status_reason"], now)
        change.reason = _error_text(error, 1000)
        return step


def step_reset(*, lease: Lease, step_name: str, reason: str, now: datetime | None = None) -> StepExecution:
    """A look-up proved the unknown call never took effect: the step may be performed."""
    with _leased_step(lease, step_name, "reconciled_absent", now) as change:
        step, now = change.step, change.now
        step.state = _check(STEP_TRANSITIONS, "reset", step.state, "step")
        step.next_attempt_at = None
        _save_step(step, ["state", "next_attempt_at"], now)
        change.reason = reason
        return step


def step_defer_reconcile(
    *, lease: Lease, step_name: str, error: StepError, spec: StepSpec, now: datetime | None = None
) -> StepExecution:
    """The look-up of an unknown outcome failed: the step stays unknown (never failed). A
    retryable failure schedules another look-up within the step's budget; anything else,
    or an exhausted budget, goes to review."""
    with _leased_step(lease, step_name, "reconcile_deferred", now) as change:
        run, step, now = change.run, change.step, change.now
        step.state = _check(STEP_TRANSITIONS, "defer_reconcile", step.state, "step")
        step.reconcile_attempts += 1
        step.last_error = f"reconcile failed: {redact_text(error.message)}"[:4000]
        delay = spec.retry.next_delay(step.reconcile_attempts, error)
        if delay is None:
            step.next_attempt_at = None
            _check(RUN_TRANSITIONS, "review", run.state, "run")
            _release_into(run, RunState.NEEDS_REVIEW, reason=f"{step_name}: outcome unknown and look-up failed")
        else:
            step.next_attempt_at = now + timedelta(seconds=delay)
            _check(RUN_TRANSITIONS, "wait", run.state, "run")
            _release_into(
                run, RunState.WAITING, wake_at=step.next_attempt_at, reason=f"{step_name}: look-up retry scheduled"
            )
        _save_step(step, ["state", "reconcile_attempts", "last_error", "next_attempt_at"], now)
        _save_run(run, RUN_LEASE_FIELDS + ["status_reason"], now)
        change.reason = _error_text(error, 1000)
        return step


def in_flight_text(sent_at: datetime | None, until: datetime) -> str:
    """ "when the receiver can no longer commit the request sent at …" for a status line."""
    sent = f" sent at {sent_at:%H:%M:%S} UTC" if sent_at is not None else ""
    return f"at {until:%H:%M:%S} UTC, when the receiver can no longer commit the request{sent}"


def step_await_settle(
    *, lease: Lease, step_name: str, until: datetime, sent_at: datetime | None, now: datetime | None = None
) -> StepExecution:
    """A look-up found nothing while the request sent at ``sent_at`` may still commit (its
    in-flight window ends at ``until``): the miss proves nothing yet (rule 7). The step stays
    unknown and is looked up again at ``until``, when a miss does prove absence."""
    with _leased_step(lease, step_name, "reconcile_wait", now) as change:
        run, step, now = change.run, change.step, change.now
        step.state = _check(STEP_TRANSITIONS, "await_settle", step.state, "step")
        step.next_attempt_at = until
        why = f"{step_name}: outcome unknown; looking again {in_flight_text(sent_at, until)}"
        _check(RUN_TRANSITIONS, "wait", run.state, "run")
        _release_into(run, RunState.WAITING, wake_at=until, reason=why)
        _save_step(step, ["state", "next_attempt_at"], now)
        _save_run(run, RUN_LEASE_FIELDS + ["status_reason"], now)
        change.reason = f"look-up found nothing yet; the receiver may commit the request until {until.isoformat()}"
        change.extra = {"in_flight_until": until.isoformat()}
        return step


def run_wait(*, lease: Lease, wake_at: datetime, reason: str, now: datetime | None = None) -> None:
    """Nothing is due before ``wake_at``: give the run back with its wake-up time."""
    now = now or clock.now()
    with transaction.atomic():
        run = _locked_run(lease)
        before = _snap(run)
        if run.state == RunState.COMPENSATING:  # a compensation waits as compensating
            target = _check(RUN_TRANSITIONS, "compensation_wait", run.state, "run")
        else:
            target = _check(RUN_TRANSITIONS, "wait", run.state, "run")
        _release_into(run, target, wake_at=wake_at, reason=reason)
        _save_run(run, RUN_LEASE_FIELDS + ["status_reason"], now)
        _audit(run, "wait", actor=None, reason=reason, before=before, after=_snap(run), now=now)


def run_release(*, lease: Lease, reason: str, now: datetime | None = None) -> None:
    """Give the run back, due at once (the executor stopped early by choice)."""
    now = now or clock.now()
    with transaction.atomic():
        run = _locked_run(lease)
        before = _snap(run)
        _check(RUN_TRANSITIONS, "release", run.state, "run")
        _release_into(run, RunState.PENDING, reason=reason)
        _save_run(run, RUN_LEASE_FIELDS + ["status_reason"], now)
        _audit(run, "release", actor=None, reason=reason, before=before, after=_snap(run), now=now)


def run_complete(*, lease: Lease, now: datetime | None = None) -> None:
    now = now or clock.now()
    with transaction.atomic():
        run = _locked_run(lease)
        before = _snap(run)
        _check(RUN_TRANSITIONS, "complete", run.state, "run")
        _release_into(run, RunState.COMPLETED)
        run.current_step = ""
        _save_run(run, RUN_LEASE_FIELDS + ["status_reason", "current_step"], now)
        _audit(run, "complete", actor=None, before=before, after=_snap(run), now=now)


def run_review(*, lease: Lease, reason: str, step_name: str = "", now: datetime | None = None) -> None:
    """Stop and hand the run to an operator (a conflict the executor must not resolve). A
    parked run never keeps a step ``running``: a call that may have been made is unknown."""
    now = now or clock.now()
    with transaction.atomic():
        run = _locked_run(lease)
        before = _snap(run)
        _check(RUN_TRANSITIONS, "review", run.state, "run")
        abandoned = _abandon_running_steps(run, now, None)
        lease.seen.clear()  # its copy of those steps is out of date
        _release_into(run, RunState.NEEDS_REVIEW, reason=reason)
        _save_run(run, RUN_LEASE_FIELDS + ["status_reason"], now)
        after = {**_snap(run), "steps_now_unknown": abandoned} if abandoned else _snap(run)
        _audit(run, "review", actor=None, step_name=step_name, reason=reason, before=before, after=after, now=now)


# --- operator transitions --------------------------------------------------------------


def run_version(run: WorkflowRun) -> str:
    """An opaque token that changes with every change of the run: a form carries it back so
    that of two operators acting on one page, only the first one's action applies."""
    return f"{run.updated_at.isoformat()}|{run.state}|{run.lease_generation}"


def _locked_run_by_id(workflow_id: str, expect: str | None = None) -> WorkflowRun:
    run = WorkflowRun.objects.select_for_update().filter(workflow_id=workflow_id).first()
    if run is None:
        raise WorkflowRun.DoesNotExist(f"no run {workflow_id!r}")
    if expect is not None and expect != run_version(run):
        raise RunChanged(f"run {workflow_id} changed since you loaded it (it is now {run.state}); reload")
    return run


def require_reason(reason: str, *, max_length: int = 2000) -> str:
    """The reason an operator gives, stripped: required, at most ``max_length`` characters
    (a reason, not a document: it is shown in the console and in every export), and no NUL
    character (PostgreSQL cannot store one)."""
    reason = (reason or "").strip()
    if not reason:
        raise InvalidTransition("a reason is required")
    if len(reason) > max_length:
        raise InvalidTransition(f"the reason is {len(reason):,} characters long; at most {max_length:,} are allowed")
    if "\x00" in reason:
        raise InvalidTransition("the reason contains a NUL character (U+0000)")
    return reason


def _live_lease(run: WorkflowRun, now: datetime) -> bool:
    return bool(run.lease_owner) and run.lease_expires_at is not None and run.lease_expires_at > now


def _abandon_running_steps(run: WorkflowRun, now: datetime, actor: AbstractBaseUser | None) -> list[str]:
    """A step left ``running`` by an executor that lost (or is losing) the run has an unknown
    outcome: an operator's transition records it so, never leaving it ``running`` forever."""
    names = []
    for step in StepExecution.objects.select_for_update().filter(run=run, state=StepState.RUNNING):
        step.state = StepState.UNKNOWN
        step.last_error_kind = ErrorKind.UNKNOWN_OUTCOME
        step.last_error = "the executor running this step lost the run before recording its outcome"
        _save_step(step, ["state", "last_error_kind", "last_error"], now, actor)
        names.append(step.step_name)
    return names


def run_resume(
    *,
    workflow_id: str,
    actor: AbstractBaseUser | None,
    reason: str,
    expect: str | None = None,
    now: datetime | None = None,
) -> WorkflowRun:
    """Resume from the last checkpoint: the run becomes due now; every succeeded step is kept
    and a blocked step gets a fresh retry budget. A finished run refuses (rule 12)."""
    reason = require_reason(reason)
    now = now or clock.now()
    with transaction.atomic():
        run = _locked_run_by_id(workflow_id, expect)
        if run.state in TERMINAL_RUN_STATES:
            raise InvalidTransition(f"run {workflow_id} is {run.state}: a finished run cannot be resumed")
        before = _snap(run)
        _check(RUN_TRANSITIONS, "resume", run.state, "run")
        for step in StepExecution.objects.select_for_update().filter(
            run=run, state__in=[StepState.FAILED, StepState.UNKNOWN]
        ):
            _restart_budget(step, now, actor)
        requeued = []
        for message in OutboxMessage.objects.select_for_update().filter(run=run, state=OutboxState.FAILED):
            # Delivered once at most: the next attempt looks the message up before sending.
            message.state = OutboxState.PENDING
            message.budget_start_attempt = message.attempts
            message.budget_started_at = now
            message.next_attempt_at = None
            message.updated_at = now
            message.save(
                update_fields=["state", "budget_start_attempt", "budget_started_at", "next_attempt_at", "updated_at"]
            )
            dispatch.enqueue_message(message.pk)
            requeued.append(message.step_name)
        _release_into(run, RunState.PENDING, reason=f"resumed by {_actor_fields(actor)['actor']}")
        _save_run(run, RUN_LEASE_FIELDS + ["status_reason"], now, actor)
        after = {**_snap(run), "outbox_requeued": requeued} if requeued else _snap(run)
        _audit(run, "resume", actor=actor, reason=reason, before=before, after=after, now=now)
        dispatch.enqueue_run(run.pk)
        return run


BUDGET_FIELDS = [
    "budget_start_attempt",
    "budget_started_at",
    "format_failures",
    "reconcile_attempts",
    "next_attempt_at",
]


def _fresh_budget(step: StepExecution) -> None:
    step.budget_start_attempt = step.attempts
    step.budget_started_at = None
    step.format_failures = 0
    step.reconcile_attempts = 0
    step.next_attempt_at = None


def _restart_budget(step: StepExecution, now: datetime, actor: AbstractBaseUser | None) -> None:
    """An operator decided something changed: a failed step becomes due again with a fresh
    budget; an unknown one stays unknown (it is reconciled first, never retried blindly)."""
    _fresh_budget(step)
    if step.state == StepState.FAILED:
        step.state = StepState.PENDING
    _save_step(step, ["state", *BUDGET_FIELDS], now, actor)


def step_retry(
    *,
    workflow_id: str,
    step_name: str,
    actor: AbstractBaseUser | None,
    reason: str,
    expect: str | None = None,
    now: datetime | None = None,
) -> WorkflowRun:
    """Retry one failed step now, with a fresh budget. The same idempotency key is sent
    again: an operator's retry never bypasses idempotency. An unknown step is not retried
    blindly: the executor reconciles it first, as it always does."""
    return _operator_step_action(
        "retry",
        frozenset({StepState.FAILED, StepState.UNKNOWN}),
        workflow_id=workflow_id,
        step_name=step_name,
        actor=actor,
        reason=reason,
        expect=expect,
        now=now,
    )


def step_reconcile(
    *,
    workflow_id: str,
    step_name: str,
    actor: AbstractBaseUser | None,
    reason: str,
    expect: str | None = None,
    now: datetime | None = None,
) -> WorkflowRun:
    """Reconcile an unknown step with the remote system now (look up by key, or resend the
    same key to a receiver that keeps its first result), with a fresh look-up budget."""
    return _operator_step_action(
        "reconcile",
        frozenset({StepState.UNKNOWN}),
        workflow_id=workflow_id,
        step_name=step_name,
        actor=actor,
        reason=reason,
        expect=expect,
        now=now,
    )


def _operator_step_action(
    action: str,
    allowed: frozenset[StepState],
    *,
    workflow_id: str,
    step_name: str,
    actor: AbstractBaseUser | None,
    reason: str,
    expect: str | None = None,
    now: datetime | None,
) -> WorkflowRun:
    reason = require_reason(reason)
    now = now or clock.now()
    with transaction.atomic():
        run = _locked_run_by_id(workflow_id, expect)
        if run.state in TERMINAL_RUN_STATES:
            raise InvalidTransition(f"run {workflow_id} is {run.state}: a finished run cannot be changed this way")
        if _live_lease(run, now):
            raise InvalidTransition(f"run {workflow_id} is running under {run.lease_owner}; wait for it")
        _abandon_running_steps(run, now, actor)
        step = StepExecution.objects.select_for_update().filter(run=run, step_name=step_name).first()
        if step is None:
            raise InvalidTransition(f"run {workflow_id} has no step {step_name!r}")
        if step.state not in allowed:
            raise InvalidTransition(
                f"step {step_name} is {step.state}; {action} needs a step that is {' or '.join(sorted(allowed))}"
            )
        before = _snap(run, step)
        _restart_budget(step, now, actor)
        _release_into(run, RunState.PENDING, reason=f"{step_name}: {action} requested")
        _save_run(run, RUN_LEASE_FIELDS + ["status_reason"], now, actor)
        _audit(
            run, action, actor=actor, step_name=step_name, reason=reason, before=before, after=_snap(run, step), now=now
        )
        dispatch.enqueue_run(run.pk)
        return run


def step_resolve(
    *,
    workflow_id: str,
    step_name: str,
    actor: AbstractBaseUser | None,
    reason: str,
    happened: bool,
    remote_ref: str = "",
    expect: str | None = None,
    now: datetime | None = None,
    approval: ApprovalRequest | None = None,
) -> WorkflowRun:
    """An operator settles an unknown outcome with evidence from the other system: "it
    succeeded, remote id X" records the step as succeeded with that reference; "it did not
    happen" makes it due again, with the same key. The run becomes due — except a terminated
    run, which stays terminated: there the evidence only settles what exists (so that it can
    be compensated), and a call that did not happen is skipped."""
    reason = require_reason(reason)
    remote_ref = redact_text((remote_ref or "").strip())
    if happened and not remote_ref:
        raise InvalidTransition("give the remote id that shows it succeeded")
    now = now or clock.now()
    with transaction.atomic():
        run = _locked_run_by_id(workflow_id, expect)
        if happened:
            _four_eyes(run, "resolve_happened", step_name, approval)
        stays_terminated = run.state == RunState.TERMINATED
        if (run.state in TERMINAL_RUN_STATES and not stays_terminated) or _live_lease(run, now):
            raise InvalidTransition(f"run {workflow_id} is {run.state}; it cannot be changed now")
        _abandon_running_steps(run, now, actor)
        step = StepExecution.objects.select_for_update().filter(run=run, step_name=step_name).first()
        if step is None or step.state != StepState.UNKNOWN:
            raise InvalidTransition(f"step {step_name} is not waiting for reconciliation")
        early = None if happened else _absent_too_early(run, step, actor, now)
        before = _snap(run, step)
        _fresh_budget(step)
        if happened:
            step.state = _check(STEP_TRANSITIONS, "succeed", step.state, "step")
            step.remote_ref = remote_ref
            step.result = {"remote_ref": remote_ref, "resolved_by": _actor_fields(actor)["actor"]}
        elif stays_terminated:
            step.state = StepState.SKIPPED
        else:
            step.state = _check(STEP_TRANSITIONS, "reset", step.state, "step")
        _save_step(step, ["state", "remote_ref", "result", *BUDGET_FIELDS], now, actor)
        if not stays_terminated:
            _release_into(run, RunState.PENDING, reason=f"{step_name}: resolved by an operator")
            _save_run(run, RUN_LEASE_FIELDS + ["status_reason"], now, actor)
        evidence = {"happened": happened, **({"remote_ref": remote_ref} if happened else {})}
        if early is not None:
            evidence["in_flight_until"] = early
        _audit(
            run,
            "resolve",
            actor=actor,
            step_name=step_name,
            reason=reason,
            before=before,
            after={**_snap(run, step), "evidence": evidence},
            now=now,
        )
        dispatch.enqueue_run(run.pk)
        return run


def _absent_too_early(
    run: WorkflowRun, step: StepExecution, actor: AbstractBaseUser | None, now: datetime
) -> str | None:
    """ "It did not happen" while the step's last request may still commit (its in-flight
    window is open, or unbounded) is a supervisor's call: the step would be performed again
    beside a request that can still land. Returns the window's end (None when it is closed)."""
    until = get_workflow(run.workflow_name).get_step(step.step_name).in_flight_until(step.last_attempt_at)
    if until is not None and until <= now:
        return None
    if actor is not None and permissions.role_of(actor) < permissions.Role.SUPERVISOR:
        sent = f" sent at {step.last_attempt_at:%H:%M:%S} UTC" if step.last_attempt_at else ""
        still = f"until {until:%H:%M:%S} UTC" if until is not None else "at any time (no in-flight bound)"
        raise InvalidTransition(
            f"{step.step_name}: the request{sent} may still commit {still}; only a supervisor can declare "
            "that it did not happen before then"
        )
    return until.isoformat() if until is not None else "unbounded"


def run_terminate(
    *,
    workflow_id: str,
    actor: AbstractBaseUser | None,
    reason: str,
    expect: str | None = None,
    now: datetime | None = None,
    approval: ApprovalRequest | None = None,
) -> WorkflowRun:
    """Stop the run for good. Effects already made stay made (compensate them explicitly);
    a live executor's next fenced write fails, so it cannot continue."""
    reason = require_reason(reason)
    now = now or clock.now()
    with transaction.atomic():
        run = _locked_run_by_id(workflow_id, expect)
        _four_eyes(run, "terminate", "", approval)
        before = _snap(run)
        _check(RUN_TRANSITIONS, "terminate", run.state, "run")
        abandoned = _abandon_running_steps(run, now, actor)  # a live executor's call may land or not
        _release_into(run, RunState.TERMINATED, reason=reason)
        run.lease_generation += 1  # fence out any executor still holding a lease
        _save_run(run, RUN_LEASE_FIELDS + ["status_reason"], now, actor)
        after = {**_snap(run), "steps_now_unknown": abandoned} if abandoned else _snap(run)
        _audit(run, "terminate", actor=actor, reason=reason, before=before, after=after, now=now)
        return run


def decision_supersede(
    *,
    workflow_id: str,
    step_name: str,
    actor: AbstractBaseUser | None,
    reason: str,
    expect: str | None = None,
    now: datetime | None = None,
) -> WorkflowRun:
    """Set aside the accepted model decision so that the step decides again, as a new
    version (rule 4: a new decision needs a recorded reason). Only before any later step
    has used it."""
    reason = require_reason(reason)
    now = now or clock.now()
    with transaction.atomic():
        run = _locked_run_by_id(workflow_id, expect)
        if run.state in TERMINAL_RUN_STATES or _live_lease(run, now):
            raise InvalidTransition(
                f"run {workflow_id} is {run.state}; a decision can only be replaced on a stopped run"
            )
        decision = (
            ModelDecision.objects.select_for_update()
            .filter(run=run, step_name=step_name, state=DecisionState.ACCEPTED)
            .first()
        )
        if decision is None:
            raise InvalidTransition(f"step {step_name} has no accepted decision")
        step = StepExecution.objects.select_for_update().get(run=run, step_name=step_name)
        later = StepExecution.objects.filter(run=run, position__gt=step.position).filter(
            ~Q(state=StepState.PENDING) | Q(attempts__gt=0)
        )
        if later.exists():
            # Its key was already sent with a request built from this decision: resending it
            # with a different payload would be a conflict at the receiver.
            raise InvalidTransition("a later step already acted on this decision; compensate it first")
        before = {**_snap(run, step), "decision_version": decision.version}
        decision.state = DecisionState.SUPERSEDED
        decision.superseded_reason = redact_text(reason)
        decision.save(update_fields=["state", "superseded_reason"])
        step.state = StepState.PENDING
        step.remote_ref = ""
        step.result = None
        _fresh_budget(step)
        _save_step(step, ["state", "remote_ref", "result", *BUDGET_FIELDS], now, actor)
        if run.state != RunState.PENDING:
            _release_into(run, RunState.PENDING, reason=f"{step_name}: decision superseded")
            _save_run(run, RUN_LEASE_FIELDS + ["status_reason"], now, actor)
        _audit(
            run,
            "decision_supersede",
            actor=actor,
            step_name=step_name,
            reason=reason,
            before=before,
            after=_snap(run, step),
            now=now,
        )
        dispatch.enqueue_run(run.pk)
        return run


# --- compensation (rule 10) -----------------------------------------------------------


def _compensation_targets(run: WorkflowRun, step_name: str | None = None) -> list[StepExecution]:
    workflow = get_workflow(run.workflow_name)
    compensable = {spec.name for spec in workflow.steps if spec.compensation_fn is not None}
    steps = list(StepExecution.objects.select_for_update().filter(run=run).order_by("position"))
    unknown = [s.step_name for s in steps if s.state == StepState.UNKNOWN]
    if unknown:
        # First establish whether the original action happened at all.
        raise InvalidTransition(f"reconcile {', '.join(unknown)} first: its outcome is unknown")
    undoable = (StepState.SUCCEEDED, StepState.COMPENSATION_FAILED)
    if step_name is not None:
        step = next((s for s in steps if s.step_name == step_name), None)
        if step is None:
            raise InvalidTransition(f"run {run.workflow_id} has no step {step_name!r}")
        if step_name not in compensable:
            raise InvalidTransition(f"step {step_name} declares no compensation")
        if step.state not in undoable:
            raise InvalidTransition(f"step {step_name} is {step.state}; only a completed step can be compensated")
        later = [
            s.step_name
            for s in steps
            if s.position > step.position and s.state in undoable and s.step_name in compensable
        ]
        if later:
            raise InvalidTransition(f"compensate {', '.join(later)} first: compensations run in reverse order")
        return [step]
    return [s for s in steps if s.step_name in compensable and s.state in undoable]


def _start_compensation(
    run: WorkflowRun,
    *,
    actor: AbstractBaseUser | None,
    reason: str,
    now: datetime,
    step_name: str | None = None,
) -> list[str]:
    """Mark what will be compensated and hand the run to the executor, which undoes each
    marked step in reverse order. Steps that never ran are skipped (whole-run only)."""
    targets = _compensation_targets(run, step_name)
    if not targets:
        raise InvalidTransition(f"run {run.workflow_id} has no completed step with a compensation")
    before = _snap(run)
    _check(RUN_TRANSITIONS, "compensate", run.state, "run")
    if step_name is None:
        for step in StepExecution.objects.select_for_update().filter(run=run, state=StepState.PENDING):
            step.state = _check(STEP_TRANSITIONS, "skip", step.state, "step")
            _save_step(step, ["state"], now, actor)
    for step in targets:
        step.state = _check(STEP_TRANSITIONS, "compensate", step.state, "step")
        step.next_attempt_at = None
        _save_step(step, ["state", "next_attempt_at"], now, actor)
    names = [s.step_name for s in sorted(targets, key=lambda s: -s.position)]
    _release_into(run, RunState.COMPENSATING, reason=f"compensating {', '.join(names)}")
    run.lease_generation += 1  # fence out any executor still holding a lease
    _save_run(run, RUN_LEASE_FIELDS + ["status_reason"], now, actor)
    _audit(
        run,
        "compensate",
        actor=actor,
        step_name=step_name or "",
        reason=reason,
        before=before,
        after={**_snap(run), "order": names},
        now=now,
    )
    dispatch.enqueue_run(run.pk)
    return names


def run_compensate(
    *,
    workflow_id: str,
    actor: AbstractBaseUser | None,
    reason: str,
    step_name: str | None = None,
    expect: str | None = None,
    now: datetime | None = None,
    approval: ApprovalRequest | None = None,
) -> WorkflowRun:
    """Undo completed effects with their business compensations, in reverse order: one step,
    or every completed compensable step of the run. Refused while an outcome is unknown or
    an executor holds the run. Also retries a compensation that failed."""
    reason = require_reason(reason)
    now = now or clock.now()
    with transaction.atomic():
        run = _locked_run_by_id(workflow_id, expect)
        _four_eyes(run, "compensate", step_name or "", approval)
        if _live_lease(run, now):
            raise InvalidTransition(f"run {workflow_id} is running under {run.lease_owner}; wait for it")
        _abandon_running_steps(run, now, actor)  # then compensation waits for their reconciliation
        _start_compensation(run, actor=actor, reason=reason, now=now, step_name=step_name)
        return run


# --- four-eyes: an action, requested by one person, approved by another ------------------

LABELS = {"compensate": "compensate", "terminate": "terminate", "resolve_happened": "mark succeeded"}


def needs_approval(run: WorkflowRun, action: str) -> bool:
    """Whether the run's workflow puts ``action`` behind a second supervisor (``four_eyes``)."""
    try:
        return action in get_workflow(run.workflow_name).four_eyes
    except LookupError:
        return False


def _four_eyes(run: WorkflowRun, action: str, step_name: str, approval: ApprovalRequest | None) -> None:
    """Refuse ``action`` unless the workflow lets it run directly or ``approval`` is its
    granted request (approval_grant runs the action with it, in the grant's transaction)."""
    if not needs_approval(run, action):
        return
    if approval is not None and (approval.run_id, approval.action, approval.step_name) == (run.pk, action, step_name):
        if approval.state == ApprovalState.APPROVED or approval is _DRY_RUN.get():
            return
    raise ApprovalRequired(
        f"{LABELS[action]} on {run.workflow_name} runs needs a second supervisor's approval: request it on the "
        "run's page (or manage.py approval request)"
    )


# While a request is checked, the action runs once against it and is rolled back (_dry_run).
_DRY_RUN: ContextVar[ApprovalRequest | None] = ContextVar("recovery_approval_dry_run", default=None)


class _RolledBack(Exception):
    pass


def _perform(request: ApprovalRequest, *, actor: AbstractBaseUser, reason: str, expect: str | None, now: datetime):
    common = {"workflow_id": request.run.workflow_id, "actor": actor, "reason": reason, "expect": expect, "now": now}
    if request.action == "terminate":
        return run_terminate(**common, approval=request)
    if request.action == "compensate":
        return run_compensate(**common, step_name=request.step_name or None, approval=request)
    return step_resolve(
        **common, step_name=request.step_name, happened=True, remote_ref=request.remote_ref, approval=request
    )


def _dry_run(request: ApprovalRequest, *, actor: AbstractBaseUser, now: datetime) -> None:
    """Run the requested action and roll it back: a request is only made for an action that
    would run now (its InvalidTransition is the requester's answer)."""
    token = _DRY_RUN.set(request)
    try:
        with transaction.atomic():
            _perform(request, actor=actor, reason=request.reason, expect=None, now=now)
            raise _RolledBack
    except _RolledBack:
        pass
    finally:
        _DRY_RUN.reset(token)


def _approval_snap(request: ApprovalRequest) -> dict[str, Any]:
    snap = {"id": request.pk, "action": request.action, "state": request.state}
    if request.step_name:
        snap["step"] = request.step_name
    if request.remote_ref:
        snap["remote_ref"] = request.remote_ref
    return snap


def approval_request(
    *,
    workflow_id: str,
    action: str,
    actor: AbstractBaseUser,
    reason: str,
    step_name: str | None = None,
    remote_ref: str = "",
    expect: str | None = None,
    now: datetime | None = None,
) -> ApprovalRequest:
    """Ask for ``action`` on a run whose workflow puts it behind four eyes. The action must be
    one the run allows now (and the actor's own role); nothing changes on the run until
    another supervisor approves. One pending request per action and step."""
    reason = require_reason(reason)
    if actor is None or not getattr(actor, "is_authenticated", False):
        raise InvalidTransition("only a person can request an action")
    if action not in LABELS:
        raise InvalidTransition(f"{action!r} does not need approval")
    now = now or clock.now()
    with transaction.atomic():
        run = _locked_run_by_id(workflow_id, expect)
        if not needs_approval(run, action):
            raise InvalidTransition(f"{LABELS[action]} needs no approval on {run.workflow_name} runs: do it directly")
        request = ApprovalRequest(
            run=run,
            action=action,
            step_name=step_name or "",
            remote_ref=redact_text((remote_ref or "").strip()),
            reason=redact_text(reason),
            state=ApprovalState.PENDING,
            requested_by=actor,
            requested_at=now,
        )
        _dry_run(request, actor=actor, now=now)
        try:
            with transaction.atomic():
                request.save()
        except IntegrityError:
            raise InvalidTransition(f"a request to {LABELS[action]} is already waiting for approval") from None
        _approval_audit(run, request, "approval_request", actor=actor, reason=reason, now=now)
        return request


def _locked_request(request_id: int | str) -> tuple[WorkflowRun, ApprovalRequest]:
    try:
        pk = int(request_id)
    except (TypeError, ValueError):
        raise InvalidTransition(f"no approval request {request_id!r}") from None
    run_pk = ApprovalRequest.objects.filter(pk=pk).values_list("run_id", flat=True).first()
    if run_pk is None:
        raise InvalidTransition(f"no approval request {request_id!r}")
    run = WorkflowRun.objects.select_for_update().get(pk=run_pk)  # lock order: run, then its rows
    request = ApprovalRequest.objects.select_for_update().select_related("requested_by").get(pk=pk)
    request.run = run
    if request.state != ApprovalState.PENDING:
        raise InvalidTransition(f"approval request {pk} is already {request.state}")
    return run, request


def approval_grant(
    *,
    request_id: int | str,
    actor: AbstractBaseUser,
    reason: str = "",
    expect: str | None = None,
    now: datetime | None = None,
) -> WorkflowRun:
    """A second supervisor approves: the approval is audited, then the action runs, in one
    transaction (if the action is no longer valid, neither happens and the request waits).
    Nobody approves their own request."""
    now = now or clock.now()
    if actor is None or not permissions.can(actor, "approve"):
        raise InvalidTransition("only a supervisor can approve")
    with transaction.atomic():
        run, request = _locked_request(request_id)
        if request.requested_by_id == actor.pk:
            raise InvalidTransition("you cannot approve your own request: another supervisor must")
        if expect is not None and expect != run_version(run):
            raise RunChanged(f"run {run.workflow_id} changed since you loaded it (it is now {run.state}); reload")
        _decide(request, ApprovalState.APPROVED, actor=actor, reason=reason, now=now)
        requester = request.requested_by.get_username()
        _approval_audit(
            run, request, "approval_grant", actor=actor, reason=request.decision_reason, now=now, requested_by=requester
        )
        who = f"requested by {requester}, approved by {actor.get_username()}"
        why = f"{request.reason} ({who})"
        return _perform(request, actor=actor, reason=why, expect=None, now=now)


def approval_reject(
    *, request_id: int | str, actor: AbstractBaseUser, reason: str, now: datetime | None = None
) -> ApprovalRequest:
    """Turn a pending request down (a supervisor) or withdraw it (its requester). The run
    does not change."""
    reason = require_reason(reason)
    now = now or clock.now()
    with transaction.atomic():
        run, request = _locked_request(request_id)
        if actor is None or (request.requested_by_id != actor.pk and not permissions.can(actor, "approve")):
            raise InvalidTransition("only a supervisor, or the requester, can turn a request down")
        _decide(request, ApprovalState.REJECTED, actor=actor, reason=reason, now=now)
        _approval_audit(run, request, "approval_reject", actor=actor, reason=reason, now=now)
        return request


def _decide(request: ApprovalRequest, state: ApprovalState, *, actor: AbstractBaseUser, reason: str, now: datetime):
    request.state = state
    request.decided_by = actor
    request.decided_at = now
    request.decision_reason = redact_text((reason or "").strip())
    request.save(update_fields=["state", "decided_by", "decided_at", "decision_reason"])


def _approval_audit(
    run: WorkflowRun,
    request: ApprovalRequest,
    action: str,
    *,
    actor: AbstractBaseUser,
    reason: str,
    now: datetime,
    **extra: Any,
) -> None:
    """The audit event of a step of four-eyes: the run does not change; the request does."""
    approval = {**_approval_snap(request), **extra}
    _audit(
        run,
        action,
        actor=actor,
        step_name=request.step_name,
        reason=reason,
        before=_snap(run),
        after={**_snap(run), "approval": approval},
        now=now,
    )


def compensation_begin(*, lease: Lease, step_name: str, now: datetime | None = None) -> StepExecution:
    """Record that the compensation call is about to be made (it may be made again after a
    crash: compensations are idempotent under their own key)."""
    with _leased_step(lease, step_name, "compensation_begin", now) as change:
        step, now = change.step, change.now
        _check(STEP_TRANSITIONS, "compensation_begin", step.state, "step")
        step.compensation_attempts += 1
        step.next_attempt_at = None
        step.compensation_sent_at = now  # until it answers, the request may commit
        _save_step(step, ["compensation_attempts", "next_attempt_at", "compensation_sent_at"], now)
        change.extra = {"compensation_attempts": step.compensation_attempts}
        return step


def compensation_succeed(*, lease: Lease, step_name: str, outcome: Outcome, now: datetime | None = None) -> None:
    with _leased_step(lease, step_name, "compensation_succeed", now) as change:
        run, step, now = change.run, change.step, change.now
        step.state = _check(STEP_TRANSITIONS, "compensation_succeed", step.state, "step")
        step.compensation_ref = redact_text(outcome.remote_ref)
        step.compensation_result = _redacted(run, outcome.result)
        step.compensation_restored = outcome.restored
        _save_step(step, ["state", "compensation_ref", "compensation_result", "compensation_restored"], now)
        change.extra = {"compensation_ref": step.compensation_ref}
        if outcome.incident:
            incident = redact_text(outcome.incident)
            run.incident = "\n".join(filter(None, [run.incident, incident]))
            _save_run(run, ["incident"], now)
            change.extra["incident"] = incident


def compensation_fail(
    *, lease: Lease, step_name: str, error: StepError, spec: StepSpec, now: datetime | None = None
) -> None:
    """A compensation failed. Compensations are idempotent under their own key, so transient
    errors and unknown outcomes are retried within the step's budget — an unknown one not
    before its request can no longer commit (the step's in-flight bound), so that a look-up
    inside the compensation (has the correction been sent?) cannot miss a request still in
    flight. Anything else, an exhausted budget, or an unknown outcome with no bound stops in
    the visible ``compensation_failed`` state — never reported as rolled back."""
    with _leased_step(lease, step_name, "compensation_fail", now) as change:
        run, step, now = change.run, change.step, change.now
        step.last_error_kind = error.kind
        message = redact_text(error.message)
        step.last_error = f"compensation: {message}"[:4000]
        unknown = error.kind == ErrorKind.UNKNOWN_OUTCOME
        settle_until = spec.in_flight_until(step.compensation_sent_at) if unknown else None
        if not unknown:
            step.compensation_sent_at = None  # it answered: nothing of this attempt is in flight
        retryable = unknown or spec.retry.retries(error.kind)
        delay = (
            spec.retry.next_delay(
                step.compensation_attempts, TransientError(error.message, retry_after=error.retry_after)
            )
            if retryable
            else None
        )
        why = f"{step_name}: compensation failed: {message}"
        if unknown and spec.in_flight_bound() is None:
            delay = None
            why = f"{step_name}: compensation outcome unknown and its receiver may commit at any time: check it"
        if delay is not None:
            _check(STEP_TRANSITIONS, "compensation_begin", step.state, "step")
            step.next_attempt_at = max(now + timedelta(seconds=delay), settle_until or now)
            retry = "compensation retry scheduled"
            if settle_until is not None and step.next_attempt_at == settle_until:
                window = in_flight_text(step.compensation_sent_at, settle_until)
                retry = f"compensation outcome unknown; trying again {window}"
            _check(RUN_TRANSITIONS, "compensation_wait", run.state, "run")
            _release_into(run, RunState.COMPENSATING, wake_at=step.next_attempt_at, reason=f"{step_name}: {retry}")
            change.action = "compensation_retry"
        else:
            step.state = _check(STEP_TRANSITIONS, "compensation_fail", step.state, "step")
            step.next_attempt_at = None
            _check(RUN_TRANSITIONS, "compensation_fail", run.state, "run")
            _release_into(run, RunState.COMPENSATION_FAILED, reason=why)
        _save_step(step, ["state", "last_error_kind", "last_error", "next_attempt_at", "compensation_sent_at"], now)
        _save_run(run, RUN_LEASE_FIELDS + ["status_reason"], now)
        change.reason = message[:1000]


def run_compensation_done(*, lease: Lease, now: datetime | None = None) -> RunState:
    """Every marked step is compensated. The run is ``compensated`` when no completed effect
    is left; after compensating only some steps it returns to ``completed`` (if nothing else
    is outstanding) or to ``needs_review``."""
    now = now or clock.now()
    with transaction.atomic():
        run = _locked_run(lease)
        before = _snap(run)
        _check(RUN_TRANSITIONS, "compensation_done", run.state, "run")
        workflow = get_workflow(run.workflow_name)
        compensable = {spec.name for spec in workflow.steps if spec.compensation_fn is not None}
        states = dict(StepExecution.objects.filter(run=run).values_list("step_name", "state"))
        left = [name for name, state in states.items() if name in compensable and state == StepState.SUCCEEDED]
        if not left:
            restored = not StepExecution.objects.filter(
                run=run, state=StepState.COMPENSATED, compensation_restored=False
            ).exists()
            # "Rolled back" only where every undone effect truly restored the previous state.
            target, why = RunState.COMPENSATED, "rolled back" if restored else "every completed effect was compensated"
        elif all(state in (*DONE_STEP_STATES, StepState.COMPENSATED) for state in states.values()):
            target, why = RunState.COMPLETED, f"compensated some steps; {', '.join(left)} stand"
        else:
            target, why = RunState.NEEDS_REVIEW, f"compensated some steps; {', '.join(left)} stand"
        _release_into(run, target, reason=why)
        run.current_step = ""
        _save_run(run, RUN_LEASE_FIELDS + ["status_reason", "current_step"], now)
        _audit(run, "compensation_done", actor=None, reason=why, before=before, after=_snap(run), now=now)
        return target


# --- transactional outbox (rule 5) ------------------------------------------------------


def step_enqueue(
    *, lease: Lease, step_name: str, intent: dict[str, Any], request_hash: str, now: datetime | None = None
) -> OutboxMessage:
    """The step's message is written as an outbox row in the same transaction as the step's
    success: after this commit it will be delivered, and never twice. The step's remote
    reference is the outbox row until the publisher records the provider's message id."""
    now = now or clock.now()
    with transaction.atomic():
        run = _locked_run(lease)
        step = _locked_step(run, step_name, lease)
        before = _snap(run, step)
        step.state = _check(STEP_TRANSITIONS, "succeed", step.state, "step")
        # The payload is what the publisher calls the step with: the redacted intent, as the
        # step's own checkpoint. A step gets its credentials from settings, never its intent.
        intent = _redacted(run, intent)
        message = OutboxMessage.objects.create(
            run=run,
            step_name=step_name,
            idempotency_key=step.idempotency_key,
            payload=intent,
            created_at=now,
            updated_at=now,
        )
        step.remote_ref = f"outbox:{message.pk}"
        step.result = {"outbox_id": message.pk, "delivered": False}
        _save_step(step, ["state", "remote_ref", "result", *_record_attempt(step, intent, request_hash, now)], now)
        run.current_step = step_name
        _renew(run, now)
        _save_run(run, ["current_step", "lease_expires_at"], now)
        _audit(run, "step_enqueue", actor=None, step_name=step_name, before=before, after=_snap(run, step), now=now)
        dispatch.enqueue_message(message.pk)
        return message


@dataclass(frozen=True)
class OutboxClaim:
    pk: int
    owner: str
    generation: int
    # When the latest attempt whose outcome is unknown was sent (None: no earlier attempt may
    # have delivered the message unbeknown to us)
    settle_from: datetime | None = None


def outbox_due(now: datetime) -> Q:
    due = Q(next_attempt_at__isnull=True) | Q(next_attempt_at__lte=now)
    unclaimed = Q(claimed_until__isnull=True) | Q(claimed_until__lte=now)
    return Q(state=OutboxState.PENDING) & due & unclaimed


def outbox_claim(*, pk: int, owner: str | None = None, now: datetime | None = None) -> OutboxClaim | None:
    """Take one due outbox row for a delivery attempt (counted before the call, like a
    step's intent checkpoint), or None if it is not due or another publisher holds it."""
    now = now or clock.now()
    with transaction.atomic():
        qs = OutboxMessage.objects.filter(outbox_due(now), pk=pk)
        message = qs.select_for_update(skip_locked=connection.features.has_select_for_update_skip_locked).first()
        if message is None:
            return None
        _settle_from_lost_publisher(message)
        message.attempts += 1
        message.claimed_by = owner or default_owner()
        message.claimed_until = now + lease_duration()
        message.claim_generation += 1
        message.dispatched_at = None
        message.last_attempt_at = now
        message.updated_at = now
        fields = ["attempts", "claimed_by", "claimed_until", "claim_generation", "dispatched_at", "updated_at"]
        message.save(update_fields=[*fields, "last_attempt_at", "settle_from"])
        return OutboxClaim(
            pk=message.pk,
            owner=message.claimed_by,
            generation=message.claim_generation,
            settle_from=message.settle_from,
        )


def _settle_from_lost_publisher(message: OutboxMessage) -> bool:
    """A claim still set when the row is taken again means its publisher was lost before it
    recorded an outcome: that attempt's request may be in flight still, and commit until its
    in-flight window ends, so the window counts from it. Returns whether it was so."""
    if not message.claimed_by:
        return False
    message.settle_from = message.last_attempt_at
    return True


def _locked_outbox(claim: OutboxClaim) -> tuple[WorkflowRun, OutboxMessage]:
    run_pk = OutboxMessage.objects.filter(pk=claim.pk).values_list("run_id", flat=True).first()
    run = WorkflowRun.objects.select_for_update().get(pk=run_pk)  # lock order: run, step, outbox
    message = (
        OutboxMessage.objects.select_for_update()
        .filter(pk=claim.pk, claim_generation=claim.generation, state=OutboxState.PENDING)
        .first()
    )
    if message is None:
        raise LeaseLost(f"outbox claim {claim.generation} on {claim.pk} is no longer held")
    return run, message


def _wake(run: WorkflowRun, now: datetime) -> None:
    """Make a waiting run due now (it may be waiting for this delivery)."""
    if run.state in (RunState.WAITING, RunState.COMPENSATING) and not _live_lease(run, now):
        run.next_wake_at = now
        _save_run(run, ["next_wake_at"], now)
        dispatch.enqueue_run(run.pk)


def outbox_delivered(*, claim: OutboxClaim, outcome: Outcome, how: str, now: datetime | None = None) -> None:
    """Record the provider's message id on the outbox row and on its step."""
    now = now or clock.now()
    with transaction.atomic():
        run, message = _locked_outbox(claim)
        step = StepExecution.objects.select_for_update().get(run=run, step_name=message.step_name)
        before = {"outbox": message.state, "remote_ref": step.remote_ref}
        message.state = OutboxState.DELIVERED
        message.provider_ref = redact_text(outcome.remote_ref)
        message.delivered_at = now
        message.claimed_by, message.claimed_until, message.next_attempt_at = "", None, None
        message.updated_at = now
        message.save(
            update_fields=[
                "state",
                "provider_ref",
                "delivered_at",
                "claimed_by",
                "claimed_until",
                "next_attempt_at",
                "updated_at",
            ]
        )
        step.remote_ref = message.provider_ref
        step.result = {**(_redacted(run, outcome.result) or {}), "outbox_id": message.pk, "delivered": True}
        _save_step(step, ["remote_ref", "result"], now)
        _save_run(run, [], now)  # a step changed: an executor holding the run reads it again
        _audit(
            run,
            "outbox_delivered",
            actor=None,
            step_name=message.step_name,
            reason=how,
            before=before,
            after={"outbox": message.state, "remote_ref": step.remote_ref, "attempts": message.attempts},
            now=now,
        )
        _wake(run, now)


def outbox_failed_attempt(*, claim: OutboxClaim, error: StepError, spec: StepSpec, now: datetime | None = None) -> str:
    """A delivery attempt failed. Transient errors and unknown outcomes are retried within the
    step's budget (the next attempt looks the message up first); a permanent error or an
    exhausted budget stops the row as ``failed`` and wakes the run, which goes to review."""
    now = now or clock.now()
    with transaction.atomic():
        run, message = _locked_outbox(claim)
        before = {"outbox": message.state, "attempts": message.attempts}
        message.last_error_kind = error.kind
        message.last_error = _error_text(error, 4000)
        message.claimed_by, message.claimed_until = "", None
        unknown = error.kind == ErrorKind.UNKNOWN_OUTCOME
        if unknown:
            message.settle_from = message.last_attempt_at  # it may have been delivered: look first
        retryable = unknown or spec.retry.retries(error.kind)
        elapsed = (now - (message.budget_started_at or message.created_at)).total_seconds()
        as_retry = TransientError(error.message, retry_after=error.retry_after)
        attempt = message.attempts - message.budget_start_attempt
        delay = spec.retry.next_delay(attempt, as_retry, elapsed=elapsed) if retryable else None
        if unknown and spec.in_flight_bound() is None:
            delay = None  # no look-up can ever prove it was not delivered: an operator decides
        if delay is None:
            message.state = OutboxState.FAILED
            message.next_attempt_at = None
            action = "outbox_fail"
        else:
            message.next_attempt_at = now + timedelta(seconds=delay)
            action = "outbox_retry"
        message.updated_at = now
        message.save(
            update_fields=[
                "state",
                "last_error_kind",
                "last_error",
                "claimed_by",
                "claimed_until",
                "next_attempt_at",
                "settle_from",
                "updated_at",
            ]
        )
        _audit(
            run,
            action,
            actor=None,
            step_name=message.step_name,
            reason=_error_text(error, 1000),
            before=before,
            after={"outbox": message.state, "attempts": message.attempts, "error_kind": error.kind},
            now=now,
        )
        if action == "outbox_fail":
            _wake(run, now)
        return action


def outbox_await_settle(
    *, claim: OutboxClaim, until: datetime, sent_at: datetime | None, now: datetime | None = None
) -> None:
    """The look-up before a new delivery attempt found nothing, but an earlier attempt's request
    may still commit until ``until`` (rule 7): send nothing now, look again then. The claim
    counted a delivery attempt that was not made: it is given back."""
    now = now or clock.now()
    with transaction.atomic():
        run, message = _locked_outbox(claim)
        before = {"outbox": message.state, "attempts": message.attempts}
        message.attempts -= 1
        message.claimed_by, message.claimed_until = "", None
        message.next_attempt_at = until
        message.last_error = f"looking it up again {in_flight_text(sent_at, until)}"
        message.updated_at = now
        message.save(
            update_fields=["attempts", "claimed_by", "claimed_until", "next_attempt_at", "last_error", "updated_at"]
        )
        if run.state == RunState.WAITING and not _live_lease(run, now):
            # The run waits for this delivery: its status says what it waits for, and it wakes then.
            run.status_reason = f"{message.step_name}: message outcome unknown; {message.last_error}"
            run.next_wake_at = until
            _save_run(run, ["status_reason", "next_wake_at"], now)
        _audit(
            run,
            "outbox_settle_wait",
            actor=None,
            step_name=message.step_name,
            reason=message.last_error,
            before=before,
            after={"outbox": message.state, "attempts": message.attempts, "in_flight_until": until.isoformat()},
            now=now,
        )


def outbox_unresolved(*, claim: OutboxClaim, reason: str, now: datetime | None = None) -> None:
    """The look-up found nothing and the step has no in-flight bound: an earlier attempt may
    still be delivered at any time, so no attempt is made; the row stops as ``failed`` and
    the run goes to an operator."""
    now = now or clock.now()
    with transaction.atomic():
        run, message = _locked_outbox(claim)
        before = {"outbox": message.state, "attempts": message.attempts}
        message.attempts -= 1
        message.state = OutboxState.FAILED
        message.claimed_by, message.claimed_until, message.next_attempt_at = "", None, None
        message.last_error_kind = ErrorKind.UNKNOWN_OUTCOME
        message.last_error = reason
        message.updated_at = now
        message.save(
            update_fields=[
                "attempts",
                "state",
                "claimed_by",
                "claimed_until",
                "next_attempt_at",
                "last_error_kind",
                "last_error",
                "updated_at",
            ]
        )
        _audit(
            run,
            "outbox_fail",
            actor=None,
            step_name=message.step_name,
            reason=reason,
            before=before,
            after={"outbox": message.state, "attempts": message.attempts, "error_kind": message.last_error_kind},
            now=now,
        )
        _wake(run, now)


def outbox_cancel(*, lease: Lease, step_name: str, now: datetime | None = None) -> OutboxMessage:
    """Compensating an undelivered message: stop its delivery. Refused (the row is returned
    unchanged) while a publisher holds it."""
    now = now or clock.now()
    with transaction.atomic():
        run = _locked_run(lease)
        message = OutboxMessage.objects.select_for_update().get(run=run, step_name=step_name)
        claimed = message.claimed_until is not None and message.claimed_until > now
        if message.state in (OutboxState.PENDING, OutboxState.FAILED) and not claimed:
            before = {"outbox": message.state}
            message.state = OutboxState.CANCELLED
            message.claim_generation += 1  # fences a publisher whose claim expired mid-call
            if _settle_from_lost_publisher(message):
                message.claimed_by, message.claimed_until = "", None
            message.next_attempt_at = None
            message.updated_at = now
            message.save(
                update_fields=[
                    "state",
                    "claim_generation",
                    "settle_from",
                    "claimed_by",
                    "claimed_until",
                    "next_attempt_at",
                    "updated_at",
                ]
            )
            _renew(run, now)
            _save_run(run, ["lease_expires_at"], now)
            _audit(
                run,
                "outbox_cancel",
                actor=None,
                step_name=step_name,
                before=before,
                after={"outbox": message.state, "attempts": message.attempts},
                now=now,
            )
        return message
