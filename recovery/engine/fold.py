"""One commit between two calls: a call's outcome and the next call's intent, written together.

When a call succeeds and the step after it is a call whose intent can be built here, without
I/O but its guards' (run here, before that commit), the success, the next intent and their
audit events are decided on one draft and written as one checkpoint list (``Lease.commit``):
one commit instead of two. A guard's refusal of the next step, or its failure to check, is
recorded in that commit instead of the intent. An agent's next model turn is added in the
commit of the tool call that finishes the turn before it (its first turn, in the commit of the
step before the agent): a turn then costs two commits, begun and recorded.

Why this keeps the recovery contract: a crash after that commit leaves the next step
``running`` with its intent written and nothing sent — exactly what a crash between an intent's
commit and its call leaves. The takeover reconciles it as always: by look-up and the in-flight
window, or (a step with no look-up) by an operator. What disappears is only the resting point
"N succeeded, N+1 not begun", which nothing needs — but after a model's decision,
which an operator may supersede (or a version move migrate) before anything acts on it, after
a crash too: a decision's success is written alone. Where the next step is not a plain call (a
model decision, an agent, a local step, an outbox message) or is not due, the outcome is
written alone and the next step is taken the ordinary way.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from recovery import clock
from recovery.engine import agent, failpoints, guards, transitions
from recovery.engine.plan import Plan, build_intent
from recovery.engine.transitions import DONE_STEP_STATES, Draft, Lease
from recovery.errors import InvalidTransition
from recovery.models import StepExecution, StepState, WorkflowRun
from recovery.workflow import (
    Outcome,
    StepContext,
    StepSpec,
    is_journal_name,
    journal_rows,
    parse_journal_name,
    payload_hash,
    workflow_of,
)


@dataclass(frozen=True)
class Begun:
    """The next call, its intent checkpointed in its predecessor's commit: to be made now."""

    plan: Plan
    spec: StepSpec
    step: StepExecution
    ctx: StepContext


def succeed(
    lease: Lease,
    plan: Plan,
    spec: StepSpec,
    step: StepExecution,
    outcome: Outcome,
    decision: dict[str, Any] | None,
) -> Begun | None:
    """Record ``step``'s success, with the next call's intent when it can be taken along.
    Returns that call, begun, or None."""
    succeeded = {
        "step_name": step.step_name,
        "outcome": outcome,
        "complete_run": plan.is_last(step),
        "decision": decision,
        "spec": spec,
    }
    if spec.is_decision:
        # A model's decision commits alone: until something acts on it, an operator can
        # supersede it and a version move migrate it, also after a crash right after it.
        transitions.step_succeed(lease=lease, **succeeded)
        return None
    try:
        draft = Draft.read(lease)
        transitions.step_succeed(lease=lease, draft=draft, **succeeded)
        begun = _next_call(lease, plan, draft, step.step_name)
        lease.commit(draft.checkpoints)
        return begun
    except (transitions.FenceMiss, InvalidTransition):
        # Someone else saved the run since the copy was made: the success alone, decided
        # again on the rows as they are (transitions.transition), the next step the ordinary way.
        transitions.step_succeed(lease=lease, **succeeded)
        return None


def _next_call(lease: Lease, plan: Plan, draft: Draft, done: str) -> Begun | None:
    """Decide on ``draft`` the step after ``done`` (recorded as succeeded on it): its intent
    (begun), or a guard's refusal; or, after an agent's tool call (or before its first turn),
    the agent's next model turn added. None when no call was begun."""
    after = Plan(run=draft.run, workflow=plan.workflow, steps=draft.steps())
    if after.run.state not in transitions.LEASED_RUN_STATES:  # the run completed with it
        return None
    if transitions.pausing(after.run):  # an operator asked to pause it: nothing new begins
        return None
    if is_journal_name(done):  # an agent's tool call: its next turn, once the turn's calls are done
        _next_turn(lease, after, draft, parse_journal_name(done).agent)
        return None
    step = after.next_step()
    if step is None:
        return None
    spec = after.workflow.get_step(step.step_name)
    if spec.is_agent:
        if not journal_rows(spec.name, after.steps):
            _next_turn(lease, after, draft, spec.name)
        return None
    if not _plain_call(spec, step):
        return None
    name = step.step_name
    failpoints.hit(name, "before_intent")
    ctx = after.context(step)
    intent, unbuilt = build_intent(after, spec, ctx)
    if unbuilt is not None:
        return None  # recorded as a failure the ordinary way, after this commit
    request_hash = payload_hash(intent)
    if step.request_hash and step.request_hash != request_hash:
        return None  # a conflict: the ordinary way says so
    ctx = replace(ctx, intent=intent)
    if not guards.check(lease, after.workflow, spec, step, ctx, after.steps, draft=draft):
        return None  # refused, or its guard could not check: recorded in this commit instead
    begun = transitions.step_begin(lease=lease, step_name=name, intent=intent, request_hash=request_hash, draft=draft)
    return Begun(plan=after, spec=spec, step=begun, ctx=ctx)


def _next_turn(lease: Lease, after: Plan, draft: Draft, name: str) -> None:
    """Add agent ``name``'s next model turn on ``draft`` when every row of its journal is done
    and no budget is spent (otherwise the executor sends the run to review the ordinary way)."""
    agent_step = next(s for s in after.steps if s.step_name == name)
    policy = after.workflow.get_step(name).agent
    assert policy is not None
    rows = journal_rows(name, after.steps)
    if agent_step.refusal or agent_step.state in DONE_STEP_STATES or agent.waiting(rows) is not None:
        return
    turn, _ = agent.next_turn(name, policy, rows)
    if turn:
        transitions.agent_turn_add(lease=lease, agent=name, turn=turn, key_version=agent_step.key_version, draft=draft)


def first_call(run: WorkflowRun, steps: list[StepExecution]) -> tuple[str, dict[str, Any], str] | None:
    """For a claimed start (``transitions.run_start_claimed``): the first step, its intent and
    request hash, when it is a plain call with no guard — to be begun in the start's own write.
    A crash after that write leaves it begun and nothing sent, as after any intent's commit; a
    start redelivered by Celery finds the run and leaves it to the takeover."""
    plan = Plan(run=run, workflow=workflow_of(run), steps=steps)
    step = plan.next_step()
    if step is None:
        return None
    spec = plan.workflow.get_step(step.step_name)
    if not _plain_call(spec, step) or plan.workflow.guards_for(spec):
        return None
    failpoints.hit(step.step_name, "before_intent")
    intent, unbuilt = build_intent(plan, spec, plan.context(step))
    if unbuilt is not None:
        return None
    return step.step_name, intent, payload_hash(intent)


def _plain_call(spec: StepSpec, step: StepExecution) -> bool:
    """A call made the ordinary way, pending, due, within its budget."""
    if spec.asks_model or spec.local or spec.outbox or spec.is_agent or spec.is_wait:
        return False
    if getattr(spec, "approval", None) is not None:  # it may wait for a person: decided the ordinary way
        return False
    if step.state != StepState.PENDING or step.refusal:
        return False
    if step.next_attempt_at is not None and step.next_attempt_at > clock.now():
        return False
    return step.attempts - step.budget_start_attempt < spec.retry.maximum_attempts
