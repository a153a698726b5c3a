"""Compensating a run: the executor undoes the marked steps, latest first (reverse dependency
order), each compensation sent again only once an earlier request of it can no longer commit."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime

from recovery import clock
from recovery.engine import transitions
from recovery.engine.calls import as_outcome, invoke
from recovery.engine.plan import Plan
from recovery.engine.transitions import Lease
from recovery.errors import UnknownOutcome
from recovery.models import OutboxState, StepExecution, StepState
from recovery.workflow import Outcome, StepContext, StepSpec, compensation_key


def compensate_once(lease: Lease, plan: Plan) -> bool:
    """Undo the next marked step, latest first (reverse dependency order)."""
    marked = sorted((s for s in plan.steps if s.state == StepState.COMPENSATING), key=lambda s: s.order, reverse=True)
    if not marked:
        transitions.run_compensation_done(lease=lease)
        transitions.restart_apply(run_pk=plan.run.pk)  # a restart that waited for these compensations
        return False
    step = marked[0]
    if step.next_attempt_at is not None and step.next_attempt_at > clock.now():
        transitions.run_wait(
            lease=lease, wake_at=step.next_attempt_at, reason=f"{step.step_name}: compensation not due"
        )
        return False
    spec = plan.workflow.get_step(step.step_name)
    assert spec.compensation_fn is not None  # only compensable steps are ever marked
    if step.compensation_sent_at is not None and not _compensation_may_repeat(lease, spec, step):
        return False
    remote_ref = step.remote_ref
    if spec.outbox:
        remote_ref = _undeliver(lease, plan, spec, step)
        if remote_ref is None:
            return False
        if remote_ref == "":
            return True
    if not _confirmed_own(lease, plan, spec, step, remote_ref):
        return False
    ctx = StepContext(
        workflow_id=plan.run.workflow_id,
        input=plan.run.input,
        step=step.step_name,
        idempotency_key=compensation_key(plan.run.workflow_id, step.step_name, step.key_version),
        results={s.step_name: s.result for s in plan.steps if s.result is not None},
        intent={"remote_ref": remote_ref, "result": step.result, "intent": step.intent},
        key_versions=plan.key_versions(),
    )
    transitions.compensation_begin(lease=lease, step_name=step.step_name)
    raw, error = invoke(spec.compensation_fn, ctx, lease=lease, point=f"{step.step_name}.compensate")
    if error is None:
        transitions.compensation_succeed(lease=lease, step_name=step.step_name, outcome=as_outcome(raw))
        return True
    transitions.compensation_fail(lease=lease, step_name=step.step_name, error=error, spec=spec)
    return False


def _confirmed_own(lease: Lease, plan: Plan, spec: StepSpec, step: StepExecution, remote_ref: str) -> bool:
    """Whether the compensation may act on ``remote_ref``: the step's own look-up by the
    receiver's id (``@lookup_ref``, asked with the step's context: its key, the run's reference)
    confirms that the object is this run's. A step's record may name another request's object
    (evidence recorded before it was checked, a row written by hand): reversing it would undo
    another tenant's effect while this run's stands. Asked before every request, outside any
    transaction; otherwise nothing is sent and ``compensation_unconfirmed`` records why. A step
    without ``@lookup_ref`` has nothing to confirm with: its compensation acts on the record."""
    fn = spec.lookup_ref_fn
    if fn is None:
        return True
    found, error = None, None  # a step that recorded no remote id: nothing this run's to act on
    if remote_ref:
        found, error = invoke(lambda ctx: fn(ctx, remote_ref), plan.context(step), lease=lease)
    if error is None and found is not None:
        return True
    transitions.compensation_unconfirmed(
        lease=lease, step_name=step.step_name, remote_ref=remote_ref, error=error, spec=spec
    )
    return False


def _compensation_may_repeat(lease: Lease, spec: StepSpec, step: StepExecution) -> bool:
    """An earlier compensation request of this step got no answer (its executor was lost
    mid-call): send it again only once it can no longer commit, so that a compensation that
    looks before it acts (has the correction been sent?) cannot miss it."""
    return _window_closed(
        lease,
        spec,
        step,
        sent_at=step.compensation_sent_at,
        unknown="the executor compensating this step was lost before recording the outcome",
        waiting="compensation outcome unknown; trying again",
    )


def _window_closed(
    lease: Lease, spec: StepSpec, step: StepExecution, *, sent_at: datetime | None, unknown: str, waiting: str
) -> bool:
    """Whether a compensation may go on although a request sent at ``sent_at`` got no answer:
    only once that request can no longer commit. Before then the run waits for the window's end;
    with no bound the compensation fails visibly (an operator checks). Returns False when the
    executor must let go now."""
    until = spec.in_flight_until(sent_at)
    if until is None:
        transitions.compensation_fail(lease=lease, step_name=step.step_name, spec=spec, error=UnknownOutcome(unknown))
        return False
    if clock.now() < until:
        reason = f"{step.step_name}: {waiting} {transitions.in_flight_text(sent_at, until)}"
        transitions.run_wait(lease=lease, wake_at=until, reason=reason)
        return False
    return True


def _undeliver(lease: Lease, plan: Plan, spec: StepSpec, step: StepExecution) -> str | None:
    """Before compensating an outbox step: a message never delivered is cancelled (nothing
    to correct); one delivered, or perhaps delivered by an attempt whose answer was lost, is
    corrected. Returns the provider reference to compensate, "" when the step is done, or
    None when the executor must let go (a publisher holds the message, or a look-up failed)."""
    message = transitions.outbox_cancel(lease=lease, step_name=step.step_name)
    if message.state == OutboxState.DELIVERED:
        return message.provider_ref
    if message.state == OutboxState.PENDING:  # a publisher is delivering it right now
        transitions.run_wait(lease=lease, wake_at=message.claimed_until, reason=f"{step.step_name}: being delivered")
        return None
    if message.attempts:
        found, error = invoke(spec.lookup_fn, replace(plan.context(step), intent=message.payload), lease=lease)
        if error is not None:
            transitions.compensation_fail(lease=lease, step_name=step.step_name, error=error, spec=spec)
            return None
        if found is not None:
            return as_outcome(found).remote_ref
        # An attempt whose outcome is unknown may still deliver it: "never sent" only after its
        # in-flight window.
        if message.settle_from is not None and not _window_closed(
            lease,
            spec,
            step,
            sent_at=message.settle_from,
            unknown="a delivery attempt's outcome is unknown and may land at any time",
            waiting="message not found yet; looking again",
        ):
            return None
    transitions.compensation_succeed(
        lease=lease,
        step_name=step.step_name,
        outcome=Outcome(
            remote_ref=f"outbox:{message.pk} cancelled", result={"cancelled_before_delivery": True}, restored=True
        ),
    )
    return ""
