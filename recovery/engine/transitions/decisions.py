"""A model step's decision, replaced by an operator: an edited one (validated by the step's
schema, accepted at once as a new version) or the model asked again."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pydantic
from django.contrib.auth.models import AbstractBaseUser
from django.db.models import Max

from recovery.errors import InvalidTransition
from recovery.models import DecisionState, ModelDecision, RunState, StepState, WorkflowRun
from recovery.redaction import redact_text
from recovery.states import AuditAction
from recovery.validation import one_line, problem_text, problems_of
from recovery.workflow import StepSpec, workflow_of

from . import offers
from ._core import (
    _check,
    _redacted,
    _save_step,
)
from .acting import acting
from .operator import BUDGET_FIELDS, _clear_refusal, _fresh_budget
from .performers import performs
from .tables import STEP_TRANSITIONS


@performs("supersede", offered=offers.decision_replaceable)
@performs("decide_again", offered=offers.decision_replaceable)
def decision_supersede(
    *,
    workflow_id: str,
    step_name: str,
    actor: AbstractBaseUser | None,
    reason: str,
    decision: dict[str, Any] | None = None,
    expect: str | None = None,
    now: datetime | None = None,
) -> WorkflowRun:
    """Replace the accepted model decision (rule 4: a new decision needs a recorded reason).
    With ``decision``, by that edited one — validated by the step's schema, accepted at once as
    a new version, checked by the guards when the run goes on; without, the step asks the model
    again. Only while no later step has sent a request built from the old one: its key would
    then carry a different payload. A later step's refusal and overrides are cleared (they were
    about the old decision).

    On a model step whose output never validated (no accepted decision; offers.decision_replaceable), the
    same two: a decision written by a person — validated the same way, recorded as the next
    version after the invalid outputs with no proposal, and the step succeeds with it — or the
    model asked again with a fresh budget."""
    with acting(
        "supersede" if decision is not None else "decide_again",
        workflow_id=workflow_id,
        step_name=step_name,
        actor=actor,
        reason=reason,
        expect=expect,
        now=now,
        audit_as=AuditAction.DECISION_SUPERSEDE,
    ) as act:
        run, now, reason = act.run, act.now, act.reason
        old = (
            ModelDecision.objects.select_for_update()
            .filter(run=run, step_name=step_name, state=DecisionState.ACCEPTED)
            .first()
        )
        spec = workflow_of(run).get_step(step_name)
        accepted = None if decision is None else _redacted(run, _validated(spec, decision))
        step = act.step
        if old is None and step.state == StepState.SUCCEEDED:
            raise InvalidTransition(f"step {step_name} has no accepted decision")
        later = [other for other in act.situation.steps if other.position > step.position]
        if old is None:  # its output never validated (offers.decision_replaceable): nothing to supersede
            act.before.update(decision_version=None, decision=None)
            latest = _latest_version(run, step_name)
        else:
            act.before.update(decision_version=old.version, decision=old.accepted)
            latest = old.version
            old.state = DecisionState.SUPERSEDED
            old.superseded_reason = redact_text(reason)
            old.save(update_fields=["state", "superseded_reason"])
        if accepted is None:  # ask the model again
            step.state = StepState.PENDING
            step.remote_ref = ""
            step.result = None
        else:
            version = latest + 1
            if step.state != StepState.SUCCEEDED:  # written by hand in place of output that never validated
                step.state = _check(STEP_TRANSITIONS, "attempt_succeed", step.state, "step")
            ModelDecision.objects.create(
                run=run,
                step_name=step_name,
                version=version,
                state=DecisionState.ACCEPTED,
                schema_version=spec.schema_version,
                proposal=None,  # an operator's decision: the model proposed none of it
                accepted=accepted,
                created_at=now,
            )
            step.remote_ref = f"decision v{version}"
            step.result = accepted
            act.extra.update(decision_version=version, decision=accepted, set_by=act.who)
        _fresh_budget(step)
        _save_step(step, ["state", "remote_ref", "result", *BUDGET_FIELDS], now, actor)
        workflow = workflow_of(run)
        again = []
        for other in later:
            fields = []
            if other.refusal or other.overrides or other.last_error_kind:
                _clear_refusal(other)
                other.overrides = []
                fields += ["refusal", "overrides", "last_error_kind", "last_error"]
            if other.state != StepState.PENDING and workflow.get_step(other.step_name).reads:
                # a read made from the old decision (offers.decision_replaceable allows only reads here): again
                other.state = _check(STEP_TRANSITIONS, "read_again", other.state, "step")
                other.result, other.remote_ref = None, ""
                _fresh_budget(other)
                fields += ["state", "result", "remote_ref", *BUDGET_FIELDS]
                again.append(other.step_name)
            if fields:
                _save_step(other, fields, now, actor)
        act.release(RunState.PENDING, f"{step_name}: decision superseded by {act.who}")
        if again:
            act.extra["read_again"] = again
        return run


def _latest_version(run: WorkflowRun, step_name: str) -> int:
    """The step's highest decision version (0: only invalid outputs, which are all version 0)."""
    found = ModelDecision.objects.filter(run=run, step_name=step_name).aggregate(v=Max("version"))["v"]
    return found or 0


def _validated(spec: StepSpec, decision: Any) -> dict[str, Any]:
    """The decision as the step's schema accepts it; else InvalidTransition naming every
    problem (bounded, recovery.validation), on one line."""
    if spec.decision_schema is None:
        raise InvalidTransition(f"{spec.name} is not a model step: it has no decision to replace")
    if not isinstance(decision, dict):
        raise InvalidTransition("the decision must be a JSON object")
    try:
        return spec.decision_schema.model_validate(decision).model_dump(mode="json")
    except pydantic.ValidationError as exc:
        headline = f"the decision does not match {spec.decision_schema.__name__}"
        raise InvalidTransition(one_line(problem_text(headline, problems_of(exc)))) from None
