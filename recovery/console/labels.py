"""What state a step (or an agent's journal row) is in, as the run page says it: one function for
the steps table and the conversation, so that they never disagree.

A next attempt is shown only while the run moves by itself (pending, waiting, running or
compensating): a held, stopped or finished run has none, whatever the row still records. A next
attempt already due reads "due now", never a time in the past. Every time carries its zone."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.utils.timezone import localtime

from recovery.clock import time_of_day
from recovery.engine.transitions import lease_is_live
from recovery.models import AGENT_STOPPED, IN_PROGRESS_RUN_STATES, RunState, StepExecution, StepState, WorkflowRun
from recovery.waiting import a_role


@dataclass(frozen=True)
class StateLabel:
    """``text`` the state in words ("Retrying at 12:03:04 UTC"), ``css`` its class, ``next`` the
    next-attempt column ("12:03:04 UTC", "due now" or "—"), ``attempts`` the attempts column."""

    text: str
    css: str
    next: str
    attempts: str


def at(when: datetime) -> str:
    """A time of day with its zone: "12:03:04 UTC" (recovery.clock.time_of_day, as every page says it)."""
    return time_of_day(when)


def moves_by_itself(run: WorkflowRun) -> bool:
    """An executor takes the run on without a person: its steps' next attempts will happen."""
    return run.state in IN_PROGRESS_RUN_STATES


def run_wake(run: WorkflowRun, *, now: datetime) -> str:
    """The run's next wake-up, as its page's head shows it: "2026-12-03 14:03:10 UTC", "due now"
    (never a time in the past), or "—" (none, or the run does not move by itself)."""
    wake = run.next_wake_at if moves_by_itself(run) else None
    if wake is None:
        return "—"
    return f"{localtime(wake):%Y-%m-%d %H:%M:%S %Z}" if wake > now else "due now"


def _due(run: WorkflowRun, now: datetime) -> str:
    if run.state == RunState.RUNNING and lease_is_live(run, now):
        return "now"
    return "due now, waiting for an executor"


def step_label(
    step: StepExecution, *, run: WorkflowRun, now: datetime, agent: dict[str, Any] | None = None
) -> StateLabel:
    """The state of ``step`` as the run page shows it; ``agent`` is the step's conversation
    (``selectors.conversations``) when it is an agent step: then its row says its turn."""
    if agent is not None and step.state == StepState.PENDING:
        return _agent_label(step, run=run, now=now, agent=agent)
    wake = step.next_attempt_at if moves_by_itself(run) else None
    attempts = _journal(agent) if agent is not None else str(step.attempts)
    if wake is None:
        return StateLabel(step.get_state_display(), f"step-{step.state}", "—", attempts)
    when, column = (f"at {at(wake)}", at(wake)) if wake > now else (_due(run, now), "due now")
    if step.state == StepState.FAILED:
        return StateLabel(f"Retrying {when}", "step-retrying", column, attempts)
    if step.state == StepState.UNKNOWN:
        return StateLabel(f"Unknown: looking it up again {when}", "step-unknown", column, attempts)
    if step.state == StepState.PENDING:
        return StateLabel(f"Waiting, next check {when}", "step-retrying", column, attempts)
    return StateLabel(step.get_state_display(), f"step-{step.state}", column, attempts)


def _agent_label(step: StepExecution, *, run: WorkflowRun, now: datetime, agent: dict[str, Any]) -> StateLabel:
    turns: Sequence[dict[str, Any]] = agent["turns"]
    number = turns[-1]["number"] if turns else 0
    attempts = _journal(agent)
    if step.refusal and step.refusal.get("rule") == AGENT_STOPPED:
        return StateLabel(f"Stopped at turn {number} of at most {agent['max_turns']}", "step-failed", "—", attempts)
    if not moves_by_itself(run):
        doing, css, column = f"held ({run.get_state_display().lower()})", "step-pending", "—"
    else:
        doing, css, column = _doing(turns, run=run, now=now)
        if doing == "asking the model" and turns and turns[-1]["row"].state == StepState.SUCCEEDED:
            number += 1  # its calls are done: the next turn is asked
    return StateLabel(f"Turn {max(number, 1)} of at most {agent['max_turns']}: {doing}", css, column, attempts)


def _journal(agent: dict[str, Any]) -> str:
    """An agent step's attempts column: "2 turns, 3 calls"."""
    turns = len(agent["turns"])
    calls = sum(len(t["calls"]) for t in agent["turns"])
    return f"{turns} turn{'s' if turns != 1 else ''}, {calls} call{'s' if calls != 1 else ''}"


def _doing(turns: Sequence[dict[str, Any]], *, run: WorkflowRun, now: datetime) -> tuple[str, str, str]:
    """What a moving agent does now, from its journal's last turn: (words, css, next column)."""
    if not turns:
        return "asking the model", "step-running", "—"
    last = turns[-1]
    rows = [last["row"]] if last["row"].state != StepState.SUCCEEDED else []
    rows += [c["row"] for c in last["calls"] if c["row"].state not in _SETTLED]
    if not rows:
        return "asking the model", "step-running", "—"
    row = rows[0]
    doing = "ask the model" if row is last["row"] else f"call {_tool(last, row)}"
    if row.state == StepState.WAITING and row.approval:  # held for a person (transitions.call_approvals)
        role, wake = row.approval.get("role", "supervisor"), row.next_attempt_at
        until = f" until {at(wake)}" if wake is not None else ""
        return f"{_tool(last, row)} waits for {a_role(role)}'s approval{until}", "step-waiting", "—"
    if row.next_attempt_at is not None:
        wake = row.next_attempt_at
        when, column = (f"at {at(wake)}", at(wake)) if wake > now else (_due(run, now), "due now")
        return f"waiting to {doing} again {when}", "step-retrying", column
    if row is last["row"]:
        return "asking the model", "step-running", "—"
    return f"calling tools ({_tool(last, row)})", "step-running", "—"


def _tool(turn: dict[str, Any], row: StepExecution) -> str:
    return next(c["tool"] for c in turn["calls"] if c["row"] is row)


_SETTLED = frozenset({StepState.SUCCEEDED, StepState.SKIPPED, StepState.COMPENSATED})


def list_state(run: WorkflowRun) -> tuple[str, str]:
    """The runs list's state cell (label, css): a completed run some of whose effects were
    undone since reads "Completed, partly compensated" (``run.partly_compensated``, set by
    ``why.for_page``), as on its page."""
    if getattr(run, "partly_compensated", False):
        return "Completed, partly compensated", "state-partly"
    return run.get_state_display(), f"state-{run.state}"
