"""A tool call that waits for a person (issue 38, recovery.waiting.ToolApproval).

Under a lease, the executor holds a call whose tool needs approval once its guards pass: the row
waits (nothing sent, no attempt counted) and the run waits with it, holding no worker, until the
deadline (``call_hold``). At the deadline the call escalates to another role once, if the tool
says so (``call_approval_escalate``), else it fails "no decision by the deadline" and the run
goes to review (``call_approval_time_out``) — never a silent rejection.

A person of the tool's role decides (``@operator_transition``, from every surface): approve (the
call goes as asked; the guards check it again), edit (new arguments, validated by the tool's
schema, the change kept; the guards check them), reject (the reason is answered to the model as
the tool's result; nothing sent) or answer in the tool's place (the answer is the call's result).
Each decision is recorded on the row (``approval``: who, when, why, the sender's key) and in one
audit event; the run goes on from it. The same decision again under the same key is the first
one (the API's replay, ``already_decided``); any other decision of a decided call is refused."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pydantic

from recovery import permissions
from recovery.actions import CALL_DECISIONS
from recovery.errors import DecisionRefused, InvalidTransition, NotPermitted
from recovery.models import RunState, StepExecution, StepState, WorkflowRun
from recovery.redaction import redact_text
from recovery.states import TERMINAL_RUN_STATES, AuditAction
from recovery.validation import problem_text, problems_of
from recovery.waiting import a_role
from recovery.workflow import StepSpec

from ._core import RUN_LEASE_FIELDS, Lease, _Change, _check, _redacted, _release_into, _step_transition
from .acting import Act, operator_transition
from .offers import Situation, _forward_blocked
from .tables import RUN_TRANSITIONS, STEP_TRANSITIONS
from .waits import escalate

DECISIONS = CALL_DECISIONS


def approval_needed(spec: StepSpec, step: StepExecution, arguments: dict[str, Any], ctx: Any) -> bool:
    """Whether the call must wait for a person before it is made: its tool asks for approval of
    these arguments, and nobody has decided it yet."""
    approval = getattr(spec, "approval", None)
    if approval is None or decided(step) or step.attempts:  # a call made once is not held midway
        return False
    return approval.needed(arguments, ctx)


def decided(step: StepExecution) -> bool:
    return bool(step.approval and step.approval.get("decision"))


def awaits_decision(step: StepExecution) -> bool:
    """The call waits for a person's decision: held, or its wait timed out into review."""
    if not step.approval or decided(step) or step.attempts:
        return False
    return step.state == StepState.WAITING or (step.state == StepState.FAILED and "timed_out_at" in step.approval)


def approval_text(spec: StepSpec, step_name: str, role: str, until: datetime, *, escalated: bool = False) -> str:
    """ "resolve:1:0:issue_credit_note: waiting for a supervisor's approval until 2026-12-07 03:12
    UTC; then the run goes to review" """
    approval = spec.approval
    assert approval is not None
    then = "the run goes to review" if escalated else approval.on_timeout.text()
    was = " (escalated)" if escalated else ""
    return f"{step_name}: waiting for {a_role(role)}'s approval{was} until {until:%Y-%m-%d %H:%M} UTC; then {then}"


def call_hold(
    *, lease: Lease, spec: StepSpec, step_name: str, arguments: dict[str, Any], now: datetime | None = None
) -> StepExecution:
    """The call's guards passed and its tool needs a person: the row waits for a decision and
    the run waits with it, holding nothing, until the approval's deadline."""
    approval = spec.approval
    assert approval is not None

    def body(change: _Change) -> None:
        run, step = change.run, change.step
        until = change.now + approval.timeout
        step.state = _check(STEP_TRANSITIONS, "wait", step.state, "step")
        step.approval = {"role": approval.role, "asked_at": change.now.isoformat()}
        step.next_attempt_at = until
        change.save_step(step, ["state", "approval", "next_attempt_at"])
        why = approval_text(spec, step_name, approval.role, until)
        _check(RUN_TRANSITIONS, "wait", run.state, "run")
        _release_into(run, RunState.WAITING, wake_at=until, reason=why)
        change.save_run(RUN_LEASE_FIELDS + ["status_reason"])
        change.reason = why
        change.extra = {"role": approval.role, "until": until.isoformat(), "arguments": _redacted(run, arguments)}

    return _step_transition(lease, step_name, AuditAction.CALL_HELD, now, body)


def call_approval_escalate(
    *, lease: Lease, spec: StepSpec, step_name: str, now: datetime | None = None
) -> StepExecution:
    """The deadline passed with no decision and the tool escalates: the call waits on, for a
    person of the escalation's role (the run's stuck alert names it), until a new deadline."""
    approval = spec.approval
    assert approval is not None and approval.on_timeout.action == "escalate"
    escalation = approval.on_timeout

    def body(change: _Change) -> None:
        why = escalate(
            change, escalation, lambda until: approval_text(spec, step_name, escalation.role, until, escalated=True)
        )
        change.reason = f"no decision by the deadline: {why}"

    return _step_transition(lease, step_name, AuditAction.APPROVAL_ESCALATED, now, body)


def call_approval_time_out(*, lease: Lease, step_name: str, now: datetime | None = None) -> StepExecution:
    """The deadline passed with no decision: the call failed "no decision by the deadline", nothing
    sent, and an operator decides — the call can still be decided, retried (it waits again), or
    the agent stopped."""

    def body(change: _Change) -> None:
        run, step = change.run, change.step
        deadline = step.next_attempt_at
        step.state = _check(STEP_TRANSITIONS, "wait_time_out", step.state, "step")
        change.extra["waited_seconds"] = _waited(step, change.now)
        step.approval = {**(step.approval or {}), "timed_out_at": change.now.isoformat()}
        role = step.approval.get("role", "")
        by = f" ({deadline:%Y-%m-%d %H:%M} UTC)" if deadline else ""
        step.last_error = f"no decision by {a_role(role)} by the deadline{by}"
        step.next_attempt_at = None
        change.save_step(step, ["state", "approval", "last_error", "next_attempt_at"])
        _check(RUN_TRANSITIONS, "review", run.state, "run")
        why = (
            f"{step_name}: {step.last_error}; nothing was sent: decide the call, retry it to ask again, "
            "or stop the agent"
        )
        _release_into(run, RunState.NEEDS_REVIEW, reason=why)
        change.save_run(RUN_LEASE_FIELDS + ["status_reason"])
        change.reason = why

    return _step_transition(lease, step_name, AuditAction.WAIT_TIMEOUT, now, body)


# --- a person's decision ----------------------------------------------------------------------


def call_decidable(s: Situation, step_name: str | None, actor: Any) -> str | InvalidTransition:
    """A call waiting for a decision, in a run nobody holds, decided by a person of the role the
    call waits for now (a supervisor may always; a system's label is checked by its API)."""
    run, step = s.run, s.step(step_name)
    if run.state in TERMINAL_RUN_STATES:
        return f"run {run.workflow_id} is {run.state}: its calls are not decided any more"
    if s.live:
        return f"run {run.workflow_id} is running under {run.lease_owner}; wait for it"
    if blocked := _forward_blocked(s):
        return blocked
    spec = s.workflow.get_step(step_name) if s.workflow is not None else None
    if spec is None or getattr(spec, "approval", None) is None:
        return f"{step_name} is not a tool call that waits for a person's approval"
    if not awaits_decision(step):
        if decided(step):
            return f"{step_name} was decided already: {_decided_text(step)}"
        return f"{step_name} waits for no decision (it is {step.state})"
    role = step.approval.get("role", "supervisor")
    if actor is not None and not isinstance(actor, str) and permissions.role_of(actor) < permissions.role_named(role):
        have = permissions.role_of(actor).name.lower()
        return NotPermitted(f"{actor.get_username()} ({have}) may not decide {step_name}: it waits for {a_role(role)}")
    return ""


def _decided_text(step: StepExecution) -> str:
    approval = step.approval or {}
    return f"{approval.get('decision')} by {approval.get('by')} at {approval.get('at', '')[:16].replace('T', ' ')} UTC"


def already_decided(run: WorkflowRun, step_name: str, decision: str, key: str) -> bool:
    """Whether ``decision`` under the sender's ``key`` is the one the call was decided by: the
    same request again (a retry, a second delivery), answered as the first was."""
    step = StepExecution.objects.filter(run=run, step_name=step_name).only("approval").first()
    approval = (step.approval or {}) if step is not None else {}
    return bool(key) and approval.get("key") == key and approval.get("decision") == DECISIONS.get(decision)


@operator_transition("approve_call", offered=call_decidable)
def call_approve(act: Act, key: str = "") -> None:
    """Let the call go as the model asked it: the guards check it again, then it is made."""
    _decided(act, "call_decided", "approve", key)


@operator_transition("edit_call", offered=call_decidable)
def call_edit(act: Act, decision: dict[str, Any], key: str = "") -> None:
    """Make the call with the person's arguments instead: validated by the tool's schema, the
    change recorded field by field; the guards check them when it is made."""
    step, spec = act.step, act.situation.workflow.get_step(act.step_name)
    assert step is not None and spec.arguments is not None
    try:
        edited = spec.arguments.model_validate(decision).model_dump(mode="json")
    except pydantic.ValidationError as exc:
        refused = problem_text(f"arguments refused by {spec.arguments.__name__}", problems_of(exc))
        raise DecisionRefused(refused) from None
    asked = step.intent or {}
    fields = sorted({*asked, *edited})
    changes = {k: {"from": asked.get(k), "to": edited.get(k)} for k in fields if asked.get(k) != edited.get(k)}
    if not changes:
        raise DecisionRefused(f"these are the arguments {act.step_name} was asked with: approve it instead")
    step.intent = _redacted(act.run, edited)
    act.save_step(step, ["intent"])
    _decided(act, "call_decided", "edit", key, changes=_redacted(act.run, changes))


@operator_transition("reject_call", offered=call_decidable)
def call_reject(act: Act, key: str = "") -> None:
    """Answer the call to the model as rejected, with the reason as the message: nothing is sent,
    and the agent goes on with its next turn."""
    step = act.step
    assert step is not None
    step.last_error = redact_text(f"rejected by {act.who}: {act.reason}")[:4000]
    act.save_step(step, ["last_error"])
    _decided(act, "call_rejected", "reject", key)


@operator_transition("answer_call", offered=call_decidable)
def call_answer(act: Act, decision: dict[str, Any], key: str = "") -> None:
    """Answer the call in the tool's place: the answer (a JSON object, validated by the tool's
    result schema where it declares one) is the call's result, as the model will read it. The
    tool is not called."""
    step, spec = act.step, act.situation.workflow.get_step(act.step_name)
    assert step is not None
    answer = decision
    if spec.result_schema is not None:
        try:
            answer = spec.result_schema.model_validate(decision).model_dump(mode="json")
        except pydantic.ValidationError as exc:
            refused = problem_text(f"answer refused by {spec.result_schema.__name__}", problems_of(exc))
            raise DecisionRefused(refused) from None
    step.result, step.remote_ref = _redacted(act.run, answer), ""
    act.save_step(step, ["result", "remote_ref"])
    _decided(act, "call_answered", "answer", key)


def _decided(act: Act, move: str, decision: str, key: str, **facts: Any) -> None:
    """Record the decision on the call and let the run go on from it."""
    step = act.step
    assert step is not None
    step.state = _check(STEP_TRANSITIONS, move, step.state, "step")
    waited = _waited(step, act.now)
    made = {"decision": decision, "by": act.who, "at": act.now.isoformat(), "reason": act.reason, "key": key[:200]}
    step.approval = {**(step.approval or {}), **made, **facts}
    step.next_attempt_at = None
    act.save_step(step, ["state", "approval", "next_attempt_at"])
    run = act.run
    _check(RUN_TRANSITIONS, "resume", run.state, "run")
    act.release(RunState.PENDING, f"{act.step_name}: {decision} by {act.who}")
    act.extra.update(decision=decision, waited_seconds=waited, **facts)


def _waited(step: StepExecution, now: datetime) -> float:
    """Seconds since the call was held for a person (recovery_wait_seconds: time to decision)."""
    asked = (step.approval or {}).get("asked_at")
    return max(0.0, (now - datetime.fromisoformat(asked)).total_seconds()) if asked else 0.0


# --- the inbox's "I take this" -----------------------------------------------------------------


def takable(s: Situation, step_name: str | None, actor: Any) -> str | InvalidTransition:
    """A call waiting for a decision that this person may decide, or a wait for an event a person
    may send, not already theirs."""
    step = s.step(step_name)
    spec = s.workflow.get_step(step_name) if s.workflow is not None else None
    if spec is not None and spec.wait is not None and not spec.wait.is_timer:
        timed_out = step.state == StepState.FAILED and s.run.state == RunState.NEEDS_REVIEW
        if step.state != StepState.WAITING and not timed_out:
            return f"{step_name} waits for no event now (it is {step.state})"
    elif refused := call_decidable(s, step_name, actor):
        return refused
    person = actor is not None and not isinstance(actor, str)
    if person and (step.approval or {}).get("assignee") == actor.get_username():
        return f"{step_name} is yours already"
    return ""


@operator_transition("take", offered=takable)
def item_take(act: Act) -> None:
    """Take an inbox item ("I take this"): the call or the wait is assigned to this person, for
    everyone to see; it changes nothing else, and anyone with the role may still decide it."""
    step = act.step
    assert step is not None
    taken_from = (step.approval or {}).get("assignee", "")
    step.approval = {**(step.approval or {}), "assignee": act.who, "taken_at": act.now.isoformat()}
    act.save_step(step, ["approval"])
    act.extra.update(assignee=act.who, **({"taken_from": taken_from} if taken_from else {}))
