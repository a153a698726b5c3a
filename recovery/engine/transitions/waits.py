"""Durable waits (issue 38, recovery.waiting): a wait step reached, its event applied, its
deadline passed; and an event delivered to a run.

A waiting run holds no lease and no worker: it is ``waiting`` with its wake-up at the wait's
deadline (every wait has one), found by the claim's due-run index only once due. An
event delivered for it makes it due at once. Events are kept as they came (``RunEvent``,
insert-only, unique per run and sender's key): one that comes before its wait is reached is
applied when it is; one that comes after the wait ended is recorded as ``late`` and never
applied. Which event a wait applied is its step's ``remote_ref`` (the event's key).

A delivery does not take the run's lease: it locks the run's row, records the event and saves the
run (its revision bumped), so that an executor deciding on an older copy — about to begin the
wait, or to time it out — misses its write and decides again with the event in view."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, transaction

from recovery import clock, permissions
from recovery.contract import payload_hash
from recovery.engine import dispatch
from recovery.errors import EventConflict, EventRefused, NotPermitted
from recovery.models import RunEvent, RunRestart, RunState, StepExecution, StepState, WorkflowRun
from recovery.redaction import redact_text
from recovery.states import TERMINAL_RUN_STATES, AuditAction
from recovery.waiting import OnTimeout, a_role
from recovery.workflow import StepSpec, workflow_of

from ._core import (
    RUN_LEASE_FIELDS,
    Lease,
    _actor_fields,
    _audit,
    _Change,
    _check,
    _locked_run_by_id,
    _redacted,
    _release_into,
    _save_run,
    _snap,
    _step_transition,
)
from .restart_plan import KEPT
from .tables import RUN_TRANSITIONS, STEP_TRANSITIONS

MAX_KEY = 200
ENDED = frozenset({StepState.SUCCEEDED, StepState.SKIPPED, StepState.FAILED, StepState.COMPENSATED})


class EventHere(Exception):
    """An event for the wait came while the executor decided to wait, or to time it out: nothing
    written; the executor decides again and applies it."""


def _no_event_yet(change: _Change, spec: StepSpec) -> None:
    """Under the run's lock (a delivery takes it too), or fenced by the run's revision (a delivery
    bumps it): the wait's decision stands only if no event for it has come meanwhile."""
    if spec.wait is not None and not spec.wait.is_timer:
        if event_for(change.run, change.draft.steps(), spec, change.step) is not None:
            raise EventHere(f"{spec.name}: event {spec.wait.event!r} is here")


def waiting_text(spec: StepSpec, until: datetime, *, escalated_to: str = "") -> str:
    """ "approval: waiting for event 'approved' until 2026-12-07 03:12 UTC; then the run goes to review" """
    assert spec.wait is not None
    if spec.wait.is_timer:
        return f"{spec.name}: sleeping until {until:%Y-%m-%d %H:%M:%S} UTC"
    then = "the run goes to review" if escalated_to else spec.wait.on_timeout.text()
    was = f" (escalated to {a_role(escalated_to)})" if escalated_to else ""
    return f"{spec.name}: waiting for event {spec.wait.event!r}{was} until {until:%Y-%m-%d %H:%M} UTC; then {then}"


def wait_escalate(*, lease: Lease, spec: StepSpec, now: datetime | None = None) -> StepExecution:
    """The deadline passed with no event and the wait escalates (``OnTimeout.escalate``): it waits
    on, once, for ``timeout`` more, and from the console or ``manage.py`` only a person of the
    escalation's role may send its event now (a system's token still may); then review."""
    assert spec.wait is not None and spec.wait.on_timeout.action == "escalate"
    escalation = spec.wait.on_timeout

    def body(change: _Change) -> None:
        _no_event_yet(change, spec)
        why = escalate(change, escalation, lambda until: waiting_text(spec, until, escalated_to=escalation.role))
        change.reason = f"no event {spec.wait.event!r} by the deadline: {why}"

    return _step_transition(lease, spec.name, AuditAction.APPROVAL_ESCALATED, now, body)


def escalate(change: _Change, escalation: OnTimeout, said: Callable[[datetime], str]) -> str:
    """A wait for a person (a wait step's event, a held call's decision) past its deadline goes on,
    once, for ``escalation.timeout`` more, for a person of ``escalation.role`` (the step's
    ``approval`` names the role now): the run waits again until then, its reason ``said(until)``."""
    run, step = change.run, change.step
    assert escalation.timeout is not None
    until = change.now + escalation.timeout
    step.approval = {**(step.approval or {}), "role": escalation.role, "escalated_at": change.now.isoformat()}
    step.next_attempt_at = until
    change.save_step(step, ["approval", "next_attempt_at"])
    why = said(until)
    _check(RUN_TRANSITIONS, "wait", run.state, "run")
    _release_into(run, RunState.WAITING, wake_at=until, reason=why)
    change.save_run(RUN_LEASE_FIELDS + ["status_reason"])
    change.extra = {"role": escalation.role, "until": until.isoformat()}
    return why


def wait_begin(*, lease: Lease, spec: StepSpec, until: datetime, now: datetime | None = None) -> StepExecution:
    """The run reached the wait step with no event for it: it waits, holding nothing, until
    ``until`` (its deadline, a timer's time), or until an event for it comes."""

    def body(change: _Change) -> None:
        run, step = change.run, change.step
        _no_event_yet(change, spec)
        step.state = _check(STEP_TRANSITIONS, "wait", step.state, "step")
        step.first_attempt_at = change.now
        step.next_attempt_at = until
        step.approval = None  # a wait begun again (a restart, a retry) escalates afresh
        change.save_step(step, ["state", "first_attempt_at", "next_attempt_at", "approval"])
        why = waiting_text(spec, until)
        _check(RUN_TRANSITIONS, "wait", run.state, "run")
        _release_into(run, RunState.WAITING, wake_at=until, reason=why)
        change.save_run(RUN_LEASE_FIELDS + ["status_reason"])
        change.reason = why
        change.extra = {"until": until.isoformat()}

    return _step_transition(lease, spec.name, AuditAction.WAIT_BEGIN, now, body)


def wait_apply(
    *, lease: Lease, spec: StepSpec, event: RunEvent, result: Any, complete_run: bool, now: datetime | None = None
) -> StepExecution:
    """The event the wait step waits for is here (it may have come before the step was reached):
    the step succeeds with ``result``, and records the event's key as what it applied."""
    reason = f"event {event.name!r} ({event.key}) from {event.sent_by}, received at {event.received_at:%H:%M:%S} UTC"
    return _wait_end(lease, spec, AuditAction.EVENT_APPLIED, event.key, result, complete_run, reason, now)


def wait_time_out(
    *, lease: Lease, spec: StepSpec, result: Any, complete_run: bool, now: datetime | None = None
) -> StepExecution:
    """The wait's deadline passed with no event: what it declares (``OnTimeout``). ``proceed``: the
    step succeeds with the declared default (``result``); ``review``: the step fails, "no event by
    the deadline", and the run stops for an operator. Never a silent rejection."""
    assert spec.wait is not None
    if spec.wait.is_timer:
        return _wait_end(lease, spec, AuditAction.WAIT_TIMEOUT, "", result, complete_run, "its time came", now)
    missed = f"no event {spec.wait.event!r} by the deadline"
    if spec.wait.on_timeout.action == "proceed":
        why = f"{missed}: went on with the declared default"
        return _wait_end(lease, spec, AuditAction.WAIT_TIMEOUT, "", result, complete_run, why, now)

    def body(change: _Change) -> None:
        run, step = change.run, change.step
        _no_event_yet(change, spec)
        change.extra["waited_seconds"] = _waited(step, change.now)
        deadline = step.next_attempt_at
        step.state = _check(STEP_TRANSITIONS, "wait_time_out", step.state, "step")
        step.last_error = f"{missed} ({deadline:%Y-%m-%d %H:%M} UTC)" if deadline else missed
        step.next_attempt_at = None
        change.save_step(step, ["state", "last_error", "next_attempt_at"])
        _check(RUN_TRANSITIONS, "review", run.state, "run")
        why = f"{spec.name}: {step.last_error}; the wait declares review: an operator decides"
        _release_into(run, RunState.NEEDS_REVIEW, reason=why)
        change.save_run(RUN_LEASE_FIELDS + ["status_reason"])
        change.reason = why

    return _step_transition(lease, spec.name, AuditAction.WAIT_TIMEOUT, now, body)


def wait_skip(
    *, lease: Lease, spec: StepSpec, result: Any, complete_run: bool, now: datetime | None = None
) -> StepExecution:
    """The run reached the wait with no event for it, and the wait's ``when`` says this run does
    not wait: the step succeeds at once with ``result``, said so."""
    why = f"not needed for this run (it waits only {_rule(spec)}): went on without waiting for {spec.wait.event!r}"
    return _wait_end(lease, spec, AuditAction.WAIT_SKIPPED, "", result, complete_run, why, now)


def _rule(spec: StepSpec) -> str:
    assert spec.wait is not None and spec.wait.when is not None
    doc = (getattr(spec.wait.when, "__doc__", None) or "").strip().splitlines()
    return doc[0].rstrip(".") if doc else "its when= rule"


def _wait_end(lease, spec, action, applied, result, complete_run, reason, now) -> StepExecution:
    """The wait step succeeds: with the event ``applied`` (its key), or at its deadline (``applied``
    empty: a timer's time came, or the declared default, checked under the lock: no event came)."""

    def body(change: _Change) -> None:
        run, step = change.run, change.step
        if not applied:
            _no_event_yet(change, spec)
        change.extra["waited_seconds"] = _waited(step, change.now)
        step.state = _check(STEP_TRANSITIONS, "wait_end", step.state, "step")
        step.remote_ref = applied
        step.result = _redacted(run, result)
        step.next_attempt_at = None
        change.save_step(step, ["state", "remote_ref", "result", "next_attempt_at"])
        if complete_run:
            _check(RUN_TRANSITIONS, "complete", run.state, "run")
            _release_into(run, RunState.COMPLETED)
            run.current_step = ""
            change.save_run([*RUN_LEASE_FIELDS, "status_reason", "current_step"])
        change.reason = reason

    return _step_transition(lease, spec.name, action, now, body)


def _waited(step: StepExecution, now: datetime) -> float:
    """Seconds since the wait was reached (0 for an event that came before)."""
    return (now - step.first_attempt_at).total_seconds() if step.state == StepState.WAITING else 0.0


def waits_for_event(run: WorkflowRun) -> StepExecution | None:
    """The run's step waiting for an event or a person's decision now, if any (a wait step, a
    tool call held for approval): a sender or a person acts next, not the clock alone."""
    step = StepExecution.objects.filter(run=run, state=StepState.WAITING).first()
    if step is None:
        return None
    if step.approval:  # a tool call held for a person (transitions.call_approvals)
        return step
    wait = workflow_of(run).get_step(step.step_name).wait
    return step if wait is not None and not wait.is_timer else None


def event_for(run: WorkflowRun, steps: list[StepExecution], spec: StepSpec, step: StepExecution) -> RunEvent | None:
    """The event the wait step ``step`` applies now, if one is here: the first one kept for it
    (or from before any wait on it was reached), not late, received by its deadline, and not
    applied by another wait step on the same event."""
    assert spec.wait is not None and not spec.wait.is_timer
    taken = {s.remote_ref for s in steps if s.remote_ref and s.step_name != step.step_name}
    events = RunEvent.objects.filter(run=run, name=spec.wait.event, late=False, step_name__in=["", step.step_name])
    if step.state == StepState.WAITING and step.next_attempt_at is not None:
        events = events.filter(received_at__lte=step.next_attempt_at)
    if (since := _made_again_at(run, step.step_name)) is not None:
        events = events.filter(received_at__gte=since)  # one sent before answered the run as it was
    return next((e for e in events.order_by("received_at", "pk") if e.key not in taken), None)


def _made_again_at(run: WorkflowRun, step_name: str) -> datetime | None:
    """When a supervisor's restart last made the wait step again (None: never)."""
    for restart in RunRestart.objects.filter(run=run, applied_at__isnull=False).order_by("-applied_at"):
        if any(e["step"] == step_name and e["rule"] != KEPT for e in restart.effects):
            return restart.applied_at
    return None


def run_deliver_event(
    *,
    workflow_id: str,
    event: str,
    key: str,
    payload: Any,
    actor: AbstractBaseUser | str,
    now: datetime | None = None,
) -> tuple[RunEvent, bool]:
    """Deliver the event ``event`` to the run ``workflow_id`` under the sender's idempotency
    ``key``: validated by the wait that waits for it, recorded, and the run made due if it
    waits for it now. Returns the event and whether it is new: the same key again returns the
    first (nothing written); with another payload it is refused (EventConflict), as is an event
    for a finished run. An event the run's workflow waits for nowhere, or a payload its wait
    refuses: EventRefused. An unknown run: WorkflowRun.DoesNotExist. Nothing is written when
    refused."""
    now = now or clock.now()
    key = (key or "").strip()
    if not key or len(key) > MAX_KEY:
        raise EventRefused(f"an event needs the sender's idempotency key (1 to {MAX_KEY} characters)")
    with transaction.atomic():
        run = _locked_run_by_id(workflow_id)
        wf = workflow_of(run)
        waits = [s for s in wf.steps if s.wait is not None and s.wait.event == event and not s.wait.is_timer]
        if not waits:
            names = sorted({s.wait.event for s in wf.steps if s.wait is not None and s.wait.event})
            waited = f"it waits for: {', '.join(names)}" if names else "it waits for none"
            raise EventRefused(f"{wf.name} v{wf.version} waits for no event {event!r} ({waited})")
        steps = {s.step_name: s for s in StepExecution.objects.filter(run=run)}
        target = next((s for s in waits if steps[s.name].state not in ENDED), None)
        spec = target or waits[-1]
        if target is not None:
            _may_send(steps[target.name], actor)
        try:
            data = wf.redact(spec.wait.validate(payload))
        except ValueError as exc:  # pydantic's ValidationError is one
            raise EventRefused(f"event {event!r} refused by {spec.name}: {_first_lines(exc)}") from None
        digest = payload_hash(data)
        same = RunEvent.objects.filter(run=run, key=key).first()
        if same is not None:
            if same.name == event and same.payload_hash == digest:
                return same, False
            raise EventConflict(f"key {key!r} was used for another event of {workflow_id} already ({same.name})")
        if run.state in TERMINAL_RUN_STATES:
            raise EventConflict(f"run {workflow_id} is {run.state}: an event for it is not recorded")
        step = steps[target.name] if target is not None else None
        if step is None:
            late, why = True, f"the wait{'s' if len(waits) > 1 else ''} for it ended"
        elif step.state == StepState.WAITING and step.next_attempt_at is not None and now > step.next_attempt_at:
            late, why = True, f"{step.step_name}'s deadline passed at {step.next_attempt_at:%Y-%m-%d %H:%M} UTC"
        else:
            late, why = False, ""
        reached = step is not None and step.state == StepState.WAITING
        try:
            with transaction.atomic():
                kept = RunEvent.objects.create(
                    run=run,
                    name=event,
                    key=key,
                    payload=data,
                    payload_hash=digest,
                    received_at=now,
                    sent_by=_actor_fields(actor)["actor"],
                    late=late,
                    step_name=_for_step(step, spec, reached=reached, late=late),
                )
        except IntegrityError:  # the same key, delivered at the same moment: the first one stands
            raise EventConflict(f"key {key!r} of {workflow_id} is being delivered already; send it again") from None
        before = _snap(run)
        fields: list[str] = []
        if not late and reached and run.state == RunState.WAITING:
            run.next_wake_at = now  # due at once: the executor applies it
            fields.append("next_wake_at")
        # Saved in any case: an executor holding the run on an older copy misses its next write.
        _save_run(run, fields, now, actor)
        said = f"event {event!r} ({key}) from {kept.sent_by}"
        reason = f"{said}: late, not applied ({why})" if late else said
        after = {**_snap(run), "event": event, "key": key, "late": late}
        _audit(
            run,
            AuditAction.EVENT_RECEIVED,
            actor=actor,
            step_name=kept.step_name,
            reason=redact_text(reason),
            before=before,
            after=after,
            now=now,
        )
        if "next_wake_at" in fields:
            dispatch.enqueue_run(run.pk)
    return kept, True


def _may_send(step: StepExecution, actor: AbstractBaseUser | str) -> None:
    """Once a wait escalated, a person below the escalation's role may not send its event (a
    system with a token may: it answers for its own users)."""
    role = (step.approval or {}).get("role")
    if not role or isinstance(actor, str) or permissions.role_of(actor) >= permissions.role_named(role):
        return
    who = actor.get_username()
    raise NotPermitted(f"{who} may not send {step.step_name}'s event: escalated, it waits for {a_role(role)}")


def _for_step(step: StepExecution | None, spec: StepSpec, *, reached: bool, late: bool) -> str:
    """The wait step an event was for when it came: the one waiting (or whose wait ended, for a
    late one); "" for an early one, kept for the first wait on it to be reached."""
    if step is not None and (reached or late):
        return step.step_name
    return spec.name if late else ""


def _first_lines(exc: Exception) -> str:
    return " ".join(str(exc).split("\n")[:3])[:500]
