"""The executor: claims a run with a lease and advances it step by step.

For each step: checkpoint the intent (commit), call, checkpoint the outcome (commit) — and
when the next step is a call too, its intent in that same commit (recovery.engine.fold). No
database lock is held across a remote call. A local step (its effect in this database)
commits its effect, attempt and outcome at once, together with the local steps right after
it. A step found ``running`` when a run is taken over has an unknown outcome and is reconciled
before anything else is written. Every write is a checkpoint decided on a draft of the run and
written by ``Lease.commit`` (recovery.engine.transitions.checkpoints).

The same ``advance`` runs in-process (``run_executor``, recovery.engine.loop) and inside a
Celery task. The run as the executor sees it is recovery.engine.plan; local steps are
recovery.engine.local_steps; compensations recovery.engine.compensating.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from datetime import timedelta
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.db import InterfaceError, OperationalError

from recovery import clock
from recovery.engine import agent, failpoints, fold, guards, transitions
from recovery.engine.calls import as_outcome, database_unavailable, invoke, validate_decision, working_on
from recovery.engine.compensating import compensate_once
from recovery.engine.local_steps import execute_local
from recovery.engine.plan import Plan, build_intent, load
from recovery.engine.transitions import Lease
from recovery.errors import (
    ErrorKind,
    ExecutorLost,
    InvalidModelOutput,
    LeaseLost,
    PermanentError,
    RunPaused,
    StepError,
)
from recovery.models import DecisionState, ModelDecision, OutboxState, RunState, StepExecution, StepState, WorkflowRun
from recovery.redaction import redact_text
from recovery.states import AuditAction
from recovery.workflow import (
    Outcome,
    Reconcile,
    StepContext,
    StepSpec,
    journal_rows,
    parse_journal_name,
    payload_hash,
)

log = logging.getLogger("recovery.executor")

MAX_TRANSITIONS_PER_CLAIM = 200


def advance(run_pk: int, *, owner: str | None = None) -> str | None:
    """Advance one run as far as it can go now. Returns the run's state when this executor
    let go of it, or None if the run was not claimable (someone else holds it, or it is not
    due, or it is finished)."""
    try:
        lease = transitions.run_claim(run_pk=run_pk, owner=owner)
    except (OperationalError, InterfaceError) as exc:
        raise database_unavailable(exc, f"run {run_pk}") from exc
    return None if lease is None else advance_claimed(lease)


def start_and_advance(
    *, workflow: str, data: Any, owner: str | None = None, actor: AbstractBaseUser | str | None = None
) -> tuple[WorkflowRun, str | None]:
    """Start the event's run and advance it here at once, as far as it can go now: the run is
    written already claimed by this executor (``transitions.run_start_claimed``), so no claim
    follows. Returns the run and its state when this executor let go of it. A repeated event
    gives its run as it is, with None: it is not advanced here (whoever holds it, or claims it
    when it is due, does)."""
    try:
        run, lease = transitions.run_start_claimed(
            workflow=workflow, data=data, owner=owner, actor=actor, first=fold.first_call
        )
    except (OperationalError, InterfaceError) as exc:
        raise database_unavailable(exc, f"the start of a {workflow} run") from exc
    return run, None if lease is None else advance_claimed(lease)


def advance_claimed(lease: Lease) -> str | None:
    run = lease.seen["run"]  # the claim's own copy
    with working_on("advance run", run, parent=run.traceparent or "", lease_generation=lease.generation):
        return _advance_bound(lease)


def _advance_bound(lease: Lease) -> str | None:
    try:
        if lease.begun:  # the start wrote its first call's intent: make that call first
            _first_call(lease)
        for _ in range(MAX_TRANSITIONS_PER_CLAIM):
            plan = load(lease)
            if plan is None:
                break
            if not _step_once(lease, plan):
                break
        else:
            transitions.run_release(lease=lease, reason="transition limit per claim reached; due again")
    except RunPaused as exc:
        log.info("stopped advancing: %s", exc)
    except LeaseLost as exc:
        log.warning("stopped advancing: %s", exc)
    except failpoints.FailpointRaised:
        raise  # behaves as a crash at that point: the lease expires and the run is taken over
    except (OperationalError, InterfaceError) as exc:
        # The database went away (a restart, a failover, a dropped connection): infrastructure,
        # not a fault of the workflow. Let go; the lease expires and whoever claims the run next
        # finds a step left running unknown and reconciles it. Never park the run for this.
        raise database_unavailable(exc, f"run {lease.run_pk}") from exc
    except Exception as exc:
        # A bug in a workflow or the engine would otherwise crash every executor that takes
        # this run over, forever. Hand it to an operator instead (if the database still
        # answers; if not, the lease expires and the run is taken over later).
        log.exception("executor error on run %s", lease.run_pk)
        reason = redact_text(f"executor error: {type(exc).__name__}: {exc}")[:2000]  # redacted, then cut
        transitions.run_review(lease=lease, reason=reason)
    seen = lease.seen.get("run")  # as this executor's last transition left it, if nobody changed it since
    if seen is not None:
        return seen.state
    return WorkflowRun.objects.filter(pk=lease.run_pk).values_list("state", flat=True).first()


def _step_once(lease: Lease, plan: Plan) -> bool:
    """Make one transition. Returns False when this executor should let go of the run."""
    if plan.run.state == RunState.COMPENSATING:
        return compensate_once(lease, plan)
    step = plan.next_step()
    if step is None:
        return _finish(lease, plan)
    if transitions.pausing(plan.run) and step.state != StepState.RUNNING:
        # An operator asked to pause the run while this executor held it: stop here (a step a lost
        # executor left running is first recorded unknown, as always; it is looked up after).
        transitions.run_pause_reached(lease=lease)  # RunPaused, unless it was unpaused since
        return True
    name = step.step_name
    with working_on(f"step {name}", plan.run, step=name, attempt=step.attempts, key=step.idempotency_key):
        made = _step(lease, plan, step)
    return _made_begun(lease, made)


def _made_begun(lease: Lease, made: bool | fold.Begun) -> bool:
    """Make the calls begun in the commit of the one before (``fold``), one after the other."""
    while isinstance(made, fold.Begun):
        step, name = made.step, made.step.step_name
        with working_on(f"step {name}", made.plan.run, step=name, attempt=step.attempts, key=step.idempotency_key):
            made = _call(lease, made.plan, made.spec, step, made.ctx) or True
    return made


def _first_call(lease: Lease) -> None:
    """The call a claimed start checkpointed with it (``Lease.begun``): made as any begun call."""
    plan = load(lease)
    if plan is None:
        return
    step = next(s for s in plan.steps if s.step_name == lease.begun)
    spec = plan.workflow.get_step(step.step_name)
    _made_begun(lease, fold.Begun(plan=plan, spec=spec, step=step, ctx=plan.context(step)))


def _step(lease: Lease, plan: Plan, step: StepExecution) -> bool | fold.Begun:
    """Make one transition of ``step``. Returns whether to go on, or the next call when its
    intent was written with this step's outcome (``fold``): to be made next."""
    spec = plan.workflow.get_step(step.step_name)
    if spec.is_agent:
        return _agent(lease, plan, spec, step)
    if spec.is_wait:
        return _wait(lease, plan, spec, step)
    if step.state == StepState.WAITING:  # a tool call held for a person's approval
        return _approval_due(lease, spec, step)
    now = clock.now()

    if step.state == StepState.RUNNING:
        # Its previous owner lost the lease mid-call: the call may or may not have happened.
        transitions.step_mark_unknown(
            lease=lease,
            step_name=step.step_name,
            spec=spec,
            error=ExecutorLost("the executor running this step was lost before recording its outcome"),
        )
        return True

    if step.next_attempt_at is not None and step.next_attempt_at > now:
        transitions.run_wait(lease=lease, wake_at=step.next_attempt_at, reason=f"{step.step_name}: not due yet")
        return False

    if step.state == StepState.UNKNOWN:
        return _reconcile(lease, plan, spec, step)

    return _execute(lease, plan, spec, step) or True


def _agent(lease: Lease, plan: Plan, spec: StepSpec, step: StepExecution) -> bool | fold.Begun:
    """One transition of an agent step, from its journal: the first row not done yet (a model
    turn or a tool call) is taken as any step is — made, retried, reconciled; once every row is
    done, the next turn is added, unless a budget is spent (then an operator decides). The
    turn that gives the final answer completes the agent step (``_record_turn``)."""
    assert spec.agent is not None
    if step.refusal:  # an operator stopped it: only an operator lets it go on
        transitions.run_review(lease=lease, step_name=spec.name, reason=f"{spec.name}: {step.refusal['message']}")
        return False
    rows = journal_rows(spec.name, plan.steps)
    row = agent.waiting(rows)
    if row is not None:
        with working_on(f"step {row.step_name}", plan.run, step=row.step_name, attempt=row.attempts):
            return _step(lease, plan, row)
    turn, why_not = agent.next_turn(spec.name, spec.agent, rows)
    if not turn:
        transitions.run_review(lease=lease, step_name=spec.name, reason=why_not)
        return False
    transitions.agent_turn_add(lease=lease, agent=spec.name, turn=turn, key_version=step.key_version)
    return True


def _wait(lease: Lease, plan: Plan, spec: StepSpec, step: StepExecution) -> bool:
    """A wait step (recovery.waiting): apply its event if one is here; else begin waiting,
    holding nothing; else, woken at its deadline with none, do what it declares. Nothing is
    called: the step's function only turns the event into its result. An event that comes
    while this is decided makes the decision go round again (``EventHere``): it is applied."""
    assert spec.wait is not None
    now, last = clock.now(), plan.is_last(step)
    event = None if spec.wait.is_timer else transitions.event_for(plan.run, plan.steps, spec, step)
    try:
        if event is not None:
            result = _wait_result(spec, replace(plan.context(step), event=event.payload), event.payload)
            transitions.wait_apply(lease=lease, spec=spec, event=event, result=result, complete_run=last)
            failpoints.hit(spec.name, "after_outcome")
            return True
        if step.state != StepState.WAITING and spec.wait.when is not None and not spec.wait.when(plan.context(step)):
            result = _wait_result(spec, plan.context(step), {"waited": False})
            transitions.wait_skip(lease=lease, spec=spec, result=result, complete_run=last)
            failpoints.hit(spec.name, "after_outcome")
            return True
        if step.state != StepState.WAITING:
            until = spec.wait.deadline(plan.context(step), now)
            transitions.wait_begin(lease=lease, spec=spec, until=until)
            return False
        until, held = step.next_attempt_at, step.approval or {}
        escalated = held.get("role", "") if held.get("escalated_at") else ""
        if until is not None and now < until:  # woken before its time (an event for another wait, a sweep)
            why = transitions.waiting_text(spec, until, escalated_to=escalated)
            transitions.run_wait(lease=lease, wake_at=until, reason=why)
            return False
        if spec.wait.on_timeout.action == "escalate" and not escalated:
            transitions.wait_escalate(lease=lease, spec=spec)  # waits on, once; then review
            return False
        default = spec.wait.on_timeout.default
        if spec.wait.is_timer:
            default = _wait_result(spec, plan.context(step), {"woke_at": (until or now).isoformat()})
        transitions.wait_time_out(lease=lease, spec=spec, result=default, complete_run=last)
    except transitions.EventHere:
        return True  # decided again, with the event in view
    failpoints.hit(spec.name, "after_outcome")
    return spec.wait.on_timeout.action == "proceed"


def _approval_due(lease: Lease, spec: StepSpec, step: StepExecution) -> bool:
    """A tool call held for a person, woken with no decision: before its deadline (a sweep) it
    waits on; after, it escalates once or goes to review, as its tool declares."""
    assert spec.approval is not None
    approval, until = step.approval or {}, step.next_attempt_at
    if until is not None and clock.now() < until:
        role, escalated = approval.get("role", ""), bool(approval.get("escalated_at"))
        reason = transitions.approval_text(spec, step.step_name, role, until, escalated=escalated)
        transitions.run_wait(lease=lease, wake_at=until, reason=reason)
    elif spec.approval.on_timeout.action == "escalate" and not approval.get("escalated_at"):
        transitions.call_approval_escalate(lease=lease, spec=spec, step_name=step.step_name)
    else:
        transitions.call_approval_time_out(lease=lease, step_name=step.step_name)
    return False


def _wait_result(spec: StepSpec, ctx: StepContext, default: Any) -> Any:
    """The wait step's function of its event (or a timer's of its time): its result, or ``default``."""
    result = spec.call(ctx)
    return default if result is None else result


def _record_turn(lease: Lease, plan: Plan, spec: StepSpec, step: StepExecution, raw: Any) -> StepError | None:
    """Journal a model turn's reply with the calls it asks for, or say why it cannot be."""
    assert spec.agent is not None
    entry = parse_journal_name(step.step_name)
    try:
        reply = agent.read_reply(spec.agent, plan.workflow.redact(raw), entry.turn)
    except InvalidModelOutput as exc:
        return exc
    done = next(s for s in plan.steps if s.step_name == entry.agent)
    calls = agent.new_calls(spec.agent, entry.agent, entry.turn, reply)
    forks = done.key_version - spec.key_version  # each fork: a new key version (a turn's spec is its agent's)
    transitions.agent_turn_record(
        lease=lease,
        agent=entry.agent,
        step_name=step.step_name,
        reply=reply.as_result(),
        calls=calls,
        key_versions={name: tool.key_version + forks for name, tool in spec.agent.tools.items()},
        final=reply.final,
        complete_run=reply.final is not None and plan.is_last(done, step),
    )
    return None


def _finish(lease: Lease, plan: Plan) -> bool:
    """Every step is done: the run completes once its outbox is delivered."""
    failed = plan.undelivered().filter(state=OutboxState.FAILED).first()
    if failed is not None:
        transitions.run_review(
            lease=lease,
            step_name=failed.step_name,
            reason=f"{failed.step_name}: message not delivered after {failed.attempts} attempt(s): {failed.last_error}",
        )
        return False
    pending = plan.undelivered().order_by("next_attempt_at").first()
    if pending is not None:
        now = clock.now()
        wake_at = max(now + timedelta(seconds=1), pending.next_attempt_at or now, pending.claimed_until or now)
        reason = f"{pending.step_name}: waiting for outbox delivery"
        if pending.settle_from is not None and pending.next_attempt_at is not None and pending.next_attempt_at > now:
            until = plan.workflow.get_step(pending.step_name).in_flight_until(pending.settle_from)
            when = (
                transitions.in_flight_text(pending.settle_from, until)
                if until == pending.next_attempt_at
                else f"at {pending.next_attempt_at:%H:%M:%S} UTC"
            )
            reason = f"{pending.step_name}: message outcome unknown; looking it up again {when}"
        transitions.run_wait(lease=lease, wake_at=wake_at, reason=reason)
        return False
    transitions.run_complete(lease=lease)
    return False


def _reconcile(lease: Lease, plan: Plan, spec: StepSpec, step: StepExecution) -> bool | fold.Begun:
    """Resolve an unknown outcome before anything else is written (rule 7)."""
    if spec.reconcile in (Reconcile.RERUN, Reconcile.RESEND):
        # Safe by declaration: re-running has no double effect, or the receiver keeps its
        # first result for this key and replays it.
        return _execute(lease, plan, spec, step) or True
    if spec.reconcile == Reconcile.LOOKUP and spec.lookup_fn is not None:
        found, error = invoke(spec.lookup_fn, plan.context(step), lease=lease)
        if error is not None:
            transitions.step_defer_reconcile(lease=lease, step_name=step.step_name, error=error, spec=spec)
            return False
        if found is None:
            return _absent_or_wait(lease, spec, step)
        transitions.step_succeed(
            lease=lease,
            step_name=step.step_name,
            outcome=as_outcome(found),
            complete_run=plan.is_last(step),
            action=AuditAction.RECONCILED,
            reason="look-up by idempotency key found the remote object",
        )
        return True
    transitions.run_review(
        lease=lease, step_name=step.step_name, reason=f"{step.step_name}: outcome unknown, operator must reconcile"
    )
    return False


def _absent_or_wait(lease: Lease, spec: StepSpec, step: StepExecution) -> bool:
    """A look-up found nothing. That proves the call never took effect only once the request
    can no longer commit: its in-flight window (``spec.in_flight_bound()`` after it was sent)
    has passed. Before that the step stays unknown and is looked up again when the window ends;
    with no bound, an operator decides. Never a resend while the first request may land."""
    sent_at = step.last_attempt_at
    until = spec.in_flight_until(sent_at)
    if until is None:
        transitions.run_review(
            lease=lease,
            step_name=step.step_name,
            reason=(
                f"{step.step_name}: outcome unknown; the look-up found nothing, but the receiver may still "
                "commit the request at any time (no in-flight bound): an operator must reconcile"
            ),
        )
        return False
    if clock.now() < until:
        transitions.step_await_settle(lease=lease, step_name=step.step_name, until=until, sent_at=sent_at)
        return False
    transitions.step_reset(
        lease=lease,
        step_name=step.step_name,
        reason=(
            "look-up by idempotency key found nothing after the in-flight window closed "
            f"({until.isoformat()}): the call never took effect"
        ),
    )
    return True


def _execute(lease: Lease, plan: Plan, spec: StepSpec, step: StepExecution) -> fold.Begun | None:
    name = step.step_name
    failpoints.hit(name, "before_intent")
    ctx = plan.context(step)

    if spec.is_decision:
        accepted = ModelDecision.objects.filter(
            run_id=plan.run.pk, step_name=name, state=DecisionState.ACCEPTED
        ).first()
        if accepted is not None:
            # A restart never changes a decision: reuse the accepted one (rule 4).
            transitions.step_succeed(
                lease=lease,
                step_name=name,
                complete_run=plan.is_last(step),
                outcome=Outcome(remote_ref=f"decision v{accepted.version}", result=accepted.accepted),
                action=AuditAction.DECISION_REUSED,
                reason=f"accepted decision v{accepted.version} reused",
            )
            return

    intent, unbuilt = build_intent(plan, spec, ctx)
    if unbuilt is not None:
        transitions.step_fail(lease=lease, step_name=name, spec=spec, error=unbuilt)
        return
    if step.state != StepState.UNKNOWN and not guards.check(
        lease, plan.workflow, spec, step, replace(ctx, intent=intent), plan.steps
    ):
        return  # refused or deferred before anything was checkpointed or sent
    if step.state != StepState.UNKNOWN and transitions.approval_needed(spec, step, intent, replace(ctx, intent=intent)):
        transitions.call_hold(lease=lease, spec=spec, step_name=name, arguments=intent)
        return  # a person decides first: nothing sent
    request_hash = payload_hash(intent)
    if step.request_hash and step.request_hash != request_hash:
        # Stripe's rule: the same key with a different payload is a conflict, never a replay.
        conflict = (
            f"idempotency key {step.idempotency_key[:12]}… was already used with a different request; "
            "a changed business action needs a new key version"
        )
        if step.state == StepState.UNKNOWN:  # never relabel unknown as failed
            transitions.run_review(lease=lease, step_name=name, reason=conflict)
        else:
            transitions.step_fail(
                lease=lease,
                step_name=name,
                spec=spec,
                error=PermanentError(conflict),
                auto_compensate=plan.auto_compensate,
            )
        return

    if spec.outbox:
        # No call here: the message is committed with the step's success and the publisher
        # delivers it (publish).
        transitions.step_enqueue(lease=lease, step_name=name, intent=intent, request_hash=request_hash)
        return
    if step.attempts - step.budget_start_attempt >= spec.retry.maximum_attempts:
        # Only a worker dying mid-call again and again gets here (failures stop at the budget
        # in step_fail): a poison step goes to review instead of crashing executors forever.
        transitions.run_review(
            lease=lease, step_name=name, reason=f"{name}: {step.attempts} attempts without a recorded outcome"
        )
        return
    local = spec.local and not spec.is_decision
    # A local step's effect commits with its outcome, so its attempt can be counted in that same
    # commit: nothing happened unless it commits. Not when the previous executor of this run was
    # lost, perhaps to this very attempt: then the attempt is counted first, so that a step that
    # kills every worker meets its budget.
    counted = not local or lease.taken_over
    if counted:
        transitions.step_begin(lease=lease, step_name=name, intent=intent, request_hash=request_hash)
    if not local:
        return _call(lease, plan, spec, step, replace(ctx, intent=intent))
    attempt = None if counted else (intent, request_hash)
    error = execute_local(lease, plan, spec, step, replace(ctx, intent=intent), attempt=attempt)
    if error is None:
        return
    if not counted:  # rolled back: recorded as any failed attempt is, begun then failed
        transitions.step_begin(lease=lease, step_name=name, intent=intent, request_hash=request_hash)
    _record(lease, plan, spec, step, None, error)


def _call(lease: Lease, plan: Plan, spec: StepSpec, step: StepExecution, ctx: StepContext) -> fold.Begun | None:
    """Make the call whose intent is checkpointed and record its outcome. Returns the next
    call when its intent was written in the same commit as that outcome (``fold``)."""
    raw, error = invoke(spec.call, ctx, lease=lease, point=step.step_name, timed=plan.run.workflow_name)
    return _record(lease, plan, spec, step, raw, error)


def _record(
    lease: Lease, plan: Plan, spec: StepSpec, step: StepExecution, raw: Any, error: StepError | None
) -> fold.Begun | None:
    """Record an attempt's outcome. A success may take the next call's intent into its commit:
    then that call, begun, is returned."""
    name = step.step_name
    if error is None and spec.is_turn:
        error = _record_turn(lease, plan, spec, step, raw)
        if error is None:
            failpoints.hit(name, "after_outcome")
            return None
    decision: dict[str, Any] | None = None
    if error is None and spec.is_decision:
        try:
            # The model's output is redacted before it is validated: the accepted decision, a
            # kept invalid output and the validation error (which quotes the input) hold no secret.
            decision = validate_decision(spec, plan.workflow.redact(raw))
        except InvalidModelOutput as exc:
            error = exc

    begun = None
    if error is None:
        outcome = Outcome(remote_ref="", result=decision) if decision is not None else as_outcome(raw)
        begun = fold.succeed(lease, plan, spec, step, outcome, decision)
    elif error.kind == ErrorKind.UNKNOWN_OUTCOME:
        transitions.step_mark_unknown(lease=lease, step_name=name, error=error, spec=spec)
    else:
        transitions.step_fail(lease=lease, step_name=name, error=error, spec=spec, auto_compensate=plan.auto_compensate)
    if error is not None and (policy := plan.workflow.pause_policy(spec)) is not None:
        # A receiver that keeps failing: the step pauses itself for the whole workflow.
        transitions.workflow_pause_if_failing(
            run=plan.run, step_name=name, kind=error.kind, error=error.message[:300], policy=policy
        )
    failpoints.hit(name, "after_outcome")
    return begun
