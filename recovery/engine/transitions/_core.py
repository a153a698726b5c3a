"""What every transition shares: an executor transition decided on a draft of its leased run
and written as checkpoints (``transition``, recovery.engine.transitions.checkpoints), row locks
for operators' transitions, saving with ``update_fields``, and the audit writer (one event per
transition, with the state before and after)."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction

from recovery import clock, redaction, text
from recovery.actions import audited
from recovery.engine import storage
from recovery.errors import ErrorKind, InvalidTransition, LeaseLost, RunChanged, RunPaused, StepError
from recovery.models import AuditEvent, RunState, StepExecution, StepState, WorkflowPause, WorkflowRun
from recovery.redaction import redact_text
from recovery.states import AuditAction
from recovery.workflow import get_workflow, workflow_of

from .checkpoints import Checkpoint, Draft, FenceMiss, Lease, _observed
from .tables import EXECUTOR, PAUSE_POINTS, RUN_TRANSITIONS


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
    if not audited(action):
        raise ValueError(f"{action!r} is no audit action: name it in recovery.states.AuditAction")
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


def transition[T](lease: Lease, decide: Callable[[Draft], T]) -> T:
    """An executor transition: ``decide`` on a draft of the leased run (its checkpoints added to
    the draft), then one write of them (``Lease.commit``). The draft is the executor's copy
    while it has one; if the fence no longer matches (someone else saved the run), or deciding
    on the copy raised (perhaps refused by a state someone else has since changed), the run is
    locked, read again and decided on afresh, once: the decision may be made twice, nothing is
    written twice. Raises LeaseLost if the lease is gone; nothing is then written."""
    draft = Draft.read(lease)  # LeaseLost if its copy says the lease is gone
    try:
        return _unless_paused(_written(lease, draft, decide), draft)
    except FenceMiss:
        pass  # nothing written, the copy dropped
    except LeaseLost:
        raise
    except Exception:
        lease.seen.clear()
    with transaction.atomic():
        draft = Draft.read(lease, locked=True)
        decided = _written(lease, draft, decide)
    return _unless_paused(decided, draft)  # raised once the pause is committed


_PAUSED = object()


def _written[T](lease: Lease, draft: Draft, decide: Callable[[Draft], T]) -> T:
    try:
        decided = decide(draft)
    except PauseReached as reached:  # what was decided before the pause point is written with the pause
        pause_checkpoint(draft, paused=reached.workflow_pause)
        decided = _PAUSED
    if draft.checkpoints:  # a decision may find nothing to do (a pause withdrawn meanwhile)
        lease.commit(draft.checkpoints)
    return decided


def _unless_paused[T](decided: T, draft: Draft) -> T:
    if decided is _PAUSED:
        raise paused_error(draft)
    return decided


# --- a pause reached by the executor: an operator's of the run (recovery.engine.transitions.pauses),
# a supervisor's of its workflow or step (recovery.engine.transitions.workflow_pauses) ------------


class PauseReached(Exception):
    """Deciding a pause point (PAUSE_POINTS) on a run whose pause was asked for, or where a pause
    of its workflow or step is in force (``workflow_pause``): nothing of it is decided;
    ``transition`` writes the pause instead (``pause_checkpoint``)."""

    def __init__(self, workflow_pause: WorkflowPause | None = None):
        super().__init__(workflow_pause)
        self.workflow_pause = workflow_pause


def pausing(run: WorkflowRun) -> bool:
    """An operator asked to pause the run while an executor held it (going forward, or
    compensating): it stops at its next step boundary, once what is in flight is recorded."""
    return run.paused_at is not None and (
        run.state == RunState.RUNNING or (run.state == RunState.COMPENSATING and bool(run.lease_owner))
    )


def paused_text(run: WorkflowRun) -> str:
    """ "paused by olga at 03:12:00 UTC: ledger outage" (the run's status and why-sentence)."""
    return f"paused by {run.paused_by} at {clock.time_of_day(run.paused_at)}: {run.pause_reason}"


def pause_checkpoint(draft: Draft, now: datetime | None = None, *, paused: WorkflowPause | None = None) -> None:
    """Decide on ``draft`` the pause the run's operator asked for — or the pause ``paused`` of
    its workflow or step — after whatever it decided before (a call's outcome): the run is given
    back as paused. The caller writes it, then raises ``paused_error`` outside its transaction."""

    def body(change: _Change) -> None:
        run = change.run
        _check(RUN_TRANSITIONS, "pause_reached", run.state, "run")
        fields = RUN_LEASE_FIELDS + ["status_reason"]
        if paused is not None:  # held by its workflow's pause until that is released
            run.paused_at, run.paused_by, run.workflow_pause_id = paused.paused_at, paused.paused_by, paused.pk
            run.pause_reason = redact_text(f"{paused.scope} paused: {paused.reason}")[:1000]
            fields += ["paused_at", "paused_by", "pause_reason", "workflow_pause_id"]
            change.extra["workflow_pause"] = paused.scope
        _release_into(run, RunState.PAUSED, reason=paused_text(run))
        change.save_run(fields)
        change.extra["paused_by"] = run.paused_by

    _decide(draft, AuditAction.PAUSE_REACHED, now or clock.now(), body, step_name=draft.run.current_step, of_step=False)


def paused_error(draft: Draft) -> RunPaused:
    return RunPaused(f"run {draft.run.workflow_id} {draft.run.status_reason}")


def _pause_over(run: WorkflowRun) -> set[str]:
    """After an executor's transition of a run whose pause was asked for: a run given back to be
    due (or waiting for a timer, or to compensate later) is paused instead; one that stopped by
    itself (review, failure, completion, a failed compensation) ends the request. The run's fields
    so changed."""
    if run.paused_at is None or run.state in (RunState.RUNNING, RunState.PAUSED) or pausing(run):
        return set()
    if run.state in (RunState.PENDING, RunState.WAITING, RunState.COMPENSATING):  # given back: due, or later
        run.state = RunState.PAUSED
        run.status_reason = redact_text(paused_text(run))
        return {"state", "status_reason"}
    run.paused_at, run.paused_by, run.pause_reason = None, None, None
    return {"paused_at", "paused_by", "pause_reason"}


@dataclass
class _Change:
    """A transition being decided on a draft: the run and its step (if it is a step's), what
    the body changes in them (``save_run``, ``save_step``), rows to insert, the audit event's
    reason and ``extra`` facts for its ``after``."""

    draft: Draft
    run: WorkflowRun
    step: StepExecution | None
    now: datetime
    action: str
    reason: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    run_fields: set[str] = field(default_factory=set)
    step_fields: dict[str, set[str]] = field(default_factory=dict)
    rows: list[Any] = field(default_factory=list)

    def save_run(self, fields: Iterable[str]) -> None:
        """The run's ``fields`` are written by this checkpoint (its revision bumped, as
        ``_save_run``'s: see there)."""
        self.run.updated_at = self.now
        self.run.revision += 1
        self.run_fields.update({*fields, "updated_at", "revision"})

    def save_step(self, step: StepExecution, fields: Iterable[str]) -> None:
        assert self.draft.changed.get(step.step_name) is step, "a checkpoint writes the draft's steps"
        step.updated_at = self.now
        self.step_fields.setdefault(step.step_name, set()).update({*fields, "updated_at"})

    def other_step(self, name: str) -> StepExecution:
        return self.draft.step(name)

    def insert(self, row: Any) -> None:
        if isinstance(row, StepExecution):
            self.draft.add(row)
        self.rows.append(row)


def _decide[T](
    draft: Draft, action: str, now: datetime, body: Callable[[_Change], T], *, step_name: str = "", of_step: bool = True
) -> T:
    """Decide one transition on ``draft``: ``body`` changes the draft's run (and, for a step's
    transition, the step ``step_name``, which becomes the run's current one, the lease renewed
    with it; ``of_step`` False: a run's transition that names the step in its audit event only);
    the checkpoint — the changed fields, the rows, the audit event with the state before and
    after (plus ``change.extra``) — is added to the draft."""
    run = draft.run
    if action in PAUSE_POINTS:
        if pausing(run):
            raise PauseReached
        if (paused := draft.workflow_pause(step_name)) is not None:
            raise PauseReached(paused)
    step = draft.step(step_name) if step_name and of_step else None
    before = _snap(run, step)
    change = _Change(draft=draft, run=run, step=step, now=now, action=action)
    if step is not None:
        renewal = _renewal(now, step_name)
        for name, value in renewal.items():
            setattr(run, name, value)
        change.run_fields.update(renewal)
    decided = body(change)
    if over := _pause_over(run):
        if change.run_fields:  # written with the body's own (its revision bumped once)
            change.run_fields.update(over)
        else:
            change.save_run(over)
    after = {**_snap(run, step), **change.extra}
    event = _audit_row(run, change.action, _actor_fields(None), step_name, change.reason, before, after, now)
    draft.checkpoints.append(
        Checkpoint(
            draft=draft,
            action=change.action,
            step_name=step_name,
            run={name: getattr(run, name) for name in change.run_fields},
            steps={
                name: {field: getattr(draft.changed[name], field) for field in fields}
                for name, fields in change.step_fields.items()
            },
            rows=change.rows,
            event=event,
            after=after,
        )
    )
    return decided


def _step_transition(
    lease: Lease,
    step_name: str,
    action: str,
    now: datetime | None,
    body: Callable[[_Change], None],
    *,
    draft: Draft | None = None,
) -> StepExecution:
    """``body`` as a transition of the step ``step_name`` (``_decide``, ``transition``):
    returns the step as written. With ``draft``, only decided on it (its checkpoint added to
    the draft, for the caller to commit with others): returns the step as decided."""
    now = now or clock.now()

    def decide(draft: Draft) -> StepExecution:
        _decide(draft, action, now, body, step_name=step_name)
        return draft.changed[step_name]

    return decide(draft) if draft is not None else transition(lease, decide)


def _run_transition[T](
    lease: Lease, action: str, now: datetime | None, body: Callable[[_Change], T], *, step_name: str = ""
) -> T:
    """``body`` as a transition of the leased run (no step of its own; ``step_name`` named in
    its audit event)."""
    now = now or clock.now()
    return transition(lease, lambda draft: _decide(draft, action, now, body, step_name=step_name, of_step=False))


def _renewal(now: datetime, step_name: str) -> dict[str, Any]:
    """What every transition of a step writes on its run: the lease renewed, the step current."""
    return {"updated_at": now, "lease_expires_at": now + lease_duration(), "current_step": step_name}


def _save(obj: WorkflowRun | StepExecution, fields: set[str], actor: AbstractBaseUser | str | None) -> None:
    if actor is None or isinstance(actor, str):
        # The engine's own checkpoint, or a system's (``"api:monitor"``, audited under that name):
        # one UPDATE, no saved version — versions are what people saved (see _history_user).
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


ABANDONED = "the executor running this step lost the run before recording its outcome"


def _abandon_running_steps(run: WorkflowRun, now: datetime, actor: AbstractBaseUser | None) -> list[str]:
    """A step left ``running`` by an executor that lost (or is losing) the run has an unknown
    outcome: an operator's transition records it so, never leaving it ``running`` forever."""
    names = []
    for step in StepExecution.objects.select_for_update().filter(run=run, state=StepState.RUNNING):
        step.state = StepState.UNKNOWN
        step.last_error_kind = ErrorKind.UNKNOWN_OUTCOME
        step.last_error = ABANDONED
        _save_step(step, ["state", "last_error_kind", "last_error"], now, actor)
        names.append(step.step_name)
    return names
