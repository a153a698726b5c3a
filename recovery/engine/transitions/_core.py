"""What every transition shares: the lease (the fencing token), row locks, the fenced
one-statement checkpoint, saving with ``update_fields``, and the audit writer (one event per
transition, with the state before and after)."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import connection, transaction

from recovery import clock, redaction, text
from recovery.engine import observed, storage
from recovery.errors import ErrorKind, InvalidTransition, LeaseLost, RunChanged, StepError
from recovery.models import AuditEvent, RunState, StepExecution, StepState, WorkflowRun
from recovery.redaction import redact_text
from recovery.workflow import get_workflow, workflow_of

from .tables import EXECUTOR, LEASED_RUN_STATES


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
    # before making it, local steps included (see executor._execute, local_steps).
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
        fields = workflow_of(run).redact_fields
    except LookupError:  # a version not deployed here: the current one's (a version that goes keeps them)
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
    assert not _holding(), "a transition wrote while one_write held writes"
    who = _actor_fields(actor)
    storage.insert(AuditEvent, _audit_row(run, action, who, step_name, reason, before, after, now))
    _observed(run, action, step_name, after, who["actor"])


def _audit_many(runs: list[WorkflowRun], action: str, *, actor: AbstractBaseUser | str | None, now: datetime) -> None:
    """``_audit`` of the same action (from nothing to the run's state) on many new runs: one statement."""
    who = _actor_fields(actor)
    rows = [_audit_row(run, action, who, "", "", {}, _snap(run), now) for run in runs]
    AuditEvent.objects.bulk_create([AuditEvent(**row) for row in rows])
    for run in runs:
        _observed(run, action, "", _snap(run), who["actor"])


def _observed(run: WorkflowRun, action: str, step_name: str, after: dict, actor: str) -> None:
    """Counted and logged once the transition's transaction commits (recovery.engine.observed)."""
    observed.transition(
        workflow_id=run.workflow_id,
        workflow=run.workflow_name,
        action=action,
        step=step_name,
        after=after,
        lease_generation=run.lease_generation,
        actor=actor,
    )


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
    # and a history row per checkpoint would double the executor's writes. It skips a save
    # whenever ``skip_history_when_saving`` exists, whatever its value: set it, or remove it.
    obj._history_user = actor
    if actor is None:
        obj.skip_history_when_saving = True
    elif hasattr(obj, "skip_history_when_saving"):
        del obj.skip_history_when_saving


RUN_LEASE_FIELDS = ["state", "lease_owner", "lease_expires_at", "lease_generation", "next_wake_at", "updated_at"]


def _locked_run(lease: Lease) -> WorkflowRun:
    """Lock the run and check the fencing token. Raises LeaseLost if another executor took it.

    The run's row lock is what every writer of the run or of its steps takes first; if the
    run's revision is the one this executor last wrote, nobody else has changed either since,
    and ``lease.seen`` stays; otherwise it is dropped."""
    _write_held()
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
        rows = list(StepExecution.objects.filter(run_id=lease.run_pk).select_related("run").order_by("position", "pk"))
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
    return run, sorted(steps.values(), key=lambda s: s.order)


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
    _write_held()
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
        run_values = {name: getattr(run, name) for name in run_fields}
        fence = {"lease_generation": lease.generation, "revision": revision, "state": LEASED_RUN_STATES}
        step_values = {name: getattr(step, name) for name in step_fields or {"updated_at"}}
        event = _audit_row(run, action, _actor_fields(None), step_name, change.reason, before, after, now)
        held = _HELD.get()
        if held is not None and held.lease is lease:
            held.hold(run.pk, run_values, fence, step.pk, step_values, event)
            written = True
        else:
            written = storage.checkpoint(run.pk, run_values, fence, step.pk, step_values, event)
    except BaseException:
        lease.seen.clear()  # the copy holds changes that were not written
        raise
    if not written:
        lease.seen.clear()  # someone else saved the run, or the lease is gone: the ordinary way decides
        return None
    _observed(run, action, step_name, after, EXECUTOR)
    return step


class StaleCopy(Exception):
    """Writes held by ``one_write`` found their fence no longer matching (someone else saved
    the run since, or the lease is gone): nothing of them was written."""


@dataclass
class _Held:
    """One-statement transitions of one run's steps, held by ``one_write``: the fence of the
    first, the values written to the run and to each step (the later over the earlier), the
    audit events in order."""

    lease: Lease
    run_pk: int | None = None
    fence: dict[str, Any] = field(default_factory=dict)
    run_values: dict[str, Any] = field(default_factory=dict)
    steps: dict[int, dict[str, Any]] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)

    def hold(
        self,
        run_pk: int,
        run_values: dict[str, Any],
        fence: dict[str, Any],
        step_pk: int,
        step_values: dict[str, Any],
        event: dict[str, Any],
    ) -> None:
        if self.steps and (step_pk in self.steps or step_values.keys() != next(iter(self.steps.values())).keys()):
            self.write()  # one statement writes the same columns of each step, once
        if self.run_pk is None:
            self.run_pk, self.fence = run_pk, fence
        assert run_pk == self.run_pk, "held writes are of one run"
        self.run_values.update(run_values)
        self.steps[step_pk] = step_values
        self.events.append(event)

    def write(self) -> None:
        """Write what is held (as one statement), then hold nothing. Raises StaleCopy if the
        fence did not match: then the caller's transaction must roll back."""
        if self.run_pk is None:
            return
        run_pk, fence, run_values, steps, events = self.run_pk, self.fence, self.run_values, self.steps, self.events
        self.run_pk, self.fence, self.run_values, self.steps, self.events = None, {}, {}, {}, []
        if not storage.checkpoint_many(run_pk, run_values, fence, steps, events):
            self.lease.seen.clear()
            raise StaleCopy(f"run {run_pk} was saved by someone else, or lease {self.lease.generation} is gone")


_HELD: ContextVar[_Held | None] = ContextVar("recovery_held_writes", default=None)


@contextmanager
def one_write(lease: Lease) -> Iterator[None]:
    """Inside a transaction: the one-statement transitions of the lease's run made in the block
    (on PostgreSQL, under a current copy) are held, and written together as one statement when
    the block ends (``storage.checkpoint_many``). For steps that commit together anyway (a
    group of local steps): one round trip instead of one per step. Any other write of the run
    writes what is held first, so the audit events keep their order. Raises StaleCopy (nothing
    of the block written, the copy dropped) if the fence no longer matches when they are
    written; the caller's transaction must then roll back, and the caller decide again on
    fresh rows."""
    assert transaction.get_connection().in_atomic_block, "held writes must commit with the block's transaction"
    held = _Held(lease)
    token = _HELD.set(held)
    try:
        yield
        held.write()
    finally:
        _HELD.reset(token)


def _holding() -> bool:
    held = _HELD.get()
    return held is not None and held.run_pk is not None


def _write_held() -> None:
    """Before a write the ordinary way: what ``one_write`` holds goes first."""
    held = _HELD.get()
    if held is not None:
        held.write()


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


def _copy(run: WorkflowRun, steps: Iterable[StepExecution]) -> dict[str, Any]:
    """``Lease.seen`` for a run and its steps, each step pointing at that run."""
    by_name = {}
    for step in steps:
        step.run = run
        by_name[step.step_name] = step
    return {"run": run, "steps": by_name}


def in_flight_text(sent_at: datetime | None, until: datetime) -> str:
    """ "when the receiver can no longer commit the request sent at …" for a status line."""
    sent = f" sent at {sent_at:%H:%M:%S} UTC" if sent_at is not None else ""
    return f"at {until:%H:%M:%S} UTC, when the receiver can no longer commit the request{sent}"


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
    """The reason an operator gives, stripped, its line breaks as LF (a textarea sends CRLF):
    required, at most ``max_length`` characters (a reason, not a document: it is shown in the
    console and in every export), no NUL character (PostgreSQL cannot store one) and no other
    control character but TAB and LF (ESC and its kin repaint the terminal of whoever reads
    it: recovery.text)."""
    reason = text.normalize_newlines(reason or "").strip()
    if not reason:
        raise InvalidTransition("a reason is required")
    if len(reason) > max_length:
        raise InvalidTransition(f"the reason is {len(reason):,} characters long; at most {max_length:,} are allowed")
    if "\x00" in reason:
        raise InvalidTransition("the reason contains a NUL character (U+0000)")
    refused = text.control_character(reason)
    if refused is not None:
        raise InvalidTransition(
            f"the reason contains a control character ({text.codepoint(refused)}); write it as plain text"
        )
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
