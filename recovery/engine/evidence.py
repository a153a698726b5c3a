"""An operator's evidence that a step's call happened ("it succeeded, remote id X"), checked
like any request before it is recorded: at the receiver, against the step's declared result,
and against the run's next step.

- The step declares ``@lookup_ref``: the receiver is asked for X. It must have X, and X must be
  the step's own object (its key, reference or tenant: ``NotThisStep`` otherwise); the step's
  result is what the receiver answers, exactly as a reconcile by key would record it.
- Otherwise the step declares its result's schema (``result=``): the operator fills it in, and it
  is validated; X is kept as the reference.
- Otherwise the evidence cannot be checked, and "it succeeded" is not offered
  (``offers.evidence_refusal`` says why).

Either way, the intent of the step that comes next is built from the new result before anything
is recorded: a result the run cannot go on from is refused here, never found by the executor.

The look-up is network I/O, so it happens here, before the transition and outside its
transaction; the transition (``step_resolve``) records what this returns. An approval request
keeps it, and the grant records it as it was checked.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import pydantic
from django.contrib.auth.models import AbstractBaseUser

from recovery import clock
from recovery.actions import ACTIONS, parse_object
from recovery.engine import agent
from recovery.engine.calls import as_outcome, invoke
from recovery.engine.plan import Plan, build_intent
from recovery.engine.transitions import DONE_STEP_STATES, Situation, offers, why_not
from recovery.errors import InvalidTransition, NotThisStep
from recovery.models import StepExecution, StepState, WorkflowRun
from recovery.validation import one_line, problem_text, problems_of
from recovery.workflow import StepSpec, is_journal_name, journal_rows, parse_journal_name

MAX_REMOTE_REF = StepExecution._meta.get_field("remote_ref").max_length
MAX_RESULT_CHARS = 20_000


def examine(
    action: str,
    *,
    workflow_id: str,
    step_name: str | None,
    remote_ref: str,
    result: str | dict[str, Any] | None = None,
    actor: AbstractBaseUser | None = None,
    now: datetime | None = None,
) -> dict[str, Any] | None:
    """The checked evidence for ``action`` (``{"remote_ref", "result", "checked"}``, what
    ``step_resolve`` records), or None for an action that takes none. Raises InvalidTransition
    with the reason when the evidence does not hold (nothing is recorded), and the action's own
    refusal when the run does not allow it now. ``result``: the operator's filled-in result
    (JSON text or an object), for a step whose receiver cannot be asked."""
    spec_of_action = ACTIONS.get(action)
    if spec_of_action is None or not spec_of_action.evidence:
        if remote_ref and remote_ref.strip():
            raise InvalidTransition(f"{action} takes no remote id")
        if _given(result):
            raise InvalidTransition(f"{action} takes no result")
        return None
    remote_ref = (remote_ref or "").strip()
    if not remote_ref:
        raise InvalidTransition("give the remote id that shows it succeeded")
    if len(remote_ref) > MAX_REMOTE_REF:
        raise InvalidTransition(f"a remote id has at most {MAX_REMOTE_REF} characters")
    run = WorkflowRun.objects.get(workflow_id=workflow_id)
    steps = list(StepExecution.objects.filter(run=run))
    situation = Situation.of(run, steps, now or clock.now())
    refused = why_not(action, situation, step_name=step_name, actor=actor)
    if refused is not None:
        raise refused
    plan = Plan(run=run, workflow=situation.workflow, steps=sorted(steps, key=lambda s: s.order))
    step = situation.step(step_name)
    spec = plan.workflow.get_step(step.step_name)
    if spec.lookup_ref_fn is not None:
        if _given(result):
            raise InvalidTransition(
                f"{step.step_name}'s result is what the receiver answers for {remote_ref}: give no result by hand"
            )
        evidence = _looked_up(plan, spec, step, remote_ref)
    elif spec.result_schema is not None:
        evidence = _filled_in(spec, remote_ref, result, actor)
    else:  # why_not refused it already (offers.evidence_refusal): a registry changed since
        raise InvalidTransition(offers.evidence_refusal(step.step_name))
    _next_step_builds(plan, step, evidence["result"])
    return evidence


def _given(result: str | dict[str, Any] | None) -> bool:
    return result is not None and (not isinstance(result, str) or bool(result.strip()))


def _looked_up(plan: Plan, spec: StepSpec, step: StepExecution, remote_ref: str) -> dict[str, Any]:
    fn = spec.lookup_ref_fn
    found, error = invoke(lambda ctx: fn(ctx, remote_ref), plan.context(step))
    if isinstance(error, NotThisStep):
        raise InvalidTransition(f"{remote_ref} is not {step.step_name}'s object: {error}; nothing recorded")
    if error is not None:
        raise InvalidTransition(
            f"the receiver could not be asked for {remote_ref} ({error}); nothing recorded: try again when it answers"
        )
    if found is None:
        raise InvalidTransition(f"the receiver has no {remote_ref}: it is not evidence that {step.step_name} happened")
    outcome = as_outcome(found)
    return {
        "remote_ref": outcome.remote_ref or remote_ref,
        "result": outcome.result,
        "checked": f"looked up at the receiver: {outcome.remote_ref or remote_ref} is this step's",
    }


def _filled_in(
    spec: StepSpec, remote_ref: str, result: str | dict[str, Any] | None, actor: AbstractBaseUser | None
) -> dict[str, Any]:
    schema = spec.result_schema
    if not _given(result):
        raise InvalidTransition(f"{spec.name}'s receiver cannot be asked: fill in its result ({schema.__name__})")
    if isinstance(result, str):
        if len(result) > MAX_RESULT_CHARS:
            raise InvalidTransition(f"the result has at most {MAX_RESULT_CHARS} characters")
        result = parse_object(result, "the result")
    if not isinstance(result, dict):
        raise InvalidTransition("the result must be a JSON object")
    try:
        checked = schema.model_validate(result).model_dump(mode="json")
    except pydantic.ValidationError as exc:
        headline = f"the result does not match {schema.__name__}"
        raise InvalidTransition(one_line(problem_text(headline, problems_of(exc)))) from None
    who = actor.get_username() if actor is not None else "the system"
    return {"remote_ref": remote_ref, "result": checked, "checked": f"filled in by {who}, valid {schema.__name__}"}


def _next_step_builds(plan: Plan, step: StepExecution, result: Any) -> None:
    """Build what comes next from ``result`` (as if recorded), or refuse: the next step's intent
    for a step, the conversation of the agent's next turn for a tool call."""
    rows = [_with_result(s, result) if s.pk == step.pk else s for s in plan.steps]
    trial = Plan(run=plan.run, workflow=plan.workflow, steps=rows)
    if is_journal_name(step.step_name):
        try:
            json.dumps(agent.conversation(journal_rows(parse_journal_name(step.step_name).agent, rows)))
        except (TypeError, ValueError, KeyError) as exc:
            raise InvalidTransition(f"the agent's next turn cannot be asked with this result: {exc}") from None
        return
    following = next(
        (
            s
            for s in rows
            if s.order > step.order and not is_journal_name(s.step_name) and s.state not in DONE_STEP_STATES
        ),
        None,
    )
    if following is None:
        return
    spec = plan.workflow.get_step(following.step_name)
    _, error = build_intent(trial, spec, trial.context(following))
    if error is not None:
        raise InvalidTransition(
            f"{following.step_name}, the next step, cannot be built from this result ({error}); nothing recorded"
        )


def _with_result(step: StepExecution, result: Any) -> StepExecution:
    trial = StepExecution(**{f.attname: getattr(step, f.attname) for f in StepExecution._meta.concrete_fields})
    trial.state, trial.result = StepState.SUCCEEDED, result
    return trial
