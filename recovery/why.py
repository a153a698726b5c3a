""" "Why is this run not moving?": one sentence computed from a run's state, its steps, its
outbox and its four-eyes requests — the same on the runs list, the run page and ``show_run``.

Pure: it reads what it is given (``for_page`` loads what a page of runs needs in two queries).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from datetime import datetime

from django.utils.timezone import localtime

from recovery import executors, registry
from recovery.actions import ACTIONS
from recovery.clock import time_of_day
from recovery.engine.transitions import (
    AGENT_STOPPED,
    TERMINAL_RUN_STATES,
    UNDONE_STEP_STATES,
    lease_is_live,
    pausing,
)
from recovery.errors import ErrorKind
from recovery.models import (
    IN_PROGRESS_RUN_STATES,
    ApprovalRequest,
    ApprovalState,
    OutboxMessage,
    OutboxState,
    RunState,
    StepExecution,
    StepState,
    WorkflowPause,
    WorkflowRun,
)
from recovery.validation import problem_count
from recovery.workflow import all_workflows, workflow_of


def _at(when: datetime | None) -> str:
    """A time of day with its zone ("12:03:04 UTC"), as every page says it."""
    return time_of_day(when) if when is not None else "—"


def _error(step: StepExecution, limit: int = 120) -> str:
    text = " ".join(step.last_error.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _attempt_of(run: WorkflowRun, step: StepExecution) -> str:
    """ "attempt 3 of 6": the next attempt within the step's current budget."""
    try:
        maximum = workflow_of(run).get_step(step.step_name).retry.maximum_attempts
    except LookupError:
        return f"attempt {step.attempts + 1}"
    return f"attempt {step.attempts - step.budget_start_attempt + 1} of {maximum}"


def why_not_moving(
    run: WorkflowRun,
    steps: Sequence[StepExecution],
    *,
    now: datetime,
    approvals: Iterable[ApprovalRequest] = (),
    outbox: Iterable[OutboxMessage] = (),
    executor_live: bool | None = None,
    workflow_paused: WorkflowPause | None | bool = False,
) -> str:
    """One sentence: what the run waits for, or what a person must do. ``executor_live``: whether
    some executor is live (recovery.executors), when the caller knows; else read here, only for a
    run that waits for one. ``workflow_paused``: the pause in force of the run's whole workflow
    (None: none), when the caller knows (``whole_pauses``); else read here, only for a pending run."""
    steps = sorted(steps, key=lambda s: s.order)
    pending = [a for a in approvals if a.state == ApprovalState.PENDING]
    state = run.state
    if pending:
        request = pending[0]
        label = ACTIONS[request.action].label if request.action in ACTIONS else request.action
        on = f" {request.step_name}" if request.step_name else ""
        return f"waiting for a supervisor to approve {label}{on} (requested by {request.requested_by.get_username()})"
    undone = [s.step_name for s in steps if s.state in UNDONE_STEP_STATES]
    if state == RunState.COMPLETED:
        return f"completed; {', '.join(undone)} compensated since" if undone else "completed"
    if state == RunState.COMPENSATED:
        return f"compensated: {run.status_reason}" if run.status_reason else "compensated"
    if state == RunState.TERMINATED:
        return f"terminated: {run.status_reason}"
    if state == RunState.PAUSED:
        if run.workflow_pause_id is not None:
            return f"{run.status_reason}; it goes on when that pause is released (nothing new starts meanwhile)"
        return f"{run.status_reason}; unpause it to go on (nothing new starts meanwhile)"
    if pausing(run):
        return (
            f"pausing, asked by {run.paused_by} at {_at(run.paused_at)} ({run.pause_reason}): the call in flight "
            "finishes and is recorded first, then the run stops"
        )
    if state == RunState.RUNNING and lease_is_live(run, now):
        doing = f", running {run.current_step}" if run.current_step else ""
        return f"held by executor {run.lease_owner} until {_at(run.lease_expires_at)} (lease){doing}"
    if state in IN_PROGRESS_RUN_STATES and not registry.has(run.workflow_name, run.workflow_version):
        return version_not_deployed(run)
    since = executors.unclaimed_since(run, now)
    if since is not None and not (executors.any_live(now) if executor_live is None else executor_live):
        return no_executor(run, since)
    if state == RunState.RUNNING:
        return (
            f"the lease of {run.lease_owner or 'its executor'} expired at {_at(run.lease_expires_at)}: "
            "waiting for another executor to take the run over"
        )
    if run.reserved_for and run.reserved_until and run.reserved_until > now and state not in TERMINAL_RUN_STATES:
        return f"reserved for {run.reserved_for} until {_at(run.reserved_until)}: other executors leave it alone"
    if state == RunState.PENDING:
        p = kept_by(run, whole_pauses([run]) if workflow_paused is False else {run.workflow_name: workflow_paused})
        if p is not None:
            return (
                f"kept pending: workflow {p.workflow_name} paused by {p.paused_by} at {_at(p.paused_at)}: {p.reason}; "
                "it starts when the workflow is unpaused"
            )
        return "due now: waiting for an executor to claim it"
    if state == RunState.COMPENSATING:
        marked = [s for s in steps if s.state == StepState.COMPENSATING]
        names = ", ".join(s.step_name for s in reversed(marked)) or "its effects"
        wake = f"; next attempt at {_at(run.next_wake_at)}" if run.next_wake_at and run.next_wake_at > now else ""
        return f"compensating {names}{wake}"
    if state == RunState.COMPENSATION_FAILED:
        failed = next((s for s in steps if s.state == StepState.COMPENSATION_FAILED), None)
        what = f"the compensation of {failed.step_name} failed" if failed else "a compensation failed"
        return f"{what}: {run.status_reason}; compensate again once the cause is fixed, or terminate"
    refused = next((s for s in steps if s.refusal and s.state != StepState.SKIPPED), None)  # skipped: answered
    if refused is not None and state == RunState.NEEDS_REVIEW:
        rule = refused.refusal.get("rule", "")
        if rule == AGENT_STOPPED:
            return agent_stopped(refused)
        return (
            f"paused: policy refused {refused.step_name} ({rule}: {refused.refusal.get('message', '')}); "
            "change the decision, or a supervisor accepts the proposal"
        )
    if state == RunState.WAITING:
        return _waiting(run, steps, outbox, now)
    if state == RunState.NEEDS_REVIEW:
        return _review(run, steps, outbox)
    if state == RunState.FAILED:
        return _failed(run, steps)
    return run.status_reason or state


def agent_stopped(agent: StepExecution) -> str:
    """ "agent X stopped by olga at 03:12:00 UTC (…): …": who stopped it and when (the agent
    step is not written again while it is held), why, and the two ways on."""
    who, _, reason = agent.refusal.get("message", "stopped").partition(": ")
    at = f" at {localtime(agent.updated_at):%H:%M:%S %Z}" if agent.updated_at else ""
    because = f" ({reason})" if reason else ""
    return f"agent {agent.step_name} {who}{at}{because}: resume to let it go on, or fork it from a turn"


def no_executor(run: WorkflowRun, since: datetime) -> str:
    """A run due (or whose lease expired) longer than the silent threshold, with no executor live."""
    at = f"{localtime(since):%H:%M:%S %Z}"
    if run.state == RunState.RUNNING:
        was = f"the lease of {run.lease_owner or 'its executor'} expired at {at}"
    else:
        was = f"due since {at}"
    return f"{was}, but no executor is running: {executors.START_HINT}"


def version_not_deployed(run: WorkflowRun) -> str:
    """Why a run whose version this deployment lacks does not move, and the two ways out."""
    started = f"started under {run.workflow_name} v{run.workflow_version}"
    if registry.current_version(run.workflow_name) is None:
        return f"{started}; this deployment has no {run.workflow_name} workflow: deploy it again, or terminate the run"
    has = registry.versions_text(run.workflow_name)
    return f"{started}; this deployment has {has}: deploy v{run.workflow_version} again, or move the run"


def _waiting(run: WorkflowRun, steps: list[StepExecution], outbox: Iterable[OutboxMessage], now: datetime) -> str:
    if any(s.state == StepState.WAITING for s in steps):  # a durable wait says what for, until when, and then what
        return run.status_reason
    due = next((s for s in steps if s.next_attempt_at is not None and s.state not in UNDONE_STEP_STATES), None)
    if due is not None and due.state == StepState.UNKNOWN:
        return f"outcome of {due.step_name} unknown: looking it up again at {_at(due.next_attempt_at)}"
    if due is not None and due.state == StepState.FAILED:
        kind = f"{due.last_error_kind}: " if due.last_error_kind else ""
        return f"retrying {due.step_name} at {_at(due.next_attempt_at)} ({_attempt_of(run, due)}; {kind}{_error(due)})"
    if due is not None and due.last_error:  # a guard could not read the state it checks
        return f"checking {due.step_name} again at {_at(due.next_attempt_at)} ({_error(due)})"
    waiting = [m for m in outbox if m.state == OutboxState.PENDING]
    if waiting:
        message = waiting[0]
        since = f" since {_at(message.created_at)}"
        error = f" ({message.last_error[:100]})" if message.last_error else ""
        return f"message of {message.step_name} not delivered{since}{error}; next attempt at {_at(run.next_wake_at)}"
    return f"{run.status_reason}; wakes at {_at(run.next_wake_at)}"


def _settle(run: WorkflowRun, step: StepExecution) -> str:
    """How an unknown outcome can be settled by a person: by key, or with evidence only where the
    step says how its evidence is checked (recovery.engine.evidence)."""
    try:
        checkable = bool(workflow_of(run).get_step(step.step_name).evidence_rule())
    except LookupError:
        checkable = True  # a version this deployment lacks: its page says so
    if checkable:
        return "look it up by key, or settle it with evidence the receiver confirms"
    return (
        "look it up by key; evidence cannot be recorded for it, as its receiver cannot be asked by id and "
        "it declares no result schema"
    )


def _review(run: WorkflowRun, steps: list[StepExecution], outbox: Iterable[OutboxMessage]) -> str:
    unknown = next((s for s in steps if s.state == StepState.UNKNOWN), None)
    if unknown is not None:
        return f"outcome of {unknown.step_name} unknown: an operator must reconcile it ({_settle(run, unknown)})"
    failed = next((s for s in steps if s.state == StepState.FAILED), None)
    if failed is not None and failed.last_error_kind == ErrorKind.INVALID_MODEL_OUTPUT:
        problems = problem_count(failed.last_error)
        last = f" (the last one with {problems} problem{'' if problems == 1 else 's'})" if problems else ""
        return (
            f"paused: the model's output for {failed.step_name} did not match its schema {failed.format_failures} "
            f"times{last}; write the decision by hand (supervisor) or ask the model again"
        )
    if failed is not None:
        return (
            f"paused: {failed.step_name} failed after {failed.attempts} attempt(s) "
            f"({failed.last_error_kind or 'error'}: {_error(failed)}); retry or resume once the cause is fixed"
        )
    undelivered = next((m for m in outbox if m.state == OutboxState.FAILED), None)
    if undelivered is not None:
        return (
            f"paused: the message of {undelivered.step_name} was not delivered after {undelivered.attempts} "
            f"attempt(s) ({undelivered.last_error[:100]}); resume once the messenger accepts it"
        )
    return f"paused for review: {run.status_reason}"


def _failed(run: WorkflowRun, steps: list[StepExecution]) -> str:
    failed = next((s for s in steps if s.state == StepState.FAILED), None)
    where = f"failed at {failed.step_name} ({_error(failed)})" if failed else f"failed: {run.status_reason}"
    try:
        workflow = workflow_of(run)
        made = [s.step_name for s in steps if s.state == StepState.SUCCEEDED and workflow.writes(s.step_name)]
    except LookupError:
        made = []
    if made:
        return f"{where}; effects made by {', '.join(made)} stand: compensate them, or terminate to keep them"
    return f"{where}; nothing was written elsewhere"


# What the sentence reads of a step: a page of runs loads no intent, result or decision.
WHY_STEP_FIELDS = (
    "run_id",
    "step_name",
    "position",
    "state",
    "attempts",
    "budget_start_attempt",
    "format_failures",
    "last_error_kind",
    "last_error",
    "next_attempt_at",
    "refusal",
    "updated_at",
)


def whole_pauses(runs: Iterable[WorkflowRun]) -> dict[str, WorkflowPause]:
    """The pauses in force of whole workflows, by name, where one of ``runs`` is pending (one
    query then; none otherwise): what keeps those runs pending."""
    names = {run.workflow_name for run in runs if run.state == RunState.PENDING}
    if not names:
        return {}
    found = WorkflowPause.objects.filter(workflow_name__in=names, step_name="", released_at__isnull=True)
    return {p.workflow_name: p for p in found}


def kept_by(run: WorkflowRun, pauses: dict[str, WorkflowPause | None]) -> WorkflowPause | None:
    """The pause of its whole workflow that keeps a pending run pending (``pauses``: by workflow,
    ``whole_pauses``), unless the run is a canary released from it."""
    pause = pauses.get(run.workflow_name) if run.state == RunState.PENDING else None
    return pause if pause is not None and run.workflow_pause_id != pause.pk else None


def for_page(runs: list[WorkflowRun], *, now: datetime) -> None:
    """Set ``run.why`` (and ``run.partly_compensated``) on each run of a list page: their steps
    in one query (the undone steps of the completed ones in another), and their pending
    four-eyes requests in another where a workflow has four-eyes actions (none for a page of
    finished runs)."""
    moving = [r.pk for r in runs if r.state not in TERMINAL_RUN_STATES]
    completed = [r.pk for r in runs if r.state == RunState.COMPLETED]
    steps: dict[int, list[StepExecution]] = defaultdict(list)
    approvals: dict[int, list[ApprovalRequest]] = defaultdict(list)
    if moving:
        for step in StepExecution.objects.filter(run_id__in=moving).only(*WHY_STEP_FIELDS):
            steps[step.run_id].append(step)
    if completed:  # of a completed run, only the steps undone since (partly compensated)
        undone = StepExecution.objects.filter(run_id__in=completed, state__in=UNDONE_STEP_STATES)
        for step in undone.only(*WHY_STEP_FIELDS):
            steps[step.run_id].append(step)
    if moving and any(workflow.four_eyes for workflow in all_workflows()):
        pending = ApprovalRequest.objects.filter(run_id__in=moving, state=ApprovalState.PENDING)
        for request in pending.select_related("requested_by"):
            approvals[request.run_id].append(request)
    waiting = any(executors.unclaimed_since(run, now) is not None for run in runs)
    live = executors.any_live(now) if waiting else True  # one query, for a page that needs it
    paused = whole_pauses(runs)
    for run in runs:
        run.why = why_not_moving(
            run,
            steps[run.pk],
            now=now,
            approvals=approvals[run.pk],
            executor_live=live,
            workflow_paused=paused.get(run.workflow_name),
        )
        run.partly_compensated = run.state == RunState.COMPLETED and any(
            s.state == StepState.COMPENSATED for s in steps[run.pk]
        )
