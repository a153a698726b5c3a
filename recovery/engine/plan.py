"""A run as the executor sees it under its lease: its row, its steps and its workflow's
definition (``Plan``), loaded from the lease's copy (``load``), and a step's intent as it is
built, redacted and hashed before it is checkpointed (``intent``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from recovery import clock
from recovery.engine import agent, transitions
from recovery.engine.transitions import DONE_STEP_STATES, Lease
from recovery.errors import PermanentError, StepError, classify
from recovery.models import OutboxMessage, OutboxState, StepExecution, StepState, WorkflowRun
from recovery.workflow import (
    CompensationPolicy,
    StepContext,
    StepSpec,
    Workflow,
    is_journal_name,
    journal_rows,
    parse_journal_name,
    workflow_of,
)


@dataclass
class Plan:
    run: WorkflowRun
    workflow: Workflow
    steps: list[StepExecution]

    def next_step(self) -> StepExecution | None:
        """The first step not done yet; an agent's journal rows are its agent's to drive."""
        return next(
            (s for s in self.steps if s.state not in DONE_STEP_STATES and not is_journal_name(s.step_name)), None
        )

    def context(self, step: StepExecution) -> StepContext:
        base = StepContext(
            workflow_id=self.run.workflow_id,
            input=self.run.input,
            step=step.step_name,
            idempotency_key=step.idempotency_key,
            results={
                s.step_name: s.result
                for s in self.steps
                if s.state == StepState.SUCCEEDED and not is_journal_name(s.step_name)
            },
            intent=step.intent,
            key_versions=self.key_versions(),
        )
        if not is_journal_name(step.step_name) or not agent.is_turn(step):
            return base
        spec = self.workflow.get_step(step.step_name)
        assert spec.agent is not None
        entry = parse_journal_name(step.step_name)
        return agent.context(spec.agent, base, journal_rows(entry.agent, self.steps), entry.turn)

    def key_versions(self) -> dict[str, int]:
        """Each step's key version in this run (a restart makes a step again under a new one)."""
        return {s.step_name: s.key_version for s in self.steps if not is_journal_name(s.step_name)}

    @property
    def auto_compensate(self) -> bool:
        return self.workflow.compensation == CompensationPolicy.AUTOMATIC

    def is_last(self, step: StepExecution, *also: StepExecution) -> bool:
        """Whether finishing ``step`` (and ``also``) finishes the run (no step left, nothing in
        the outbox)."""
        finishing = {step.pk, *(s.pk for s in also)}
        others_done = all(s.state in DONE_STEP_STATES for s in self.steps if s.pk not in finishing)
        if not others_done:
            return False
        return not any(s.outbox for s in self.workflow.steps) or not self.undelivered().exists()

    def undelivered(self):
        return OutboxMessage.objects.filter(run_id=self.run.pk, state__in=[OutboxState.PENDING, OutboxState.FAILED])


def load(lease: Lease) -> Plan | None:
    loaded = transitions.leased_run(lease)
    if loaded is None:
        return None
    run, steps = loaded
    try:
        workflow = workflow_of(run)
    except LookupError as exc:
        # The claim takes only runs whose version this process has: this is a registry changed
        # since. Not the run's fault, so no review: let go; a process that has the version takes it.
        transitions.run_wait(lease=lease, wake_at=clock.now(), reason=f"{exc}: left for a process that has it")
        return None
    if changed := transitions.drift(steps, workflow):
        transitions.run_review(lease=lease, reason=changed)
        return None
    return Plan(run=run, workflow=workflow, steps=steps)


def build_intent(plan: Plan, spec: StepSpec, ctx: StepContext) -> tuple[dict[str, Any], StepError | None]:
    """The step's intent, or why it could not be built (a permanent error: nothing was sent);
    with the fields a restart corrected (``correction``) laid over it, checked again.
    What is persisted is what is replayed: the intent is redacted before it is hashed,
    checkpointed and sent, so an attempt after a crash sends exactly what this one does."""
    try:
        intent = spec.intent_fn(ctx) if spec.intent_fn else {}
        row = next((s for s in plan.steps if s.step_name == ctx.step), None)
        if row is not None and row.correction:  # a supervisor's restart corrected some of its fields
            intent = transitions.corrected_intent(spec, intent, row.correction)
        return plan.workflow.redact(intent), None
    except Exception as exc:
        return {}, PermanentError(f"could not build the step's intent: {classify(exc)}")
