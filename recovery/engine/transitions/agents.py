"""An agent step's journal. Under a lease: a model turn added, a turn's reply recorded with the
tool calls it asks for (and the agent's final answer), each in one transaction. By an operator:
the agent stopped, let go on, or forked from a turn.

A call's row is written with the turn that asked for it, never later: after a crash the
journal holds either the turn and all its calls, or neither (and the turn is asked again,
since its answer was never recorded)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, Protocol

from django.contrib.auth.models import AbstractBaseUser

from recovery.errors import ErrorKind
from recovery.models import RunState, StepExecution, StepState, WorkflowRun
from recovery.redaction import redact_text
from recovery.states import AuditAction
from recovery.workflow import idempotency_key, journal_rows, parse_journal_name, turn_name

from . import offers
from ._core import (
    RUN_LEASE_FIELDS,
    Lease,
    _Change,
    _check,
    _redacted,
    _release_into,
    _save_step,
    _snap,
    _step_transition,
)
from .acting import Act, operator_transition
from .checkpoints import Draft
from .tables import RUN_TRANSITIONS, STEP_TRANSITIONS


class Call(Protocol):
    """A requested tool call as its row is written (recovery.engine.agent.NewCall)."""

    name: str
    tool: str
    arguments: dict[str, Any]
    error: str


def agent_turn_add(
    *,
    lease: Lease,
    agent: str,
    turn: int,
    key_version: int,
    now: datetime | None = None,
    draft: Draft | None = None,
) -> StepExecution:
    """Add the agent's next model turn to its journal, pending (asked next). With ``draft``:
    decided on it (with the outcome of the step before, say), for the caller to commit."""
    added: list[StepExecution] = []

    def body(change: _Change) -> None:
        row = _new_row(change.run, change.step.position, turn_name(agent, turn), key_version, change.now)
        change.insert(row)
        added.append(row)
        change.reason = f"model turn {turn}"
        change.extra = {"turn": turn}

    _step_transition(lease, agent, AuditAction.AGENT_TURN_ADD, now, body, draft=draft)
    return added[-1]


def agent_turn_record(
    *,
    lease: Lease,
    agent: str,
    step_name: str,
    reply: dict[str, Any],
    calls: Sequence[Call],
    key_versions: dict[str, int],
    final: dict[str, Any] | None,
    complete_run: bool,
    now: datetime | None = None,
) -> StepExecution:
    """Journal a model turn: its reply, and a row for every tool call it asks for — pending,
    with its validated arguments as its intent and its own key; or skipped, with the error
    answered to the model (no such tool, invalid arguments). With ``final`` (a reply with no
    call, valid against the agent's schema) the agent step succeeds with it, and with
    ``complete_run`` the run completes, in this same checkpoint."""

    def body(change: _Change) -> None:
        run, step, now = change.run, change.step, change.now
        step.state = _check(STEP_TRANSITIONS, "succeed", step.state, "step")
        step.result = _redacted(run, reply)
        step.next_attempt_at = None
        change.save_step(step, ["state", "result", "next_attempt_at"])
        for call in calls:
            answered = {}
            if call.error:  # answered to the model as an error: nothing is sent for it
                answered = {
                    "state": _check(STEP_TRANSITIONS, "skip", StepState.PENDING, "step"),
                    "last_error_kind": ErrorKind.PERMANENT,
                    "last_error": redact_text(call.error)[:4000],
                }
            row = _new_row(
                run,
                step.position,
                call.name,
                key_versions.get(call.tool, 1),
                now,
                intent=_redacted(run, call.arguments),
                **answered,
            )
            change.insert(row)
        if final is not None:
            done = change.other_step(agent)
            done.state = _check(STEP_TRANSITIONS, "succeed", done.state, "step")
            done.result = _redacted(run, final)
            done.next_attempt_at = None
            change.save_step(done, ["state", "result", "next_attempt_at"])
            if complete_run:
                _check(RUN_TRANSITIONS, "complete", run.state, "run")
                _release_into(run, RunState.COMPLETED)
                run.current_step = ""
                change.save_run([*RUN_LEASE_FIELDS, "status_reason", "current_step"])
        asked = ", ".join(call.tool for call in calls)
        change.reason = "final answer" if final is not None else f"asks for {asked}" if calls else "no call"
        change.extra = {"calls": len(calls), "final": final is not None}

    return _step_transition(lease, step_name, AuditAction.AGENT_TURN, now, body)


def _new_row(
    run: WorkflowRun, position: int, name: str, key_version: int, now: datetime, **fields: Any
) -> StepExecution:
    """A journal row at its agent's position (rows keep their order by id), with its own key,
    inserted by the checkpoint that adds it."""
    return StepExecution(
        run=run,
        step_name=name,
        position=position,
        key_version=key_version,
        idempotency_key=idempotency_key(run.workflow_id, name, key_version),
        updated_at=now,
        **fields,
    )


# --- by an operator ------------------------------------------------------------------------


@operator_transition("stop_agent", offered=offers.agent_stoppable, audit_as=AuditAction.AGENT_STOP)
def agent_stop(act: Act) -> None:
    """Stop an agent step now, even while an executor runs it: its lease is fenced off (a call
    in flight then has an unknown outcome, reconciled as any), the journal's rows not yet made
    are left out (nothing is sent for them), the step is held and the run waits for an
    operator — who resumes the run (the agent goes on), forks it from a turn, compensates or
    terminates."""
    run, step_name, who, reason = act.run, act.step_name, act.who, act.reason
    unknown = act.abandon_running()
    agent = act.step
    left_out = []
    for row in journal_rows(step_name, act.situation.steps):
        if row.state in (StepState.PENDING, StepState.WAITING) and not row.attempts:  # waiting: for approval
            _leave_out(row, f"not made: the agent was stopped by {who}: {reason}", act.now, act.actor)
            left_out.append(row.step_name)
    agent.refusal = {"rule": offers.AGENT_STOPPED, "message": f"stopped by {who}: {reason}", "values": {}}
    act.save_step(agent, ["refusal"])
    _check(RUN_TRANSITIONS, "hold", run.state, "run")
    # fence off an executor still running it
    act.release(RunState.NEEDS_REVIEW, f"{step_name}: the agent was stopped by {who}: {reason}", fence=True)
    act.extra.update(left_out=left_out, **({"steps_now_unknown": unknown} if unknown else {}))


@operator_transition("fork_agent", offered=offers.agent_forkable, audit_as=AuditAction.AGENT_FORK)
def agent_fork(act: Act) -> None:
    """Fork an agent step from one of its turns (``step_name``, that turn's row): that turn and
    every later one leave the conversation, with their calls not made yet; the model is asked
    again from the turns before it, and every later turn and call gets a new key version.
    Calls that succeeded stay as they are — their effects stand until an operator compensates
    them, explicitly. A stop is lifted (so is it by resuming the run)."""
    run, who, reason = act.run, act.who, act.reason
    turn = parse_journal_name(act.step_name)
    agent = act.situation.step(turn.agent)
    act.before = _snap(run, agent)
    left_out = []
    for row in journal_rows(turn.agent, act.situation.steps):
        entry = parse_journal_name(row.step_name)
        made = entry.tool is not None and row.state == StepState.SUCCEEDED
        if entry.turn >= turn.turn and row.state != StepState.SKIPPED and not made:
            _leave_out(row, f"left out by {who}'s fork from turn {turn.turn}: {reason}", act.now, act.actor)
            left_out.append(row.step_name)
    agent.key_version += 1  # every later turn and call: a new key version
    agent.state, agent.result, agent.refusal = StepState.PENDING, None, None
    act.save_step(agent, ["key_version", "state", "result", "refusal"])
    _check(RUN_TRANSITIONS, "resume", run.state, "run")
    act.release(RunState.PENDING, f"{turn.agent}: forked from turn {turn.turn} by {who}")
    act.after = {**_snap(run, agent), "key_version": agent.key_version, "left_out": left_out}


def _leave_out(row: StepExecution, why: str, now: datetime, actor: AbstractBaseUser | None) -> None:
    row.state = _check(STEP_TRANSITIONS, "leave_out", row.state, "step")
    row.last_error = redact_text(why)[:4000]
    row.next_attempt_at = None
    _save_step(row, ["state", "last_error", "next_attempt_at"], now, actor)
