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
  no case ends in an executor error (an engine or workflow bug);
- no executor takes a run over while another's call is in flight and its heartbeat beats;
- an agent step asks no journaled turn again: no two of its turns ask with the same conversation.

For every step with an external effect (the outbox publisher included) it also arms the faults
of receivers that answer late or not at all, built from how they fail in production rather than
from what the engine handles:

- a late commit: the caller gives up (unknown outcome) and the receiver commits the request
  later, below or exactly at the step's in-flight bound; beyond the bound, a receiver that keeps
  its bound abandons the request (the engine must then perform the step again: once, not never);
- a crash while the call is in flight, its request committing late, then a takeover;
- a call that outlives its lease (its heartbeat could not reach the database) while another
  executor takes the run over, and a slow call or look-up under a working heartbeat;
- a look-up that fails before it answers;
- with ``compensations=`` (a count of what each compensation made, per step): a completed run is
  compensated by an operator, and each compensation's request commits late (below, at or beyond
  the bound) or its executor dies while it is in flight. At most one compensation object per step.
  (The late commit replays the compensation call as a whole, its own look-ups included: a
  compensation that looks before it sends needs its receiver to commit the request itself late,
  as tests/support/receivers.py's ``late_commit`` does.)

A workflow author gets it in one line, in any test module (pytest-django)::

    from recovery.testing import fault_matrix

    test_orders_fault_matrix = fault_matrix("orders", event=lambda n: {"order_id": f"o-{n}"}, effects=count_effects)

where ``count_effects(run) -> {step_name: number of remote objects that step created for this
run}`` looks at the receivers (each fault is injected around the step's real call, so the
receivers really commit). Violations name the case, e.g. ``notify:commit_then_drop``.
"""

from __future__ import annotations

import fnmatch
import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.utils import timezone

from recovery import clock as engine_clock
from recovery.engine import failpoints
from recovery.engine import heartbeat as engine_heartbeat
from recovery.engine.executor import advance
from recovery.engine.publisher import publish_due
from recovery.engine.transitions import TERMINAL_RUN_STATES, run_compensate, run_start, waits_for_event
from recovery.errors import PermanentError, RateLimited, TransientError, UnknownOutcome
from recovery.models import OutboxMessage, OutboxState, RunState, StepExecution, StepState, WorkflowRun
from recovery.replay import Replayed, assert_replayable, load_recorded, replay  # noqa: F401  (replay before deploy)
from recovery.workflow import JOURNAL_SEPARATOR, Rerun, StepSpec, Workflow, get_workflow, is_journal_name, turn_name

CRASH = "crash"
FAULTS = (
    "commit_then_drop",  # the receiver commits, the answer is lost: unknown outcome
    "rate_limit_then_success",  # two 429s with Retry-After, then the real call
    "permanent",  # 403-like: stop, no retry budget spent
    "transient_until_exhausted",  # 5xx on every attempt until the step's budget runs out
)
MODEL_FAULT = "invalid_model_output"  # model steps only: schema-invalid output every time
# Steps with an external effect (and a call the engine makes): receivers that answer late or never.
LATE_COMMIT = "late_commit"  # boundary below / at / beyond the in-flight bound
LATE_BOUNDARIES = ("below", "at", "beyond")
IN_FLIGHT_FAULTS = (
    "crash_in_flight",  # the worker dies while its request is in flight; the request commits late
    "outlives_lease",  # no heartbeat reaches the database: the lease expires mid-call, a rival takes over
    "slow_call",  # a call longer than the lease under a working heartbeat: nobody may take over
)
LOOKUP_FAULTS = (
    "lookup_fails",  # the answer is lost, then the first look-up fails (503) before it answers
    "lookup_slow",  # the answer is lost, then the look-up outlasts the lease (the heartbeat beats)
)
COMPENSATION_LATE = "compensation_late_commit"  # boundary below / at / beyond
COMPENSATION_CRASH = "compensation_crash_in_flight"
# How long the receiver takes to commit a late request when the step has no bound (None).
UNBOUNDED_LATE_SECONDS = 3600.0
SETTLED = frozenset(
    {
        RunState.COMPLETED,
        RunState.NEEDS_REVIEW,
        RunState.FAILED,
        RunState.COMPENSATED,
        RunState.COMPENSATION_FAILED,
        RunState.TERMINATED,
        RunState.PAUSED,  # a step that paused itself (pause_after): a person releases it
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


def has_remote_effect(spec: StepSpec) -> bool:
    """A step whose call writes to another system: not safe to re-run, not a model call, not local."""
    return spec.rerun != Rerun.YES and not spec.is_decision and not spec.local


def cases(workflow: Workflow, *, compensations: bool = False) -> list[Case]:
    """Every step × every boundary (crash) and every fault kind that applies to it (with
    ``compensations``, the faults of every compensation too). An agent step's cases are those
    of each of its model turns (a crash at every boundary of turn 1 … ``max_turns``) and of each
    of its tools, whose case names its calls with a pattern (``agent:*:*:tool``): a crash hits
    the first call of the tool, a fault every call of it."""
    out: list[Case] = []
    for spec in workflow.steps:
        if spec.is_agent:
            assert spec.agent is not None
            for turn in range(1, spec.agent.max_turns + 1):
                out += [Case(turn_name(spec.name, turn), CRASH, point) for point in failpoints.POINTS]
            out += _cases_of(spec.name, spec, compensations)
            for tool in spec.agent.tools.values():
                out += _cases_of(JOURNAL_SEPARATOR.join((spec.name, "*", "*", tool.tool_name)), tool, compensations)
            continue
        out += _cases_of(spec.name, spec, compensations)
    return out


def _cases_of(name: str, spec: StepSpec, compensations: bool) -> list[Case]:
    if spec.is_wait:  # it calls nothing: no fault to inject; a crash once its outcome is recorded
        return [Case(name, CRASH, "after_outcome")]
    out = [] if spec.is_agent else [Case(name, CRASH, point) for point in failpoints.POINTS]
    out += [Case(name, fault) for fault in FAULTS]
    if spec.asks_model:
        out.append(Case(name, MODEL_FAULT))
    elif has_remote_effect(spec):
        out += [Case(name, LATE_COMMIT, where) for where in LATE_BOUNDARIES]
        out += [Case(name, fault) for fault in IN_FLIGHT_FAULTS]
        if spec.lookup_fn is not None:
            out += [Case(name, fault) for fault in LOOKUP_FAULTS]
    if compensations and spec.compensation_fn is not None:
        out += [Case(name, COMPENSATION_LATE, where) for where in LATE_BOUNDARIES]
        out.append(Case(name, COMPENSATION_CRASH))
    return out


def _spec_of(workflow: Workflow, name: str) -> StepSpec:
    """The declaration a case faults: a step, or (``agent:*:*:tool``) an agent's tool."""
    if "*" not in name:
        return workflow.get_step(name)
    agent, *_, tool = name.split(JOURNAL_SEPARATOR)
    policy = workflow.get_step(agent).agent
    assert policy is not None
    return policy.tools[tool]


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


@dataclass
class Receivers:
    """The world outside the engine during one case, on the engine's clock: requests that a
    receiver commits after its caller gave up, and rival executors that try to take a run over
    while a call is in flight."""

    clock: MovableClock
    run_pk: int | None = None
    late: list[tuple[datetime, Callable[[], Any]]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def commit_later(self, delay: timedelta, perform: Callable[[], Any]) -> None:
        self.late.append((self.clock.now() + delay, perform))

    def settle(self, *, everything: bool = False) -> None:
        """Commit each late request whose time has come (with ``everything``, all of them: the
        receiver finishes its work whatever the caller does meanwhile)."""
        now = self.clock.now()
        due = [item for item in self.late if everything or item[0] <= now]
        self.late = [item for item in self.late if item not in due]
        for _, perform in due:
            try:
                perform()
            except Exception:  # noqa: BLE001 - what the receiver answers, nobody hears any more
                pass

    def outlast_lease(self, what: str, *, heartbeat: bool) -> None:
        """The call in flight lasts well past the lease: the clock moves on (the heartbeat, if
        it reaches the database, beats as it would meanwhile), then a rival executor and a rival
        publisher try to take the work over. With a working heartbeat, neither may."""
        generations = self._generations()
        for _ in range(7):  # 7/3 of a lease
            self.clock.advance(settings.RECOVERY_LEASE_SECONDS / 3)
            if heartbeat:
                engine_heartbeat.beat(force=True)  # as the heartbeat thread would, meanwhile
        if self.run_pk is not None:
            advance(self.run_pk, owner="rival-executor")
        publish_due(owner="rival-publisher")
        if heartbeat and self._taken(generations):
            self.problems.append(f"another executor took over while {what} was in flight under a working heartbeat")

    def _generations(self) -> dict[str, int]:
        """The generation of each lease and claim held right now (a rival may take what nobody holds)."""
        held = {}
        run = WorkflowRun.objects.filter(pk=self.run_pk).values("lease_owner", "lease_generation").first()
        if run and run["lease_owner"]:
            held["run"] = run["lease_generation"]
        claims = OutboxMessage.objects.filter(run_id=self.run_pk).exclude(claimed_by="")
        for pk, generation in claims.values_list("pk", "claim_generation"):
            held[f"outbox {pk}"] = generation
        return held

    def _taken(self, held: dict[str, int]) -> bool:
        now = self._generations()
        return any(now.get(what) != generation for what, generation in held.items())


def _late_delay(spec: StepSpec, where: str) -> timedelta | None:
    """When the receiver commits a late request: half the bound, exactly at it, or (beyond it)
    never, as a receiver that keeps its declared bound abandons the request. A step without a
    bound waits for a commit that may come at any time."""
    bound = spec.in_flight_bound()
    if bound is None:
        return timedelta(seconds=UNBOUNDED_LATE_SECONDS)
    return {"below": bound / 2, "at": bound, "beyond": None}[where]


@contextmanager
def inject(spec: StepSpec, fault: str, boundary: str = "", *, receivers: Receivers | None = None) -> Iterator[None]:
    """Wrap the step's real call (and its look-up) with the fault. The receiver is real:
    "commit then drop" lets the call commit, then loses its answer; a late commit makes the
    real call later, on the engine's clock (``receivers``)."""
    real, real_lookup = spec.call, spec.lookup_fn
    calls, lookups = itertools.count(1), itertools.count(1)
    world = receivers or Receivers(clock=MovableClock())

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
        if fault in (LATE_COMMIT, "crash_in_flight") and n == 1:
            delay = _late_delay(spec, boundary or "below")
            if delay is not None:
                world.commit_later(delay, lambda: real(ctx))
            if fault == "crash_in_flight":
                raise failpoints.FailpointRaised(f"{spec.name}: the worker died with its request in flight (injected)")
            raise UnknownOutcome(f"{spec.name}: timed out; the receiver is still working on the request (injected)")
        if fault in ("outlives_lease", "slow_call") and n == 1:
            world.outlast_lease(f"{spec.name}'s call", heartbeat=fault == "slow_call")
        if fault in LOOKUP_FAULTS and n == 1:
            real(ctx)
            raise UnknownOutcome(f"{spec.name}: the answer was lost after the receiver committed (injected)")
        return real(ctx)

    def faulty_lookup(ctx):
        n = next(lookups)
        if fault == "lookup_fails" and n == 1:
            raise TransientError(f"{spec.name}: look-up answered 503 (injected)")
        if fault == "lookup_slow" and n == 1:
            world.outlast_lease(f"{spec.name}'s look-up", heartbeat=True)
        return real_lookup(ctx)

    real_compensation = spec.compensation_fn
    compensating = itertools.count(1)

    def faulty_compensation(ctx):
        if fault in (COMPENSATION_LATE, COMPENSATION_CRASH) and next(compensating) == 1:
            delay = _late_delay(spec, boundary or "below")
            if delay is not None:
                world.commit_later(delay, lambda: real_compensation(ctx))
            if fault == COMPENSATION_CRASH:
                raise failpoints.FailpointRaised(f"{spec.name}: died with its compensation in flight (injected)")
            raise UnknownOutcome(f"{spec.name}: the compensation timed out; the receiver is still on it (injected)")
        return real_compensation(ctx)

    with (
        _patched(spec, "call", faulty),
        _patched(spec, "lookup_fn", faulty_lookup if real_lookup else None),
        _patched(spec, "compensation_fn", faulty_compensation if real_compensation else None),
    ):
        yield


def drive(
    run: WorkflowRun,
    clock: MovableClock,
    *,
    max_rounds: int = 200,
    owner: str = "fault-matrix",
    must_settle: bool = False,
    receivers: Receivers | None = None,
) -> WorkflowRun:
    """Advance the run and publish its outbox the way production would, moving the clock to
    each retry time and past each crashed worker's lease, until the run settles (with
    ``must_settle``, an AssertionError if it does not within ``max_rounds``). With
    ``receivers``, late requests commit as the clock reaches their time; a worker that dies
    (an injected crash) leaves its lease to expire, as a real one would."""
    for _ in range(max_rounds):
        if receivers is not None:
            receivers.settle()
        try:
            advance(run.pk, owner=owner)
            publish_due(owner=owner)
        except failpoints.FailpointRaised:
            if receivers is None:
                raise
        run.refresh_from_db()
        if run.state == RunState.PAUSED:  # at rest until unpaused, whatever timer it keeps
            return run
        if run.state == RunState.WAITING and waits_for_event(run):  # at rest until its event comes
            return run
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
    compensations: Callable[[WorkflowRun], dict[str, int]] | None = None,
) -> WorkflowRun:
    """Run one case and check its invariants; raises MatrixViolation naming the case."""
    spec = _spec_of(workflow, case.step)
    run, _ = run_start(workflow=workflow, data=data)
    if case.fault in (COMPENSATION_LATE, COMPENSATION_CRASH):
        assert compensations is not None, "compensation cases need compensations="
        return _compensation_case(workflow, case, run, effects, compensations, clock)
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
        receivers = Receivers(clock=clock, run_pk=run.pk)
        with inject(spec, case.fault, case.boundary, receivers=receivers):
            run = drive(run, clock, receivers=receivers)
        receivers.settle(everything=True)  # late requests land whatever the run did meanwhile
        if receivers.problems:
            raise MatrixViolation(f"[{workflow.name} {case.id}] " + "; ".join(receivers.problems))
    check(workflow, run, effects=effects, case=case, clock=clock)
    return run


def _compensation_case(
    workflow: Workflow,
    case: Case,
    run: WorkflowRun,
    effects: Callable[[WorkflowRun], dict[str, int]],
    compensations: Callable[[WorkflowRun], dict[str, int]],
    clock: MovableClock,
) -> WorkflowRun:
    """Complete the run, have an operator compensate it, and fault the compensation of
    ``case.step``: at most one compensation object per step, and the run says how it ended."""
    run = drive(run, clock, must_settle=True)
    if run.state != RunState.COMPLETED:
        raise MatrixViolation(f"[{workflow.name} {case.id}] the run did not complete before compensating: {run.state}")
    run_compensate(workflow_id=run.workflow_id, actor=None, reason=f"fault matrix {case.id}")
    receivers = Receivers(clock=clock, run_pk=run.pk)
    with inject(_spec_of(workflow, case.step), case.fault, case.boundary, receivers=receivers):
        run = drive(run, clock, receivers=receivers)
    receivers.settle(everything=True)
    problems: list[str] = []
    run.refresh_from_db()
    if run.state not in (RunState.COMPENSATED, RunState.COMPENSATION_FAILED, RunState.NEEDS_REVIEW):
        problems.append(f"the compensated run ended {run.state}: {run.status_reason}")
    if run.status_reason.startswith("executor error"):
        problems.append(f"the executor failed: {run.status_reason}")
    made = compensations(run)
    for step in StepExecution.objects.filter(run=run):
        n = made.get(step.step_name, 0)
        if n > 1:
            problems.append(f"{step.step_name}'s compensation made {n} remote objects (a duplicate)")
        if (
            step.state == StepState.COMPENSATED
            and n != 1
            and not (step.compensation_result or {}).get("cancelled_before_delivery")
        ):
            problems.append(f"{step.step_name} is compensated but its compensation made {n} remote objects")
    for name, n in effects(run).items():
        if n > 1:
            problems.append(f"{name} made {n} remote objects (a duplicate)")
    if problems:
        raise MatrixViolation(f"[{workflow.name} {case.id}] " + "; ".join(problems))
    return run


def _crash_once_at(step: str, boundary: str) -> Callable[[str, str], None]:
    fired = []

    def hit(name: str, point: str) -> None:
        if fnmatch.fnmatchcase(name, step) and point == boundary and not fired:
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
    calls = [workflow.get_step(name) for name in steps if is_journal_name(name)]  # an agent's turns and calls
    for spec in [*workflow.steps, *calls]:
        step = steps[spec.name]
        if step.state == StepState.RUNNING and not (run.lease_expires_at and run.lease_expires_at > clock.now()):
            problems.append(f"{spec.name} is running past its lease")
        if spec.rerun == Rerun.YES or spec.asks_model:
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
    problems += _asked_again(calls, steps)
    if run.state in TERMINAL_RUN_STATES:
        before = run.state
        if advance(run.pk, owner="fault-matrix") is not None or WorkflowRun.objects.get(pk=run.pk).state != before:
            problems.append(f"a finished run ({before}) moved without an explicit transition")
    if problems:
        raise MatrixViolation(f"[{workflow.name} {case.id}] " + "; ".join(problems))


def _asked_again(journal: list[StepSpec], steps: dict[str, StepExecution]) -> list[str]:
    """An agent's turns in the conversation must each ask with a conversation no other asked
    with: a journaled turn asked again (as a new turn) would repeat one."""
    asked: dict[str, str] = {}
    problems = []
    for spec in journal:
        step = steps[spec.name]
        if not spec.is_turn or step.state == StepState.SKIPPED or not step.intent:
            continue
        conversation = step.intent.get("conversation", "")
        if conversation in asked:
            problems.append(f"{spec.name} asked the model what {asked[conversation]} had asked already")
        asked[conversation] = spec.name
    return problems


def fault_matrix(
    workflow_name: str,
    *,
    event: Callable[[int], dict[str, Any]],
    effects: Callable[[WorkflowRun], dict[str, int]],
    fixtures: tuple[str, ...] = (),
    databases: tuple[str, ...] = ("default",),
    compensations: Callable[[WorkflowRun], dict[str, int]] | None = None,
):
    """A parametrised pytest test running the whole fault matrix of one workflow. ``event(n)``
    makes the n-th business event (a distinct business key per case); ``fixtures`` names
    pytest fixtures the receivers need (a live server, say); ``compensations(run) -> {step:
    number of remote objects its compensation made}`` adds the compensations' cases."""
    import pytest

    workflow = get_workflow(workflow_name)
    numbered = list(enumerate(cases(workflow, compensations=compensations is not None)))

    @pytest.mark.django_db(transaction=True, databases=list(databases))
    @pytest.mark.parametrize("numbered_case", numbered, ids=[case.id for _, case in numbered])
    def test_fault_matrix(numbered_case, request, monkeypatch):
        for name in fixtures:
            request.getfixturevalue(name)
        monkeypatch.delenv("RECOVERY_FAILPOINTS", raising=False)
        clock = MovableClock()
        monkeypatch.setattr(engine_clock, "now", clock.now)
        n, case = numbered_case
        run_case(workflow, case, data=event(n), effects=effects, clock=clock, compensations=compensations)

    test_fault_matrix.__doc__ = f"The fault matrix of {workflow_name}: every step × boundary × fault kind."
    return test_fault_matrix


__all__ = [
    "Case",
    "MatrixViolation",
    "MovableClock",
    "Receivers",
    "cases",
    "check",
    "drive",
    "fault_matrix",
    "inject",
    "run_case",
]
