"""The fault matrix: the proof of a workflow's recovery contract, generated from it.

For every step of a workflow, every failpoint boundary (a crash before the intent checkpoint,
before the call, after the call before the outcome checkpoint, after it) and every fault kind
(the receiver commits but the answer is lost, rate limited then success, a permanent error, 5xx
until the budget runs out, invalid model output), the matrix runs the workflow through that
fault, resumes it the way production would (a crashed worker's lease expires, a retry waits
for its time), and checks the invariants:

- every side effect happened at most once, and exactly once where its step succeeded;
- no step is `running` past its lease; every succeeded side-effecting step has its remote
  reference;
- the run ends completed or in an explicit review / failed / compensated state with its reason,
  never silently, and a finished run stays finished; a rate limit that lifts ends completed, and
  no case ends in an executor error (an engine or workflow bug).

A workflow author gets it in one line, in any test module (pytest-django)::

    from recovery.testing import fault_matrix

    test_orders_fault_matrix = fault_matrix("orders", event=lambda n: {"order_id": f"o-{n}"}, effects=count_effects)

where ``count_effects(run) -> {step_name: number of remote objects that step created for this
run}`` looks at the receivers (each fault is injected around the step's real call, so the
receivers really commit). Violations name the case, e.g. ``notify:commit_then_drop``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.utils import timezone

from . import clock as engine_clock
from . import failpoints
from .errors import PermanentError, RateLimited, TransientError, UnknownOutcome
from .executor import advance, publish_due
from .models import OutboxMessage, OutboxState, RunState, StepExecution, StepState, WorkflowRun
from .transitions import TERMINAL_RUN_STATES, run_start
from .workflow import Rerun, StepSpec, Workflow, get_workflow

CRASH = "crash"
FAULTS = (
    "commit_then_drop",  # the receiver commits, the answer is lost: unknown outcome
    "rate_limit_then_success",  # two 429s with Retry-After, then the real call
    "permanent",  # 403-like: stop, no retry budget spent
    "transient_until_exhausted",  # 5xx on every attempt until the step's budget runs out
)
MODEL_FAULT = "invalid_model_output"  # model steps only: schema-invalid output every time
SETTLED = frozenset(
    {
        RunState.COMPLETED,
        RunState.NEEDS_REVIEW,
        RunState.FAILED,
        RunState.COMPENSATED,
        RunState.COMPENSATION_FAILED,
        RunState.TERMINATED,
    }
)


@dataclass(frozen=True)
class Case:
    step: str
    fault: str
    boundary: str = ""

    @property
    def id(self) -> str:
        return f"{self.step}:{self.fault}" + (f"@{self.boundary}" if self.boundary else "")


class MatrixViolation(AssertionError):
    """An invariant failed in one case of the matrix; the message names the case."""


def cases(workflow: Workflow) -> list[Case]:
    """Every step × every boundary (crash) and every fault kind that applies to it."""
    out: list[Case] = []
    for spec in workflow.steps:
        out += [Case(spec.name, CRASH, point) for point in failpoints.POINTS]
        out += [Case(spec.name, fault) for fault in FAULTS]
        if spec.is_decision:
            out.append(Case(spec.name, MODEL_FAULT))
    return out


class MovableClock:
    """The engine's clock under the matrix's control: retries and lease expiry without sleeping."""

    def __init__(self) -> None:
        self.current = timezone.now()

    def now(self) -> datetime:
        return self.current

    def advance(self, seconds: float) -> None:
        self.current += timedelta(seconds=seconds)

    def set(self, when: datetime) -> None:
        self.current = max(self.current, when)


@contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


@contextmanager
def inject(spec: StepSpec, fault: str) -> Iterator[None]:
    """Wrap the step's real call with the fault. The receiver is real: "commit then drop"
    lets the call commit, then loses its answer."""
    real = spec.call
    calls = itertools.count(1)

    def faulty(ctx):
        n = next(calls)
        if fault == "commit_then_drop" and n == 1:
            real(ctx)
            raise UnknownOutcome(f"{spec.name}: the answer was lost after the receiver committed (injected)")
        if fault == "rate_limit_then_success" and n <= 2:
            raise RateLimited(f"{spec.name}: 429 (injected)", retry_after=3)
        if fault == "permanent":
            raise PermanentError(f"{spec.name}: 403 forbidden (injected)")
        if fault == "transient_until_exhausted":
            raise TransientError(f"{spec.name}: 503 (injected)")
        if fault == MODEL_FAULT:
            return '{"not": "the schema"}'
        return real(ctx)

    with _patched(spec, "call", faulty):
        yield


def drive(
    run: WorkflowRun,
    clock: MovableClock,
    *,
    max_rounds: int = 200,
    owner: str = "fault-matrix",
    must_settle: bool = False,
) -> WorkflowRun:
    """Advance the run and publish its outbox the way production would, moving the clock to
    each retry time and past each crashed worker's lease, until the run settles (with
    ``must_settle``, an AssertionError if it does not within ``max_rounds``)."""
    for _ in range(max_rounds):
        advance(run.pk, owner=owner)
        publish_due(owner=owner)
        run.refresh_from_db()
        if run.lease_owner:
            clock.advance(settings.RECOVERY_LEASE_SECONDS + 1)
        elif run.next_wake_at is not None:
            clock.set(run.next_wake_at)
        elif run.state not in (RunState.PENDING, RunState.COMPENSATING):
            return run
    if must_settle:
        raise AssertionError(f"run {run.workflow_id} did not come to rest: {run.state}")
    return run


def run_case(
    workflow: Workflow,
    case: Case,
    *,
    data: dict[str, Any],
    effects: Callable[[WorkflowRun], dict[str, int]],
    clock: MovableClock,
) -> WorkflowRun:
    """Run one case and check its invariants; raises MatrixViolation naming the case."""
    spec = workflow.get_step(case.step)
    run, _ = run_start(workflow=workflow, data=data)
    if case.fault == CRASH:
        with _patched(failpoints, "hit", _crash_once_at(case.step, case.boundary)):
            try:
                for _ in range(50):  # until the crash (or the run settles without reaching it)
                    advance(run.pk, owner="doomed-worker")
                    publish_due(owner="doomed-worker")
                    run.refresh_from_db()
                    if run.state in SETTLED:
                        break
                    if run.next_wake_at is not None:
                        clock.set(run.next_wake_at)
            except failpoints.FailpointRaised:
                pass  # the worker died here; what it committed stays
        clock.advance(settings.RECOVERY_LEASE_SECONDS + 1)
        run = drive(run, clock)
    else:
        with inject(spec, case.fault):
            run = drive(run, clock)
    check(workflow, run, effects=effects, case=case, clock=clock)
    return run


def _crash_once_at(step: str, boundary: str) -> Callable[[str, str], None]:
    fired = []

    def hit(name: str, point: str) -> None:
        if name == step and point == boundary and not fired:
            fired.append(True)
            raise failpoints.FailpointRaised(f"failpoint {step}:{boundary} (fault matrix)")

    return hit


def check(
    workflow: Workflow,
    run: WorkflowRun,
    *,
    effects: Callable[[WorkflowRun], dict[str, int]],
    case: Case,
    clock: MovableClock,
) -> None:
    problems: list[str] = []
    run.refresh_from_db()
    if run.state not in SETTLED:
        problems.append(f"the run did not settle: it is {run.state}")
    elif run.state != RunState.COMPLETED and not run.status_reason:
        problems.append(f"the run stopped in {run.state} without saying why")
    elif run.state != RunState.COMPLETED and case.fault == "rate_limit_then_success":
        problems.append(f"a step that succeeds once the rate limit lifts left the run {run.state}: {run.status_reason}")
    if run.status_reason.startswith("executor error"):  # a bug in the engine or the workflow, by definition
        problems.append(f"the executor failed: {run.status_reason}")
    steps = {s.step_name: s for s in StepExecution.objects.filter(run=run)}
    counted = effects(run)
    for spec in workflow.steps:
        step = steps[spec.name]
        if step.state == StepState.RUNNING and not (run.lease_expires_at and run.lease_expires_at > clock.now()):
            problems.append(f"{spec.name} is running past its lease")
        if spec.rerun == Rerun.YES or spec.is_decision:
            continue
        n = counted.get(spec.name, 0)
        if n > 1:
            problems.append(f"{spec.name} made {n} remote objects (a duplicate)")
        if spec.outbox:
            # Succeeded means "committed to the outbox": the effect exists once it is delivered.
            message = OutboxMessage.objects.filter(run=run, step_name=spec.name).first()
            delivered = message is not None and message.state == OutboxState.DELIVERED
            if delivered and n != 1:
                problems.append(f"{spec.name} was delivered but {n} remote objects exist")
            if message is not None and message.state == OutboxState.PENDING and run.state in SETTLED:
                problems.append(f"{spec.name}'s message is still pending in a settled run")
            if message is None and n != 0:
                problems.append(f"{spec.name} never enqueued but {n} remote object(s) exist")
            continue
        if step.state in (StepState.SUCCEEDED, StepState.COMPENSATED, StepState.COMPENSATING):
            if n != 1:
                problems.append(f"{spec.name} is {step.state} but made {n} remote objects")
            if not step.remote_ref:
                problems.append(f"{spec.name} is {step.state} without its remote reference")
        elif step.state in (StepState.PENDING, StepState.SKIPPED) and n != 0:
            problems.append(f"{spec.name} never ran but {n} remote object(s) exist")
    if run.state in TERMINAL_RUN_STATES:
        before = run.state
        if advance(run.pk, owner="fault-matrix") is not None or WorkflowRun.objects.get(pk=run.pk).state != before:
            problems.append(f"a finished run ({before}) moved without an explicit transition")
    if problems:
        raise MatrixViolation(f"[{workflow.name} {case.id}] " + "; ".join(problems))


def fault_matrix(
    workflow_name: str,
    *,
    event: Callable[[int], dict[str, Any]],
    effects: Callable[[WorkflowRun], dict[str, int]],
    fixtures: tuple[str, ...] = (),
    databases: tuple[str, ...] = ("default",),
):
    """A parametrised pytest test running the whole fault matrix of one workflow. ``event(n)``
    makes the n-th business event (a distinct business key per case); ``fixtures`` names
    pytest fixtures the receivers need (a live server, say)."""
    import pytest

    workflow = get_workflow(workflow_name)
    numbered = list(enumerate(cases(workflow)))

    @pytest.mark.django_db(transaction=True, databases=list(databases))
    @pytest.mark.parametrize("numbered_case", numbered, ids=[case.id for _, case in numbered])
    def test_fault_matrix(numbered_case, request, monkeypatch):
        for name in fixtures:
            request.getfixturevalue(name)
        monkeypatch.delenv("RECOVERY_FAILPOINTS", raising=False)
        clock = MovableClock()
        monkeypatch.setattr(engine_clock, "now", clock.now)
        n, case = numbered_case
        run_case(workflow, case, data=event(n), effects=effects, clock=clock)

    test_fault_matrix.__doc__ = f"The fault matrix of {workflow_name}: every step × boundary × fault kind."
    return test_fault_matrix


__all__ = ["Case", "MatrixViolation", "MovableClock", "cases", "check", "drive", "fault_matrix", "inject", "run_case"]
