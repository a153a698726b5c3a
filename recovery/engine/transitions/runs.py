"""A run's life outside its steps: starting it from an event, waiting, releasing, completing,
parking it for review."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from typing import Any

import pydantic
from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import DEFAULT_DB_ALIAS, IntegrityError, connection, transaction
from django.utils.crypto import salted_hmac

from recovery import clock, tracing
from recovery.engine import dispatch, metrics, storage
from recovery.errors import ErrorKind, StartConflict
from recovery.models import AuditEvent, RunState, StepExecution, StepState, WorkflowPause, WorkflowRun
from recovery.states import AuditAction
from recovery.workflow import StepSpec, Workflow, get_workflow, idempotency_key, payload_hash

from ._core import (
    ABANDONED,
    RUN_LEASE_FIELDS,
    Lease,
    _actor_fields,
    _audit_many,
    _audit_row,
    _Change,
    _check,
    _observed,
    _release_into,
    _run_transition,
    _snap,
    default_owner,
)
from .checkpoints import _clone, _copy, _point
from .leases import _take_lease
from .steps import _record_attempt
from .tables import RUN_TRANSITIONS, STEP_TRANSITIONS

# --- starting a run --------------------------------------------------------------------


def run_start(
    *,
    workflow: Workflow | str,
    data: Any,
    actor: AbstractBaseUser | str | None = None,
    now: datetime | None = None,
    reserve: tuple[str, datetime] | None = None,
) -> tuple[WorkflowRun, bool]:
    """Create the run for a business event, or return the one that event already created.

    The workflow id comes from the event, never from a worker or an attempt. The unique
    constraint on ``workflow_id`` decides between concurrent starts, not a pre-check. The
    same id with a different input is a conflict, never a silent replay. With ``reserve``
    (owner, until), only that executor claims the new run until then, or until it releases it
    (``runs_release_reservation``); an existing run is returned as it is.
    """
    run, steps, _ = _start(workflow, data, actor, now, reserve=reserve)
    return run, steps is not None


# What a claimed start may write with it: its first call begun (recovery.engine.fold.first_call
# decides which, and with what intent and request hash, from the new run and its steps).
FirstCall = Callable[[WorkflowRun, list[StepExecution]], tuple[str, dict[str, Any], str] | None]


def run_start_claimed(
    *,
    workflow: Workflow | str,
    data: Any,
    owner: str | None = None,
    actor: AbstractBaseUser | str | None = None,
    now: datetime | None = None,
    first: FirstCall | None = None,
) -> tuple[WorkflowRun, Lease | None]:
    """``run_start``, with the new run claimed by ``owner`` (default: this process) as it is
    written: the start and the claim an executor would make next, with both their audit events,
    in one write — and, with ``first``, the first call's intent too (its ``step_begin``): the
    lease's ``begun`` names it, to be called next. For a process that runs what it starts
    (``executor.start_and_advance``). The lease is None when the event's run existed already:
    it is returned as it is, for whoever holds it or may claim it; and when a supervisor's pause
    of the workflow (or of one of its steps) is in force: the run is then started pending, for
    the claim that may take it (``leases.claimable``) to take it."""
    owner = owner or default_owner()
    try:
        run, steps, begun = _start(workflow, data, actor, now, owner=owner, first=first)
    except _Paused:  # nothing was written: started as any event is, pending
        run, _, _ = _start(workflow, data, actor, now)
        return run, None
    if steps is None:
        return run, None
    seen = _copy(run, steps)
    return run, Lease(run_pk=run.pk, owner=owner, generation=run.lease_generation, seen=seen, begun=begun)


def _start(
    workflow: Workflow | str,
    data: Any,
    actor: AbstractBaseUser | str | None,
    now: datetime | None,
    *,
    reserve: tuple[str, datetime] | None = None,
    owner: str | None = None,
    first: FirstCall | None = None,
) -> tuple[WorkflowRun, list[StepExecution] | None, str]:
    """The run of the event, and its steps if this call created it (None: it existed), and the
    step begun with it ("" if none: see ``run_start_claimed``)."""
    wf = get_workflow(workflow) if isinstance(workflow, str) else workflow
    event = _event(wf, data)
    now = now or clock.now()
    run = _new_run(wf, event, now, reserve)
    events: list[_StartEvent] = [("start", _actor_fields(actor), {}, _snap(run), "")]
    new_steps, begun = _new_steps(wf, run, now), ""
    if owner is not None:  # a claim's changes, written with the start
        before = _snap(run)
        _take_lease(run, owner, now)
        run.revision += 1  # as the claim's save bumps it
        events.append(("claim", _actor_fields(None), before, {**_snap(run), "lease_owner": owner}, ""))
        call = first(run, new_steps) if first is not None else None
        if call is not None:
            begun = _begin_first(run, new_steps, *call, now, events)
    with transaction.atomic() if dispatch.queues() else nullcontext():
        steps = _insert(run, new_steps, events, now, unless_paused=owner is not None)
        if steps is not None and reserve is None and owner is None:
            dispatch.enqueue_run(run.pk)  # a reserved or claimed run is driven by its executor
    if steps is None:
        run = WorkflowRun.objects.filter(workflow_id=event.workflow_id).first()
        if run is None and owner is not None:  # not written: a pause of its workflow is in force
            raise _Paused
        if run is None:
            raise WorkflowRun.DoesNotExist(event.workflow_id)
        if not _same_input(run, event):
            raise _conflict(event.workflow_id)
        return run, None, ""
    for action, who, _, after, step_name in events:
        _observed(run, action, step_name, after, who["actor"])
    if owner is not None:
        metrics.claimed(run.workflow_name, due_at=now, now=now)
    return run, steps, begun


# An audit event of a start: (action, who (_actor_fields), before, after, step name).
_StartEvent = tuple[str, dict[str, Any], dict, dict, str]


def _begin_first(
    run: WorkflowRun,
    steps: list[StepExecution],
    step_name: str,
    intent: dict[str, Any],
    request_hash: str,
    now: datetime,
    events: list[_StartEvent],
) -> str:
    """The claimed start's first call begun with it, as ``step_begin`` would: its intent
    checkpointed, its attempt counted, the run's current step; its audit event after the claim's."""
    step = next(s for s in steps if s.step_name == step_name)
    step.run = run
    before = _snap(run, step)
    step.state = _check(STEP_TRANSITIONS, "begin", step.state, "step")
    _record_attempt(step, intent, request_hash, now)
    run.current_step = step_name
    events.append(("step_begin", _actor_fields(None), before, _snap(run, step), step_name))
    return step_name


class _Paused(Exception):
    """A claimed start found a pause of its workflow (or of one of its steps) in force."""


def _insert(
    run: WorkflowRun, steps: list[StepExecution], events: list[_StartEvent], now: datetime, *, unless_paused: bool
) -> list[StepExecution] | None:
    """Write a new run, its steps and its audit events, unless a run with its workflow id exists
    — or, ``unless_paused`` (a claimed start), a pause of its workflow or of one of its steps is
    in force, checked by the same statement (then nothing, and None). The engine's insert saves
    no version of the run: the start event says who started it (see _history_user)."""
    insert = _insert_in_one_statement if connection.vendor == "postgresql" else _insert_in_transaction
    return steps if insert(run, steps, events, now, unless_paused) else None


def _insert_in_one_statement(
    run: WorkflowRun, steps: list[StepExecution], events: list[_StartEvent], now: datetime, unless_paused: bool
) -> bool:
    """PostgreSQL: one round trip (storage.start)."""
    rows = []
    for action, who, before, after, step_name in events:
        row = _audit_row(run, action, who, step_name, "", before, after, now)
        del row["run_id"]
        rows.append(row)
    written = storage.start(run, steps, rows, unless_paused=unless_paused)
    if written is None:
        return False
    run.pk, step_pks = written
    for obj in (run, *steps):
        obj._state.adding, obj._state.db = False, DEFAULT_DB_ALIAS
    for step in steps:
        step.pk, step.run_id = step_pks[step.position], run.pk
    return True


def _insert_in_transaction(
    run: WorkflowRun, steps: list[StepExecution], events: list[_StartEvent], now: datetime, unless_paused: bool
) -> bool:
    """Any database: a transaction of inserts; the unique workflow id refuses a second run."""
    try:
        with transaction.atomic():
            paused = WorkflowPause.objects.filter(workflow_name=run.workflow_name, released_at=None)
            if unless_paused and paused.exists():
                return False
            WorkflowRun.objects.bulk_create([run])
            StepExecution.objects.bulk_create(steps)
            for action, who, before, after, step_name in events:
                storage.insert(AuditEvent, _audit_row(run, action, who, step_name, "", before, after, now))
    except IntegrityError:
        return False
    return True


@dataclass(frozen=True)
class _Event:
    """An event as it is persisted: validated, redacted, with its run's id and input hash, and
    the hashes under SECRET_KEY_FALLBACKS a repeat of it may find stored (``_same_input``)."""

    data: dict[str, Any]
    workflow_id: str
    input_hash: str
    repeats: frozenset[str]


def _event(wf: Workflow, data: Any) -> _Event:
    # What is persisted is what is replayed: the run's input is kept redacted. Its id comes from
    # the event as sent, and an event whose id redaction would change is refused (its run would
    # be named, and its steps called, with the redacted value: two distinct events would merge).
    # The input hash is a keyed HMAC of the event as sent, so events that differ only in what
    # redaction hides are told apart, and no plain hash of a credential is ever stored.
    raw = wf.validate_input(data)
    validated = wf.redact(raw)
    workflow_id = wf.workflow_id(raw)
    limit = WorkflowRun._meta.get_field("workflow_id").max_length
    if not isinstance(workflow_id, str) or not 0 < len(workflow_id) <= limit:
        length = len(workflow_id) if isinstance(workflow_id, str) else 0
        raise ValueError(
            f"the workflow id must be 1 to {limit} characters (the event's keys make it); this one has "
            f"{length:,} (at most {limit})"
        )
    redacted_id = wf.redact(workflow_id)
    if redacted_id != workflow_id or wf.workflow_id(validated) != workflow_id:
        raise ValueError(
            f"its identifiers look like a credential: its run would be named {redacted_id!r} and its steps "
            "would get the redacted values, so distinct events would merge into one run. If identifiers of "
            "this shape are no credentials here, take their pattern out of RECOVERY_REDACT_PATTERNS "
            "(docs/security.md)"
        )
    hashes = input_hashes(raw)
    return _Event(validated, workflow_id, hashes[0], frozenset(hashes))


def input_hashes(raw: Any) -> list[str]:
    """The keyed hashes of a run's input as sent: under SECRET_KEY first (the one stored), then
    under each of SECRET_KEY_FALLBACKS, so a repeat still finds its run while a rotated key is
    kept as a fallback."""
    canonical = json.dumps(raw, sort_keys=True, separators=(",", ":"), default=str)
    keys = [settings.SECRET_KEY, *settings.SECRET_KEY_FALLBACKS]
    return [salted_hmac(_INPUT_SALT, canonical, secret=key, algorithm="sha256").hexdigest() for key in keys]


_INPUT_SALT = "recovery.run-input"


def _same_input(run: WorkflowRun, event: _Event) -> bool:
    """Whether ``event`` repeats the one that started ``run``. A run started before inputs were
    hashed by key holds the plain hash of its redacted input: it is compared by that (computed
    only here, on a repeat, not for every start)."""
    return run.input_hash in event.repeats or run.input_hash == payload_hash(event.data)


def _new_run(wf: Workflow, event: _Event, now: datetime, reserve: tuple[str, datetime] | None) -> WorkflowRun:
    return WorkflowRun(
        workflow_id=event.workflow_id,
        workflow_name=wf.name,
        workflow_version=wf.version,
        state=RunState.PENDING,
        input=event.data,
        input_hash=event.input_hash,
        created_at=now,
        updated_at=now,
        traceparent=tracing.traceparent() or None,
        reserved_for=reserve[0] if reserve else None,
        reserved_until=reserve[1] if reserve else None,
    )


def _new_steps(wf: Workflow, run: WorkflowRun, now: datetime) -> list[StepExecution]:
    return [new_step(run, spec, now) for spec in wf.steps]


def new_step(run: WorkflowRun, spec: StepSpec, now: datetime) -> StepExecution:
    """A step's row as a run gets it before anything is done: pending, under its declared key.
    Made from the model's defaults, computed once (``_pending``): what ``StepExecution(**kwargs)``
    gives, without the ORM's per-field ``__init__`` (about a third of a start's own Python)."""
    blank, made = _pending()
    step = _clone(blank)
    for name, make in made:
        setattr(step, name, make())
    step.step_name, step.position, step.key_version = spec.name, spec.position, spec.key_version
    step.idempotency_key = idempotency_key(run.workflow_id, spec.name, spec.key_version)
    step.updated_at = now
    _point(step, run)
    return step


@cache
def _pending() -> tuple[StepExecution, tuple[tuple[str, Callable[[], Any]], ...]]:
    """A blank step (every field at its default) and the fields whose default is made anew for
    each row (``overrides=list``): they must not be shared."""
    fields = StepExecution._meta.concrete_fields
    return StepExecution(), tuple((f.attname, f.default) for f in fields if f.has_default() and callable(f.default))


def _conflict(workflow_id: str) -> StartConflict:
    return StartConflict(f"run {workflow_id} already exists with a different input; start a new business event instead")


@dataclass
class Started:
    """What became of one event of a batch (``run_start_many``): ``created`` (a new run),
    ``existing`` (the run this event already started), ``conflict`` (that run has another
    input) or ``invalid`` (the event does not validate); ``error`` says why for the last two."""

    index: int
    outcome: str
    run: WorkflowRun | None = None
    workflow_id: str = ""
    error: str = ""


def run_start_many(
    *,
    workflow: Workflow | str,
    events: Iterable[Any],
    actor: AbstractBaseUser | str | None = None,
    now: datetime | None = None,
) -> list[Started]:
    """``run_start`` for many events at once, in a constant number of statements: the existing
    runs read in one, the new runs, their steps and their start events written in one each (and
    under Celery their dispatch stamp in one more). Each event keeps ``run_start``'s guarantees:
    a repeated event gives its run, the same workflow id with another input is a conflict for
    that event alone, an event that does not validate is refused alone; nothing else is rolled
    back. Results come in the events' order. If another process starts one of these runs in the
    meantime, the batch is started again one event at a time (the unique workflow id decides)."""
    wf = get_workflow(workflow) if isinstance(workflow, str) else workflow
    events = list(events)
    now = now or clock.now()
    prepared: list[_Event | Started] = []
    for index, data in enumerate(events):
        try:
            prepared.append(_event(wf, data))
        except (ValueError, KeyError, TypeError) as exc:  # a ValidationError is a ValueError
            prepared.append(Started(index, "invalid", error=_invalid(exc)))
    first: dict[str, _Event] = {}  # workflow id -> the first event of this batch that makes it
    for event in prepared:
        if isinstance(event, _Event):
            first.setdefault(event.workflow_id, event)
    existing = {run.workflow_id: run for run in WorkflowRun.objects.filter(workflow_id__in=list(first))}
    new = [_new_run(wf, event, now, None) for wid, event in first.items() if wid not in existing]
    try:
        with transaction.atomic():
            WorkflowRun.objects.bulk_create(new)
            StepExecution.objects.bulk_create([step for run in new for step in _new_steps(wf, run, now)])
            _audit_many(new, AuditAction.START, actor=actor, now=now)
            dispatch.enqueue_runs([run.pk for run in new])
    except IntegrityError:  # started elsewhere meanwhile: each event decides alone, as run_start does
        return [_one_at_a_time(wf, data, index, actor, now) for index, data in enumerate(events)]
    runs = {**existing, **{run.workflow_id: run for run in new}}
    results = []
    for index, event in enumerate(prepared):
        if isinstance(event, Started):
            results.append(event)
            continue
        run = runs[event.workflow_id]
        if not _same_input(run, event):
            results.append(
                Started(index, "conflict", workflow_id=run.workflow_id, error=str(_conflict(run.workflow_id)))
            )
        else:
            created = event is first[event.workflow_id] and event.workflow_id not in existing
            results.append(Started(index, "created" if created else "existing", run=run, workflow_id=run.workflow_id))
    return results


def _one_at_a_time(wf: Workflow, data: Any, index: int, actor, now: datetime) -> Started:
    try:
        run, created = run_start(workflow=wf, data=data, actor=actor, now=now)
    except (ValueError, KeyError, TypeError) as exc:
        return Started(index, "invalid", error=_invalid(exc))
    except StartConflict as exc:
        return Started(index, "conflict", workflow_id=_event(wf, data).workflow_id, error=str(exc))
    return Started(index, "created" if created else "existing", run=run, workflow_id=run.workflow_id)


def _invalid(exc: Exception) -> str:
    if isinstance(exc, pydantic.ValidationError):
        return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'event'}: {e['msg']}" for e in exc.errors())
    if isinstance(exc, KeyError):
        return f"the event has no {exc}: its workflow id needs it"
    return str(exc)


def run_wait(*, lease: Lease, wake_at: datetime, reason: str, now: datetime | None = None) -> None:
    """Nothing is due before ``wake_at``: give the run back with its wake-up time."""

    def body(change: _Change) -> None:
        run = change.run
        if run.state == RunState.COMPENSATING:  # a compensation waits as compensating
            target = _check(RUN_TRANSITIONS, "compensation_wait", run.state, "run")
        else:
            target = _check(RUN_TRANSITIONS, "wait", run.state, "run")
        _release_into(run, target, wake_at=wake_at, reason=reason)
        change.save_run(RUN_LEASE_FIELDS + ["status_reason"])
        change.reason = reason

    _run_transition(lease, AuditAction.WAIT, now, body)


def run_release(*, lease: Lease, reason: str, now: datetime | None = None) -> None:
    """Give the run back, due at once (the executor stopped early by choice)."""

    def body(change: _Change) -> None:
        _check(RUN_TRANSITIONS, "release", change.run.state, "run")
        _release_into(change.run, RunState.PENDING, reason=reason)
        change.save_run(RUN_LEASE_FIELDS + ["status_reason"])
        change.reason = reason

    _run_transition(lease, AuditAction.RELEASE, now, body)


def run_complete(*, lease: Lease, now: datetime | None = None) -> None:
    def body(change: _Change) -> None:
        _check(RUN_TRANSITIONS, "complete", change.run.state, "run")
        _release_into(change.run, RunState.COMPLETED)
        change.run.current_step = ""
        change.save_run(RUN_LEASE_FIELDS + ["status_reason", "current_step"])

    _run_transition(lease, AuditAction.COMPLETE, now, body)


def run_review(*, lease: Lease, reason: str, step_name: str = "", now: datetime | None = None) -> None:
    """Stop and hand the run to an operator (a conflict the executor must not resolve). A
    parked run never keeps a step ``running``: a call that may have been made is unknown."""

    def body(change: _Change) -> None:
        _check(RUN_TRANSITIONS, "review", change.run.state, "run")
        abandoned = []
        for running in [s for s in change.draft.steps() if s.state == StepState.RUNNING]:
            step = change.other_step(running.step_name)
            step.state = StepState.UNKNOWN
            step.last_error_kind = ErrorKind.UNKNOWN_OUTCOME
            step.last_error = ABANDONED
            change.save_step(step, ["state", "last_error_kind", "last_error"])
            abandoned.append(step.step_name)
        _release_into(change.run, RunState.NEEDS_REVIEW, reason=reason)
        change.save_run(RUN_LEASE_FIELDS + ["status_reason"])
        change.reason = reason
        if abandoned:
            change.extra = {"steps_now_unknown": abandoned}

    _run_transition(lease, AuditAction.REVIEW, now, body, step_name=step_name)
