"""The executor: claims a run with a lease and advances it step by step.

For each step: checkpoint the intent (commit), call, checkpoint the outcome (commit). No
database lock is held across a remote call. A local step (its effect in this database) commits
its effect, attempt and outcome at once, together with the local steps right after it. A step
found ``running`` when a run is taken over has an unknown outcome and is reconciled before
anything else is written.

The same ``advance`` runs in-process (``run_executor``) and inside a Celery task.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.db import InterfaceError, OperationalError, connection, transaction

from recovery import clock
from recovery.engine import agent, failpoints, guards, transitions
from recovery.engine.calls import as_outcome, database_unavailable, invoke, validate_decision, working_on
from recovery.engine.publisher import publish_due
from recovery.engine.transitions import DONE_STEP_STATES, Lease
from recovery.errors import (
    DatabaseUnavailable,
    ErrorKind,
    InvalidModelOutput,
    LeaseLost,
    PermanentError,
    StepError,
    TransientError,
    UnknownOutcome,
    classify,
)
from recovery.models import (
    DecisionState,
    ModelDecision,
    OutboxMessage,
    OutboxState,
    RunState,
    StepExecution,
    StepState,
    WorkflowRun,
)
from recovery.redaction import redact_text
from recovery.workflow import (
    CompensationPolicy,
    Outcome,
    Reconcile,
    StepContext,
    StepSpec,
    Workflow,
    compensation_key,
    is_journal_name,
    journal_rows,
    parse_journal_name,
    payload_hash,
    workflow_of,
)

log = logging.getLogger("recovery.executor")

MAX_TRANSITIONS_PER_CLAIM = 200


@dataclass
class _Plan:
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
        )
        if not is_journal_name(step.step_name) or not agent.is_turn(step):
            return base
        spec = self.workflow.get_step(step.step_name)
        assert spec.agent is not None
        entry = parse_journal_name(step.step_name)
        return agent.context(spec.agent, base, journal_rows(entry.agent, self.steps), entry.turn)

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


def advance(run_pk: int, *, owner: str | None = None) -> str | None:
    """Advance one run as far as it can go now. Returns the run's state when this executor
    let go of it, or None if the run was not claimable (someone else holds it, or it is not
    due, or it is finished)."""
    try:
        lease = transitions.run_claim(run_pk=run_pk, owner=owner)
    except (OperationalError, InterfaceError) as exc:
        raise database_unavailable(exc, f"run {run_pk}") from exc
    return None if lease is None else _advance_claimed(lease)


def start_and_advance(
    *, workflow: str, data: Any, owner: str | None = None, actor: AbstractBaseUser | str | None = None
) -> tuple[WorkflowRun, str | None]:
    """Start the event's run and advance it here at once, as far as it can go now: the run is
    written already claimed by this executor (``transitions.run_start_claimed``), so no claim
    follows. Returns the run and its state when this executor let go of it. A repeated event
    gives its run as it is, with None: it is not advanced here (whoever holds it, or claims it
    when it is due, does)."""
    try:
        run, lease = transitions.run_start_claimed(workflow=workflow, data=data, owner=owner, actor=actor)
    except (OperationalError, InterfaceError) as exc:
        raise database_unavailable(exc, f"the start of a {workflow} run") from exc
    return run, None if lease is None else _advance_claimed(lease)


def _advance_claimed(lease: Lease) -> str | None:
    run = lease.seen["run"]  # the claim's own copy
    with working_on("advance run", run, parent=run.traceparent or "", lease_generation=lease.generation):
        return _advance_bound(lease)


def _advance_bound(lease: Lease) -> str | None:
    try:
        for _ in range(MAX_TRANSITIONS_PER_CLAIM):
            plan = _load(lease)
            if plan is None:
                break
            if not _step_once(lease, plan):
                break
        else:
            transitions.run_release(lease=lease, reason="transition limit per claim reached; due again")
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


def _load(lease: Lease) -> _Plan | None:
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
    return _Plan(run=run, workflow=workflow, steps=steps)


def _step_once(lease: Lease, plan: _Plan) -> bool:
    """Make one transition. Returns False when this executor should let go of the run."""
    if plan.run.state == RunState.COMPENSATING:
        return _compensate_once(lease, plan)
    step = plan.next_step()
    if step is None:
        return _finish(lease, plan)
    name = step.step_name
    with working_on(f"step {name}", plan.run, step=name, attempt=step.attempts, key=step.idempotency_key):
        return _step(lease, plan, step)


def _step(lease: Lease, plan: _Plan, step: StepExecution) -> bool:
    spec = plan.workflow.get_step(step.step_name)
    if spec.is_agent:
        return _agent(lease, plan, spec, step)
    now = clock.now()

    if step.state == StepState.RUNNING:
        # Its previous owner lost the lease mid-call: the call may or may not have happened.
        transitions.step_mark_unknown(
            lease=lease,
            step_name=step.step_name,
            spec=spec,
            error=UnknownOutcome("the executor running this step was lost before recording its outcome"),
        )
        return True

    if step.next_attempt_at is not None and step.next_attempt_at > now:
        transitions.run_wait(lease=lease, wake_at=step.next_attempt_at, reason=f"{step.step_name}: not due yet")
        return False

    if step.state == StepState.UNKNOWN:
        return _reconcile(lease, plan, spec, step)

    _execute(lease, plan, spec, step)
    return True


def _agent(lease: Lease, plan: _Plan, spec: StepSpec, step: StepExecution) -> bool:
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
    policy, turns = spec.agent, agent.turns(rows)
    asked = sum(1 for turn in turns if turn.state != StepState.SKIPPED)  # a fork's left-out turns are not counted
    invalid = agent.invalid_calls(rows)
    if invalid > policy.argument_errors:
        transitions.run_review(
            lease=lease,
            step_name=spec.name,
            reason=f"{spec.name}: the model asked for {invalid} tool call(s) with invalid arguments "
            f"(budget {policy.argument_errors})",
        )
        return False
    if asked >= policy.max_turns:
        transitions.run_review(
            lease=lease, step_name=spec.name, reason=f"{spec.name}: no final answer after {asked} model turn(s)"
        )
        return False
    after = max((parse_journal_name(turn.step_name).turn for turn in turns), default=0)
    transitions.agent_turn_add(lease=lease, agent=spec.name, turn=after + 1, key_version=step.key_version)
    return True


def _record_turn(lease: Lease, plan: _Plan, spec: StepSpec, step: StepExecution, raw: Any) -> StepError | None:
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


def _finish(lease: Lease, plan: _Plan) -> bool:
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


def _reconcile(lease: Lease, plan: _Plan, spec: StepSpec, step: StepExecution) -> bool:
    """Resolve an unknown outcome before anything else is written (rule 7)."""
    if spec.reconcile in (Reconcile.RERUN, Reconcile.RESEND):
        # Safe by declaration: re-running has no double effect, or the receiver keeps its
        # first result for this key and replays it.
        _execute(lease, plan, spec, step)
        return True
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
            action="reconciled",
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


def _execute(lease: Lease, plan: _Plan, spec: StepSpec, step: StepExecution) -> None:
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
                action="decision_reused",
                reason=f"accepted decision v{accepted.version} reused",
            )
            return

    intent, unbuilt = _intent(plan, spec, ctx)
    if unbuilt is not None:
        transitions.step_fail(lease=lease, step_name=name, spec=spec, error=unbuilt)
        return
    if step.state != StepState.UNKNOWN and not guards.check(
        lease, plan.workflow, spec, step, replace(ctx, intent=intent), plan.steps
    ):
        return  # refused or deferred before anything was checkpointed or sent
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
    if local:
        attempt = None if counted else (intent, request_hash)
        error = _execute_local(lease, plan, spec, step, replace(ctx, intent=intent), attempt=attempt)
        if error is None:
            return
        if not counted:  # rolled back: recorded as any failed attempt is, begun then failed
            transitions.step_begin(lease=lease, step_name=name, intent=intent, request_hash=request_hash)
        raw = None
    else:
        raw, error = invoke(
            spec.call, replace(ctx, intent=intent), lease=lease, point=name, timed=plan.run.workflow_name
        )

    if error is None and spec.is_turn:
        error = _record_turn(lease, plan, spec, step, raw)
        if error is None:
            failpoints.hit(name, "after_outcome")
            return
    decision: dict[str, Any] | None = None
    if error is None and spec.is_decision:
        try:
            # The model's output is redacted before it is validated: the accepted decision, a
            # kept invalid output and the validation error (which quotes the input) hold no secret.
            decision = validate_decision(spec, plan.workflow.redact(raw))
        except InvalidModelOutput as exc:
            error = exc

    if error is None:
        outcome = Outcome(remote_ref="", result=decision) if decision is not None else as_outcome(raw)
        transitions.step_succeed(
            lease=lease,
            step_name=name,
            outcome=outcome,
            complete_run=plan.is_last(step),
            decision=decision,
            spec=spec,
        )
    elif error.kind == ErrorKind.UNKNOWN_OUTCOME:
        transitions.step_mark_unknown(lease=lease, step_name=name, error=error, spec=spec)
    else:
        transitions.step_fail(lease=lease, step_name=name, error=error, spec=spec, auto_compensate=plan.auto_compensate)
    failpoints.hit(name, "after_outcome")


def _intent(plan: _Plan, spec: StepSpec, ctx: StepContext) -> tuple[dict[str, Any], StepError | None]:
    """The step's intent, or why it could not be built (a permanent error: nothing was sent).
    What is persisted is what is replayed: the intent is redacted before it is hashed,
    checkpointed and sent, so an attempt after a crash sends exactly what this one does."""
    try:
        return plan.workflow.redact(spec.intent_fn(ctx) if spec.intent_fn else {}), None
    except Exception as exc:
        return {}, PermanentError(f"could not build the step's intent: {classify(exc)}")


MAX_LOCAL_GROUP = 16  # local steps made in one transaction at most


@dataclass
class _LocalFailure:
    """A local attempt that failed inside a group of local steps, and so was rolled back."""

    index: int  # in the group: 0 is the step the group began with
    step_name: str
    error: StepError
    attempt: tuple[dict[str, Any], str] | None  # (intent, request hash); None if no intent could be built


class _RolledBack(Exception):
    def __init__(self, failure: _LocalFailure):
        self.failure = failure


def _execute_local(
    lease: Lease,
    plan: _Plan,
    spec: StepSpec,
    step: StepExecution,
    ctx: StepContext,
    *,
    attempt: tuple[dict[str, Any], str] | None,
) -> StepError | None:
    """A local step: its call and its outcome in one transaction (with ``attempt``, the
    attempt's count too), and with it the local steps right after it that may share that
    transaction (``_local_followers``): one commit for them all, so a crash anywhere among them
    leaves none made. Returns the error of an attempt of ``step`` that failed — rolled back, so
    it certainly left nothing (never an unknown outcome).

    The group's checkpoints are written together, as one statement at its end
    (``transitions.one_write``). If by then someone else has saved the run (an operator), or
    the lease is gone, that statement matches nothing and the whole group rolls back: nothing
    was made, and the next transition decides on fresh rows.

    A follower's failure rolls the whole group back. The steps before it are then made again,
    in a transaction of their own, and its failure is recorded as a single local step's is
    (begun, then failed): it is not attempted a second time here."""
    group = [step, *_local_followers(lease, plan, step)] if attempt is not None else [step]
    failed: _LocalFailure | None = None
    while True:
        try:
            with transaction.atomic(), transitions.one_write(lease) if len(group) > 1 else contextlib.nullcontext():
                _make_locals(lease, plan, spec, group, ctx, attempt)
            break
        except transitions.StaleCopy:
            return None  # nothing made; StaleCopy dropped the copy, the next transition reads afresh
        except _RolledBack as rolled_back:
            lease.seen.clear()  # the copy holds outcomes that were rolled back
            failure = rolled_back.failure
            if failure.index == 0:
                return _rolled_back_error(failure.error)
            failed = replace(failure, error=_rolled_back_error(failure.error))
            names = [s.step_name for s in group[: failure.index]]
            fresh = _load(lease)
            if fresh is None:
                return None  # let go meanwhile
            plan = fresh
            group = [next(s for s in plan.steps if s.step_name == name) for name in names]
        except BaseException:
            lease.seen.clear()  # the outcome may have been recorded in the copy and rolled back
            raise
    for made in group:
        failpoints.hit(made.step_name, "after_outcome")
    if failed is not None:
        _record_local_failure(lease, plan, failed)
    return None


def _local_followers(lease: Lease, plan: _Plan, step: StepExecution) -> list[StepExecution]:
    """The local steps right after ``step`` that can be made in its transaction: pending, never
    attempted, due, with nothing to check or decide before they run (no guard, no model, no
    outbox, no agent). None after a takeover: that executor counts each attempt first."""
    if lease.taken_over:
        return []
    followers: list[StepExecution] = []
    for later in plan.steps[plan.steps.index(step) + 1 :]:
        if len(followers) + 1 >= MAX_LOCAL_GROUP or is_journal_name(later.step_name):
            break
        spec = plan.workflow.get_step(later.step_name)
        fresh = later.state == StepState.PENDING and not (later.attempts or later.next_attempt_at or later.refusal)
        plain = spec.local and not (spec.asks_model or spec.outbox or plan.workflow.guards_for(spec))
        if not (fresh and plain):
            break
        followers.append(later)
    return followers


def _make_locals(
    lease: Lease,
    plan: _Plan,
    spec: StepSpec,
    group: list[StepExecution],
    ctx: StepContext,
    attempt: tuple[dict[str, Any], str] | None,
) -> None:
    """Make ``group``'s local steps in the caller's transaction (``spec``, ``ctx`` and ``attempt``
    are the first's), each later step's context built from the outcomes of those before it;
    raises _RolledBack at the first that fails."""
    for index, step in enumerate(group):
        name = step.step_name
        with (
            working_on(f"step {name}", plan.run, step=name, attempt=step.attempts, key=step.idempotency_key)
            if index
            else contextlib.nullcontext()  # the first is in its caller's
        ):
            if index:
                spec = plan.workflow.get_step(name)
                failpoints.hit(name, "before_intent")
                ctx = plan.context(step)
                intent, unbuilt = _intent(plan, spec, ctx)
                if unbuilt is not None:
                    raise _RolledBack(_LocalFailure(index, name, unbuilt, None))
                ctx, attempt = replace(ctx, intent=intent), (intent, payload_hash(intent))
            raw, error = invoke(spec.call, ctx, point=name, timed=plan.run.workflow_name)
            if error is not None:
                raise _RolledBack(_LocalFailure(index, name, error, attempt))
            made = transitions.step_succeed(
                lease=lease,
                step_name=name,
                outcome=as_outcome(raw),
                complete_run=plan.is_last(step),
                spec=spec,
                attempt=attempt,
            )
            if made is not step:  # read again under the lock: the next steps' contexts need its outcome
                plan.steps[plan.steps.index(step)] = made


def _rolled_back_error(error: StepError) -> StepError:
    if error.kind == ErrorKind.UNKNOWN_OUTCOME:  # it was rolled back: known not to have happened
        return TransientError(f"rolled back: {error.message}", retry_after=error.retry_after)
    return error


def _record_local_failure(lease: Lease, plan: _Plan, failed: _LocalFailure) -> None:
    """Record a follower's failed attempt, rolled back with its group, as any failed local
    attempt is: begun (when its intent could be built), then failed."""
    name = failed.step_name
    if failed.attempt is not None:
        intent, request_hash = failed.attempt
        transitions.step_begin(lease=lease, step_name=name, intent=intent, request_hash=request_hash)
    spec = plan.workflow.get_step(name)
    transitions.step_fail(
        lease=lease, step_name=name, error=failed.error, spec=spec, auto_compensate=plan.auto_compensate
    )
    failpoints.hit(name, "after_outcome")


def _compensate_once(lease: Lease, plan: _Plan) -> bool:
    """Undo the next marked step, latest first (reverse dependency order)."""
    marked = sorted((s for s in plan.steps if s.state == StepState.COMPENSATING), key=lambda s: s.order, reverse=True)
    if not marked:
        transitions.run_compensation_done(lease=lease)
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
    ctx = StepContext(
        workflow_id=plan.run.workflow_id,
        input=plan.run.input,
        step=step.step_name,
        idempotency_key=compensation_key(plan.run.workflow_id, step.step_name, step.key_version),
        results={s.step_name: s.result for s in plan.steps if s.result is not None},
        intent={"remote_ref": remote_ref, "result": step.result, "intent": step.intent},
    )
    transitions.compensation_begin(lease=lease, step_name=step.step_name)
    raw, error = invoke(spec.compensation_fn, ctx, lease=lease, point=f"{step.step_name}.compensate")
    if error is None:
        transitions.compensation_succeed(lease=lease, step_name=step.step_name, outcome=as_outcome(raw))
        return True
    transitions.compensation_fail(lease=lease, step_name=step.step_name, error=error, spec=spec)
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


def _undeliver(lease: Lease, plan: _Plan, spec: StepSpec, step: StepExecution) -> str | None:
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


# --- the embedded executor loop --------------------------------------------------------


def run_due(*, owner: str | None = None, limit: int = 100) -> int:
    """Advance runs due now, the oldest first, up to ``limit``; executors running this side
    by side take different runs. Returns how many runs this executor advanced."""
    advanced = 0
    while advanced < limit:
        lease = transitions.run_claim_next(owner=owner)
        if lease is None:
            break
        _advance_claimed(lease)
        advanced += 1
    return advanced


BEAT_SECONDS = 5.0  # how often the embedded executor's loop records that it is sweeping


def run_forever(
    *,
    until_idle: bool = False,
    poll_seconds: float = 1.0,
    owner: str | None = None,
    on_beat: Callable[[], object] | None = None,
) -> int:
    """The embedded executor: advance due runs and publish due outbox messages until stopped
    (or, with ``until_idle``, until nothing is due now). Returns the number of runs advanced
    and messages attempted. Every BEAT_SECONDS it records that a sweeper is alive and calls
    ``on_beat`` (``run_executor`` sweeps the alerts there)."""
    total = 0
    outage = 0  # consecutive rounds the database could not be reached
    beat_due = 0.0  # time.monotonic() of this loop's next sweeper beat (what /readyz reads)
    while True:
        try:
            if time.monotonic() >= beat_due:
                transitions.sweeper_beat(name="embedded executor", by=owner)
                if on_beat is not None:
                    on_beat()  # run_executor: the alerts' sweep
                beat_due = time.monotonic() + BEAT_SECONDS
            advanced = run_due(owner=owner) + publish_due(owner=owner)
        except (DatabaseUnavailable, OperationalError, InterfaceError) as exc:
            # A blip, not a reason to stop: back off (1, 2, 4 … 30 s) and try again; the runs
            # this executor let go of are claimed again once their leases expire.
            connection.close()
            outage += 1
            if until_idle and outage > 5:
                raise
            delay = min(30.0, 2.0 ** (outage - 1))
            log.warning("%s; trying again in %.0f s", exc, delay)
            time.sleep(delay)
            continue
        outage = 0
        total += advanced
        if advanced:
            continue
        if until_idle:
            return total
        time.sleep(poll_seconds)
