"""Whether an operator action is valid on a run now, and if not, why: one answer for the
console, which offers an action only where it is valid, and for the transitions, which refuse
it everywhere else with the same message.

Pure: it reads the run, its steps and the workflow's declaration, and writes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime

from django.contrib.auth.models import AbstractBaseUser

from recovery import permissions, registry
from recovery.actions import ACTIONS, StepArg
from recovery.errors import ErrorKind, InvalidTransition, NotPermitted
from recovery.models import (
    AGENT_STOPPED,
    Alert,
    AlertState,
    RunState,
    StepExecution,
    StepState,
    WorkflowPause,
    WorkflowRun,
)
from recovery.workflow import Workflow, journal_rows, parse_journal_name, workflow_of

from ._core import _live_lease, pausing
from .performers import performer
from .tables import RUN_TRANSITIONS, TERMINAL_RUN_STATES

# A step in one of these has (had) its effect undone: the run cannot go forward past it.
UNDONE_STEP_STATES = frozenset({StepState.COMPENSATING, StepState.COMPENSATED, StepState.COMPENSATION_FAILED})
UNDOABLE_STEP_STATES = (StepState.SUCCEEDED, StepState.COMPENSATION_FAILED)


@dataclass
class Situation:
    """A run as an action finds it: its steps as they effectively are now (a step left
    ``running`` under an expired lease has an unknown outcome, and every operator transition
    records it so before it acts)."""

    run: WorkflowRun
    steps: list[StepExecution]
    now: datetime
    workflow: Workflow | None
    live: bool
    firing_alert: bool | None = None  # whether the run has an alert firing (None: not read yet)

    @classmethod
    def of(
        cls, run: WorkflowRun, steps: Iterable[StepExecution], now: datetime, *, firing_alert: bool | None = None
    ) -> Situation:
        try:
            workflow = workflow_of(run)
        except LookupError:
            workflow = None
        return cls(
            run=run,
            steps=sorted(steps, key=lambda s: s.order),
            now=now,
            workflow=workflow,
            live=_live_lease(run, now),
            firing_alert=firing_alert,
        )

    def state_of(self, step: StepExecution) -> str:
        if step.state == StepState.RUNNING and not self.live:
            return StepState.UNKNOWN
        return step.state

    def step(self, name: str | None) -> StepExecution | None:
        return next((s for s in self.steps if s.step_name == name), None)

    def undone(self) -> list[str]:
        return [s.step_name for s in self.steps if s.state in UNDONE_STEP_STATES]

    def unknown(self) -> list[str]:
        return [s.step_name for s in self.steps if self.state_of(s) == StepState.UNKNOWN]


def why_not(
    action: str,
    situation: Situation,
    *,
    step_name: str | None = None,
    actor: AbstractBaseUser | None = None,
    check_role: bool = True,
) -> InvalidTransition | None:
    """None if ``action`` (on ``step_name``) is valid now for ``actor``, else the refusal to
    raise: NotPermitted for a role, InvalidTransition for the run's state. ``actor`` None is the
    system (no role check). The transitions check the state (``check_role=False``: the role is
    ``perform``'s, for every surface) — but a compensation's ``who`` and "it did not happen"
    inside the in-flight window depend on the person, and are checked whenever ``actor`` is
    given. The four-eyes rule is not checked here (transitions.approvals)."""
    spec = ACTIONS.get(action)
    if spec is None:
        return InvalidTransition(f"unknown action {action!r}")
    if check_role and (refused := role_refusal(action, actor)):
        return refused
    if spec.step == StepArg.REQUIRED and not step_name:
        return InvalidTransition(f"{action} needs a step")
    if step_name and situation.step(step_name) is None:
        return InvalidTransition(f"run {situation.run.workflow_id} has no step {step_name!r}")
    if (paused := _paused(situation.run)) and action not in RUN_WHILE_PAUSED:
        return InvalidTransition(paused)
    if step_name and situation.workflow is None:
        return InvalidTransition(
            f"{situation.run.workflow_name} v{situation.run.workflow_version} is not deployed: its steps cannot be "
            "acted on (deploy it again, or move the run to a version this deployment has)"
        )
    message = performer(action).offered(situation, step_name, actor)
    if isinstance(message, InvalidTransition):
        return message
    return InvalidTransition(message) if message else None


# What may be done to a paused run (or one whose pause was asked for): everything else would let
# it go on without being unpaused.
RUN_WHILE_PAUSED = frozenset({"unpause", "terminate", "snooze_alert"})


def _paused(run: WorkflowRun) -> str:
    if run.state == RunState.PAUSED:
        return f"run {run.workflow_id} is {run.status_reason}; unpause it first"
    if pausing(run):
        return f"run {run.workflow_id} is pausing (asked by {run.paused_by}); unpause it first"
    return ""


def backoff_waiting(s: Situation, step_name: str | None, actor) -> str:
    """A step waiting for its next attempt (failed, due later), in a run nothing else holds up."""
    run, step = s.run, s.step(step_name)
    if run.state != RunState.WAITING:
        return f"run {run.workflow_id} is {run.state}: only a run waiting for a retry can try a step now"
    if unknown := s.unknown():
        return f"reconcile {', '.join(unknown)} first: its outcome is unknown"
    if step.state != StepState.FAILED or step.next_attempt_at is None or step.next_attempt_at <= s.now:
        return f"{step_name} is not waiting for a retry"
    return _forward_blocked(s)


def pausable(s: Situation, step_name: str | None, actor) -> str:
    """A run that moves by itself: pending, waiting, or running (a call in flight is recorded first)."""
    run = s.run
    if run.state not in RUN_TRANSITIONS["pause"][0]:
        return f"run {run.workflow_id} is {run.state}: only a run that moves by itself can be paused"
    return ""


def unpausable(s: Situation, step_name: str | None, actor) -> str:
    """A paused run (or one pausing), unless a pause of its workflow in force holds it: that pause
    releases its runs when it is unpaused (transitions.workflow_pauses)."""
    run = s.run
    if run.paused_at is None:
        return f"run {run.workflow_id} is not paused"
    if run.workflow_pause_id is not None:
        held = WorkflowPause.objects.filter(pk=run.workflow_pause_id, released_at__isnull=True).first()
        if held is not None:
            return f"run {run.workflow_id} is held by the pause of {held.scope} (by {held.paused_by}): unpause that"
    return ""


def role_refusal(action: str, actor: AbstractBaseUser | None) -> NotPermitted | None:
    """The action's lowest role (recovery.actions, recovery.permissions) against a person's. A
    system (None: the executor; a label, ``"api:monitor"``: a token, whose capability its API
    checked) has no role to check."""
    spec = ACTIONS[action]
    if actor is None or isinstance(actor, str) or permissions.can(actor, spec.permission):
        return None
    role = permissions.role_of(actor).name.lower()
    needed = permissions.REQUIRED_ROLE[spec.permission].name.lower()
    return NotPermitted(f"{actor.get_username()} ({role}) may not {spec.label}: that needs the {needed} role")


def _forward_blocked(s: Situation) -> str:
    """An action that sends the run forward is refused once effects were undone: the executor
    would have to redo a compensated step under the key whose effect was just undone."""
    undone = s.undone()
    if s.run.state in (RunState.COMPENSATING, RunState.COMPENSATION_FAILED) or undone:
        names = ", ".join(undone) or "its effects"
        return (
            f"run {s.run.workflow_id} is {s.run.state} ({names} compensated or being compensated): it cannot go "
            "forward; compensate the rest or terminate it"
        )
    return ""


def _running(s: Situation) -> str:
    return f"run {s.run.workflow_id} is running under {s.run.lease_owner}; wait for it" if s.live else ""


def resumable(s: Situation, step_name: str | None, actor) -> str:
    run = s.run
    if run.state in TERMINAL_RUN_STATES:
        return f"run {run.workflow_id} is {run.state}: a finished run cannot be resumed"
    if run.state not in RUN_TRANSITIONS["resume"][0]:
        return f"cannot resume a run that is {run.state}"
    return _forward_blocked(s)


def step_in(action: str, allowed: frozenset[str]) -> Callable[[Situation, str | None, object], str]:
    def rule(s: Situation, step_name: str | None, actor) -> str:
        run, step = s.run, s.step(step_name)
        if run.state in TERMINAL_RUN_STATES:
            return f"run {run.workflow_id} is {run.state}: a finished run cannot be changed this way"
        if blocked := _running(s) or _forward_blocked(s):
            return blocked
        state = s.state_of(step)
        if state not in allowed:
            return f"step {step_name} is {state}; {action} needs a step that is {' or '.join(sorted(allowed))}"
        return ""

    return rule


def resolvable(happened: bool):
    def rule(s: Situation, step_name: str | None, actor) -> str | InvalidTransition:
        run, step = s.run, s.step(step_name)
        stays_terminated = run.state == RunState.TERMINATED
        if (run.state in TERMINAL_RUN_STATES and not stays_terminated) or s.live:
            return f"run {run.workflow_id} is {run.state}; it cannot be changed now"
        if s.state_of(step) != StepState.UNKNOWN:
            return f"step {step_name} is not waiting for reconciliation"
        if blocked := _forward_blocked(s):
            return blocked
        if not happened and (early := absent_too_early(s, step, actor)):
            return NotPermitted(early)  # a supervisor's call while the request may still land
        if happened and not s.workflow.get_step(step_name).evidence_rule():
            return evidence_refusal(step_name)
        return ""

    return rule


def evidence_refusal(step_name: str) -> str:
    """Why "it succeeded" is not offered for a step whose evidence cannot be checked."""
    return (
        f"{step_name}'s receiver cannot be asked by its id (no @lookup_ref) and the step declares no result "
        "schema (result=): evidence cannot be checked, so it cannot be recorded; reconcile the step, mark it "
        "not happened, or terminate the run"
    )


def absent_too_early(s: Situation, step: StepExecution, actor: AbstractBaseUser | None) -> str:
    """ "It did not happen" while the step's last request may still commit (its in-flight
    window is open, or unbounded) is a supervisor's call: the step would be performed again
    beside a request that can still land."""
    until = in_flight_until(s, step)
    if until is not None and until <= s.now:
        return ""
    if actor is not None and permissions.role_of(actor) < permissions.Role.SUPERVISOR:
        sent = f" sent at {step.last_attempt_at:%H:%M:%S} UTC" if step.last_attempt_at else ""
        still = f"until {until:%H:%M:%S} UTC" if until is not None else "at any time (no in-flight bound)"
        return (
            f"{step.step_name}: the request{sent} may still commit {still}; only a supervisor can declare "
            "that it did not happen before then"
        )
    return ""


def in_flight_until(s: Situation, step: StepExecution) -> datetime | None:
    return s.workflow.get_step(step.step_name).in_flight_until(step.last_attempt_at)


def terminable(s: Situation, step_name: str | None, actor) -> str:
    if s.run.state not in RUN_TRANSITIONS["terminate"][0]:
        return f"cannot terminate a run that is {s.run.state}"
    return ""


def compensable(s: Situation, step_name: str | None, actor) -> str | InvalidTransition:
    if blocked := _running(s):
        return blocked
    if s.run.state not in RUN_TRANSITIONS["compensate"][0]:
        return f"cannot compensate a run that is {s.run.state}"
    if s.workflow is None:
        return f"{s.run.workflow_name} v{s.run.workflow_version} is not deployed: its compensations are unknown"
    try:
        targets = compensation_targets(s, step_name)
    except InvalidTransition as exc:
        return exc
    if actor is not None:
        return who_refusal(s.workflow, targets, actor) or ""
    return ""


def compensation_targets(s: Situation, step_name: str | None) -> list[StepExecution]:
    """The steps a compensation of the run (or of ``step_name``) undoes, latest last; raises
    InvalidTransition when there are none or the order forbids it."""
    compensable = {step.step_name for step in s.steps if s.workflow.compensates(step.step_name)}
    unknown = s.unknown()
    if unknown:
        # First establish whether the original action happened at all.
        raise InvalidTransition(f"reconcile {', '.join(unknown)} first: its outcome is unknown")
    if step_name is not None:
        step = s.step(step_name)
        if step_name not in compensable:
            raise InvalidTransition(f"step {step_name} declares no compensation")
        if step.state not in UNDOABLE_STEP_STATES:
            raise InvalidTransition(f"step {step_name} is {step.state}; only a completed step can be compensated")
        later = [
            other.step_name
            for other in s.steps
            if other.order > step.order and other.state in UNDOABLE_STEP_STATES and other.step_name in compensable
        ]
        if later:
            raise InvalidTransition(f"compensate {', '.join(later)} first: compensations run in reverse order")
        return [step]
    targets = [step for step in s.steps if step.step_name in compensable and step.state in UNDOABLE_STEP_STATES]
    if not targets:
        raise InvalidTransition(f"run {s.run.workflow_id} has no completed step with a compensation")
    return targets


def who_refusal(workflow: Workflow, targets: list[StepExecution], actor: AbstractBaseUser) -> NotPermitted | None:
    """Each compensation names the lowest role that may trigger it (``@step.compensate(who=…)``):
    a person compensates only steps whose ``who`` their role reaches."""
    role = permissions.role_of(actor)
    above = []
    for step in targets:
        contract = workflow.get_step(step.step_name).compensation
        if contract is not None and role < permissions.role_named(contract.who):
            above.append(f"{step.step_name} ({contract.who})")
    if not above:
        return None
    return NotPermitted(
        f"{actor.get_username()} ({role.name.lower()}) may not compensate {', '.join(above)}: "
        "each compensation names the lowest role that may trigger it"
    )


def decision_replaceable(s: Situation, step_name: str | None, actor) -> str:
    run, step = s.run, s.step(step_name)
    if run.state in TERMINAL_RUN_STATES or s.live:
        return f"run {run.workflow_id} is {run.state}; a decision can only be replaced on a stopped run"
    if not s.workflow.get_step(step_name).is_decision:
        return f"{step_name} is not a model step: it has no decision to replace"
    if step.state != StepState.SUCCEEDED and not never_validated(step):
        return f"step {step_name} has no accepted decision"
    # A later read is made again from the new decision (decision_supersede): only a step that may
    # have sent something built from the old one stops the change.
    acted = next(
        (
            o
            for o in s.steps
            if o.order > step.order
            and (o.state != StepState.PENDING or o.attempts)
            and not s.workflow.get_step(o.step_name).reads
        ),
        None,
    )
    if acted is not None:
        return (
            f"{acted.step_name} already sent a request built from this decision under its idempotency key "
            f"{acted.idempotency_key[:12]}…: the same key cannot carry another payload, so the decision can no "
            "longer change for this run (compensate and start the business event again, or terminate)"
        )
    return ""


def never_validated(step: StepExecution) -> bool:
    """A model step stopped on output that did not match its schema: no decision was ever
    accepted, and a person may write one (or ask the model again)."""
    held = step.state in (StepState.FAILED, StepState.PENDING)
    return held and step.last_error_kind == ErrorKind.INVALID_MODEL_OUTPUT


def overridable(s: Situation, step_name: str | None, actor) -> str:
    if blocked := _running(s):
        return blocked
    refusal = s.step(step_name).refusal
    if not refusal or s.run.state != RunState.NEEDS_REVIEW:
        return f"{step_name} holds no refused proposal to accept"
    if refusal.get("rule") == AGENT_STOPPED:
        return f"{step_name} was stopped by an operator: resume the run to let it go on, or fork it from a turn"
    return ""


def agent_stoppable(s: Situation, step_name: str | None, actor) -> str:
    run, step = s.run, s.step(step_name)
    if not s.workflow.get_step(step_name).is_agent:
        return f"{step_name} is not an agent step"
    if run.state not in RUN_TRANSITIONS["hold"][0]:
        return f"run {run.workflow_id} is {run.state}: there is no agent to stop"
    if step.state != StepState.PENDING:
        return f"{step_name} is {step.state}: it has given its final answer"
    if _stopped(step):
        return f"{step_name} is already stopped"
    return ""


def _stopped(step: StepExecution) -> bool:
    return bool(step.refusal) and step.refusal.get("rule") == AGENT_STOPPED


def agent_forkable(s: Situation, step_name: str | None, actor) -> str:
    """Fork an agent from one of its turns (that turn's row)."""
    run, step = s.run, s.step(step_name)
    if run.state in TERMINAL_RUN_STATES:
        return f"run {run.workflow_id} is {run.state}: a finished run cannot be changed this way"
    if blocked := _running(s) or _forward_blocked(s):
        return blocked
    if run.state not in RUN_TRANSITIONS["resume"][0]:
        return f"cannot fork an agent in a run that is {run.state}"
    if not s.workflow.get_step(step_name).is_turn:
        return f"{step_name} is not a model turn of an agent step"
    if step.state == StepState.SKIPPED:
        return f"{step_name} is already out of the conversation"
    agent = s.step(parse_journal_name(step_name).agent)
    journal = journal_rows(agent.step_name, s.steps)
    unknown = [r.step_name for r in journal if s.state_of(r) == StepState.UNKNOWN]
    if unknown:
        return f"reconcile {', '.join(unknown)} first: its outcome is unknown"
    later = (o for o in s.steps if o.order > agent.order and o not in journal)
    acted = next((o for o in later if o.state != StepState.PENDING or o.attempts), None)
    if acted is not None:
        return f"{acted.step_name} already acted on the agent's answer: it can no longer be forked for this run"
    return ""


def movable(s: Situation, step_name: str | None, actor) -> str:
    """The state allows a move, nobody holds the run, and another version is deployed; whether
    that version can continue the run is the transition's judgement (versions.move_plan)."""
    run = s.run
    if run.state in TERMINAL_RUN_STATES:
        return f"run {run.workflow_id} is {run.state}: a finished run is not moved"
    if run.state not in RUN_TRANSITIONS["move_version"][0]:
        return f"run {run.workflow_id} is {run.state}: finish the compensation (or terminate) before moving it"
    if blocked := _running(s):
        return blocked
    others = [v for v in registry.versions_of(run.workflow_name) if v != run.workflow_version]
    if not others:
        return f"this deployment has no other version of {run.workflow_name} to move the run to"
    return ""


def snoozable(s: Situation, step_name: str | None, actor) -> str:
    if s.firing_alert is None:
        s.firing_alert = Alert.objects.filter(run=s.run, state=AlertState.FIRING).exists()
    if not s.firing_alert:
        return f"run {s.run.workflow_id} has no alert firing"
    return ""


def offered(situation: Situation, actor: AbstractBaseUser) -> list[tuple[str, str | None]]:
    """Every (action, step) valid now for ``actor``, in the table's order: what the console offers."""
    pairs = []
    for name, spec in ACTIONS.items():
        candidates: list[str | None] = [None] if spec.step != StepArg.REQUIRED else []
        if spec.step != StepArg.NONE:
            candidates += [s.step_name for s in situation.steps]
        pairs += [(name, step) for step in candidates if why_not(name, situation, step_name=step, actor=actor) is None]
    return pairs


def require(
    action: str, run: WorkflowRun, now: datetime, *, step_name: str | None = None, actor: AbstractBaseUser | None = None
) -> Situation:
    """In a transition, with the run locked: lock its steps and raise the refusal if ``action``
    is not valid now (the state; a compensation's ``who`` and an early "it did not happen" for
    ``actor``). Returns the situation it judged."""
    steps = StepExecution.objects.select_for_update().filter(run=run)
    situation = Situation.of(run, steps, now)
    refused = why_not(action, situation, step_name=step_name, actor=actor, check_role=False)
    if refused is not None:
        raise refused
    return situation
