"""Restart a run from one of its steps with a corrected input, or a corrected intent of that step
(a supervisor, with a reason; four-eyes where the workflow asks): in place, the run keeping its
identity. What it would do is planned first (recovery.engine.transitions.restart_plan) and
recorded (``RunRestart``: what was overwritten, the difference, each effect's fate); the steps
from there go back to pending — at once, or, where effects must be undone first, once the
executor has compensated them (``restart_apply``, called by the executor after the compensation)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pydantic
from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, transaction

from recovery import clock
from recovery.engine import dispatch
from recovery.errors import InvalidTransition
from recovery.models import (
    DecisionState,
    ModelDecision,
    OutboxMessage,
    OutboxState,
    RunRestart,
    RunState,
    StepExecution,
    StepState,
    WorkflowRun,
)
from recovery.redaction import redact_text
from recovery.validation import one_line, problem_text, problems_of
from recovery.workflow import Workflow, idempotency_key, workflow_of

from ._core import RUN_LEASE_FIELDS, _audit, _check, _release_into, _save_run, _save_step, _snap
from .acting import Act, operator_transition
from .compensation import _mark_compensation
from .offers import why_not
from .restart_plan import KEPT, RestartPlan, plan_restart, restartable
from .runs import _event, _pending
from .tables import RUN_TRANSITIONS, STEP_TRANSITIONS


@operator_transition("restart", offered=restartable)
def run_restart(act: Act, *, edited: str, value: Any, effects_stand: bool = False) -> None:
    """Restart the run from ``step_name`` with ``value``: the corrected input (``edited="input"``)
    or the fields of the step's intent to correct (``"intent"``). Every step from there is made
    again: a read or a model step at once, an effect under a new key — undone first by its
    compensation, or (``effects_stand``, where the step declares a ``second_effect``) left standing
    beside the second one. Refused, with nothing written, where ``restart_plan`` refuses."""
    run, step_name = act.run, act.step_name
    _check(RUN_TRANSITIONS, "restart", run.state, "run")
    plan = planned(act.situation, step_name, edited=edited, value=value, effects_stand=effects_stand)
    try:
        with transaction.atomic():
            restart = RunRestart.objects.create(
                run=run,
                step_name=step_name,
                edited=edited,
                before=plan.before,
                after=plan.after,
                diff=plan.diff,
                effects=plan.effects_json(),
                requested_by=act.who,
                reason=redact_text(act.reason),
                requested_at=act.now,
            )
    except IntegrityError as exc:  # one_restart_waiting_per_run
        raise InvalidTransition(f"a restart of run {run.workflow_id} waits for its compensations already") from exc
    act.extra.update(restart=restart.pk, edited=edited, diff=plan.diff, effects=plan.effects_json())
    if plan.undo_first:
        targets = [act.situation.step(name) for name in plan.undo_first]
        order = _mark_compensation(run, targets, step_name=step_name, now=act.now, actor=act.actor)
        run.status_reason = redact_text(f"compensating {', '.join(order)} first; then restarting from {step_name}")
        act.save_run(["status_reason"])
        act.extra["undo_first"] = order
        act.wake = True
        return
    _apply(run, act.situation.steps, restart, workflow_of(run), act.now, act.actor)
    act.release(RunState.PENDING, f"restarted from {step_name} by {act.who}", fields=("input", "current_step"))


def restart_preview(
    situation, step_name: str | None, *, actor, edited: str, value: Any, effects_stand: bool = False
) -> RestartPlan:
    """What restarting the run would do, for ``actor`` now, refused as the transition would refuse
    it (the role, the run's state, the correction); nothing written: the console's preview, the
    approver's view of a request, ``recover restart --dry-run``."""
    refused = why_not("restart", situation, step_name=step_name, actor=actor)
    if refused is not None:
        raise refused
    return planned(situation, step_name, edited=edited, value=value, effects_stand=effects_stand)


def planned(situation, step_name: str, *, edited: str, value: Any, effects_stand: bool = False) -> RestartPlan:
    """``plan_restart`` of an offered restart, with the run's own checks of a corrected input (the
    workflow's schema and the run's identity) and of its outbox."""
    run = situation.run
    plan = plan_restart(
        situation,
        step_name,
        edited=edited,
        value=value,
        effects_stand=effects_stand,
        check_input=lambda data: checked_input(run, situation.workflow, data),
    )
    names = [e.step for e in plan.effects]
    waiting = OutboxMessage.objects.filter(
        run=run, step_name__in=names, state__in=[OutboxState.PENDING, OutboxState.FAILED]
    ).values_list("step_name", flat=True)
    if waiting := sorted(set(waiting)):
        raise InvalidTransition(
            f"{', '.join(waiting)}: its message is not delivered yet; let it be delivered (resume) or "
            "compensate it first"
        )
    return plan


def checked_input(run: WorkflowRun, workflow: Workflow, data: Any) -> dict[str, Any]:
    """A corrected input as the event API would take it (the workflow's schema, redaction), for
    this run: its identity — the run's id, which the event's keys make — cannot change."""
    try:
        event = _event(workflow, data)
    except pydantic.ValidationError as exc:
        headline = f"the corrected input does not match {workflow.input_schema.__name__}"
        raise InvalidTransition(one_line(problem_text(headline, problems_of(exc)))) from None
    except ValueError as exc:
        raise InvalidTransition(f"the corrected input is refused: {exc}") from None
    if event.workflow_id != run.workflow_id:
        raise InvalidTransition(
            f"the corrected input names another run ({event.workflow_id}), not {run.workflow_id}: the keys a run "
            "is named by cannot change (start that business event as a run of its own)"
        )
    return event.data


def restart_apply(*, run_pk: int, now: datetime | None = None) -> bool:
    """Apply the run's restart that waited for its compensations, once they are all done (the run
    still compensating, none of its steps: ``run_compensation_done`` keeps it so, due): its steps
    from the restart's step go back to pending and it is due. Audited as the restart's second
    half, by the executor. False when there is nothing to apply (yet). Called by the executor
    after the compensation; an executor lost in between leaves the run due, and the next one
    comes back here."""
    now = now or clock.now()
    with transaction.atomic():
        run = WorkflowRun.objects.select_for_update().filter(pk=run_pk, state=RunState.COMPENSATING).first()
        restart = RunRestart.waiting(run_pk) if run else None
        if restart is None:
            return False
        steps = list(StepExecution.objects.select_for_update().filter(run=run))
        if any(step.state == StepState.COMPENSATING for step in steps):
            return False
        before = _snap(run)
        _apply(run, steps, restart, workflow_of(run), now, None)
        _release_into(run, RunState.PENDING, reason=f"restarted from {restart.step_name} by {restart.requested_by}")
        _save_run(run, [*RUN_LEASE_FIELDS, "status_reason", "input", "current_step"], now)
        after = {**_snap(run), "restart": restart.pk, "requested_by": restart.requested_by}
        reason = f"its compensations done: restarted from {restart.step_name} ({restart.reason})"
        _audit(
            run, "restart", actor=None, step_name=restart.step_name, reason=reason, before=before, after=after, now=now
        )
        dispatch.enqueue_run(run.pk)
        return True


def _apply(
    run: WorkflowRun,
    steps: list[StepExecution],
    restart: RunRestart,
    workflow: Workflow,
    now: datetime,
    actor: AbstractBaseUser | None,
) -> None:
    """The restart written: the corrected input on the run; every step from the restart's step
    pending again as a new row would be, its key a new version where the plan gave it one, the
    corrected intent's fields on the restart's step; model decisions superseded."""
    by_name = {step.step_name: step for step in steps}
    if restart.edited == "input":
        run.input = restart.after
    run.current_step = restart.step_name
    correction = {k: v for k, v in restart.after.items() if restart.before.get(k) != v}
    blank, made = _pending()
    why = redact_text(f"restart from {restart.step_name} by {restart.requested_by}: {restart.reason}")[:2000]
    for effect in restart.effects:
        if effect["rule"] == KEPT:
            continue
        row = by_name[effect["step"]]
        if workflow.get_step(row.step_name).is_decision:
            ModelDecision.objects.filter(run=run, step_name=row.step_name, state=DecisionState.ACCEPTED).update(
                state=DecisionState.SUPERSEDED, superseded_reason=why
            )
        state = _check(STEP_TRANSITIONS, "restart", row.state, "step")
        kept = {"id", "run_id", "step_name", "position", "key_version", "idempotency_key", "restarts"}
        fields = [f.attname for f in StepExecution._meta.concrete_fields if f.attname not in kept]
        for name in fields:
            setattr(row, name, getattr(blank, name))
        for name, make in made:
            setattr(row, name, make())
        row.state = state
        if effect.get("key_version"):
            row.restarts = (row.restarts or 0) + effect["key_version"] - row.key_version
            row.key_version = effect["key_version"]
            row.idempotency_key = idempotency_key(run.workflow_id, row.step_name, row.key_version)
            fields += ["key_version", "idempotency_key", "restarts"]
        if restart.edited == "intent" and row.step_name == restart.step_name:
            row.correction = correction
        _save_step(row, [f for f in fields if f != "updated_at"], now, actor)
    restart.applied_at = now
    restart.save(update_fields=["applied_at"])
