"""Deterministic checks between a model's proposal and a write (contract rule 4: the model
proposes, the application decides). Before a step's intent is checkpointed, every guard that
applies to it runs (``Workflow.guards_for``): a ``PolicyRefusal`` writes nothing and sends the
run to review; a guard that cannot read the state it checks defers the step like a failed
look-up. A rule a supervisor overrode for this step no longer holds it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from recovery.engine import transitions
from recovery.engine.calls import invoke
from recovery.engine.transitions import Draft, Lease
from recovery.errors import PolicyRefusal
from recovery.models import StepExecution, StepState
from recovery.workflow import Guard, GuardContext, StepContext, StepSpec, Workflow


@dataclass
class _Verdict:
    refusal: PolicyRefusal | None = None
    checking: str = ""  # the rule whose guard was running when it raised something else


def _run_all(guards: list[Guard], overridden: set[str], verdict: _Verdict):
    def run(ctx: GuardContext) -> None:
        for guard in guards:
            verdict.checking = guard.rule
            try:
                guard.check(ctx)
            except PolicyRefusal as refusal:
                if refusal.rule not in overridden:
                    verdict.refusal = refusal
                    return

    return run


def check(
    lease: Lease,
    workflow: Workflow,
    spec: StepSpec,
    step: StepExecution,
    ctx: StepContext,
    steps: list[StepExecution],
    *,
    draft: Draft | None = None,
) -> bool:
    """Run ``spec``'s guards on ``ctx`` (whose intent is the one about to be checkpointed).
    Returns True when the step may go on; otherwise the refusal or the deferral is recorded —
    with ``draft`` (the intent to be checkpointed with the step before's outcome), decided on
    the draft, to be written with it."""
    guards = workflow.guards_for(spec)
    if not guards:
        return True
    overridden = {o.get("rule") for s in steps for o in s.overrides or ()}  # per run: the decision was accepted
    verdict = _Verdict()
    guard_ctx = GuardContext(**vars(ctx), decision=_decision(workflow, spec, steps))
    _, error = invoke(_run_all(guards, overridden, verdict), guard_ctx, lease=lease)
    if error is not None:
        transitions.step_defer_check(
            lease=lease, step_name=spec.name, rule=verdict.checking, error=error, spec=spec, draft=draft
        )
        return False
    if verdict.refusal is not None:
        refusal = verdict.refusal
        agent = workflow.agent_of(spec)
        transitions.step_refuse(
            lease=lease,
            step_name=spec.name,
            rule=refusal.rule,
            message=refusal.message,
            values=refusal.values,
            to_model=agent is not None and agent.agent is not None and agent.agent.refusals == "model",
            draft=draft,
        )
        return False
    return True


def _decision(workflow: Workflow, spec: StepSpec, steps: list[StepExecution]) -> dict[str, Any] | None:
    model_step = workflow.decision_before(spec)
    if model_step is None:
        return None
    done = next((s for s in steps if s.step_name == model_step.name and s.state == StepState.SUCCEEDED), None)
    return done.result if done is not None else None
