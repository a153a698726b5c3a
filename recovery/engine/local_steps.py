"""Local steps (their effect in the engine's own database): a step's call and its outcome in
one transaction, with the local steps right after it (one commit for the group; a crash
anywhere in it leaves none made)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Any

from recovery.engine import failpoints, transitions
from recovery.engine.calls import as_outcome, invoke, working_on
from recovery.engine.plan import Plan, build_intent, load
from recovery.engine.transitions import Lease
from recovery.errors import ErrorKind, StepError, TransientError
from recovery.models import StepExecution, StepState
from recovery.workflow import StepContext, StepSpec, is_journal_name, payload_hash

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


def execute_local(
    lease: Lease,
    plan: Plan,
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

    The group's checkpoints are decided on one draft of the run and written together, as one
    write at its end (``Lease.commit``). If by then someone else has saved the run (an
    operator), or the lease is gone, that write matches nothing and the whole group rolls back:
    nothing was made, and the next transition decides on fresh rows.

    A follower's failure rolls the whole group back. The steps before it are then made again,
    in a transaction of their own, and its failure is recorded as a single local step's is
    (begun, then failed): it is not attempted a second time here."""
    group = [step, *_local_followers(lease, plan, step)] if attempt is not None else [step]
    failed: _LocalFailure | None = None
    while True:
        try:
            with lease.atomic():  # a rollback leaves the copy as it was
                _make_locals(lease, plan, spec, group, ctx, attempt)
            break
        except transitions.FenceMiss:
            return None  # nothing made; the copy is dropped, the next transition reads afresh
        except _RolledBack as rolled_back:
            failure = rolled_back.failure
            if failure.index == 0:
                return _rolled_back_error(failure.error)
            failed = replace(failure, error=_rolled_back_error(failure.error))
            names = [s.step_name for s in group[: failure.index]]
            fresh = load(lease)
            if fresh is None:
                return None  # let go meanwhile
            plan = fresh
            group = [next(s for s in plan.steps if s.step_name == name) for name in names]
    for made in group:
        failpoints.hit(made.step_name, "after_outcome")
    if failed is not None:
        _record_local_failure(lease, plan, failed)
    return None


def _local_followers(lease: Lease, plan: Plan, step: StepExecution) -> list[StepExecution]:
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
    plan: Plan,
    spec: StepSpec,
    group: list[StepExecution],
    ctx: StepContext,
    attempt: tuple[dict[str, Any], str] | None,
) -> None:
    """Make ``group``'s local steps in the caller's transaction (``spec``, ``ctx`` and ``attempt``
    are the first's), each later step's context built from the outcomes of those before it,
    their checkpoints decided on one draft and written at the end; raises _RolledBack at the
    first that fails."""
    draft = transitions.Draft.read(lease)
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
                intent, unbuilt = build_intent(plan, spec, ctx)
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
                draft=draft,
            )
            plan.steps[plan.steps.index(step)] = made  # the next steps' contexts need its outcome
    lease.commit(draft.checkpoints)


def _rolled_back_error(error: StepError) -> StepError:
    if error.kind == ErrorKind.UNKNOWN_OUTCOME:  # it was rolled back: known not to have happened
        return TransientError(f"rolled back: {error.message}", retry_after=error.retry_after)
    return error


def _record_local_failure(lease: Lease, plan: Plan, failed: _LocalFailure) -> None:
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
