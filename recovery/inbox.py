"""One inbox (issue 38): everything that waits for a person, wherever it waits — a tool call held
for approval (recovery.waiting.ToolApproval), a run waiting for an event a person may send
(``@wf.wait``) or whose wait ran out into review, a four-eyes request — with who may act, the
deadline, what happens at it, and who took it. The console's Inbox page, ``manage.py inbox``
and ``GET /api/inbox`` read this list. Read-only: taking an item is a transition
(``take`` in recovery.engine.transitions.call_approvals)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from recovery.engine.transitions import awaits_decision
from recovery.models import ApprovalRequest, ApprovalState, RunState, StepExecution, StepState
from recovery.permissions import role_named
from recovery.workflow import parse_journal_name, workflow_of

KINDS = {"call": "tool call to approve", "event": "event to send", "four_eyes": "four-eyes request"}
LIMIT = 500  # items read per kind: the oldest first (the overdue ones)


@dataclass(frozen=True)
class Item:
    kind: str  # one of KINDS
    workflow_id: str
    workflow: str
    tenant: str
    step: str
    role: str  # the lowest role that may act on it
    what: str  # the call with its arguments, the event waited for, the action requested
    asked_at: datetime
    deadline: datetime | None
    then: str  # what happens at the deadline
    overdue: bool  # past its deadline (escalated, or gone to review with nobody's decision)
    assignee: str
    requested_by: str = ""  # a four-eyes request's requester (who may not approve it)

    def age(self, now: datetime) -> timedelta:
        return now - self.asked_at

    def as_json(self, now: datetime) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "workflow_id": self.workflow_id,
            "workflow": self.workflow,
            "tenant": self.tenant,
            "step": self.step,
            "role": self.role,
            "what": self.what,
            "asked_at": self.asked_at.isoformat(),
            "age_seconds": int(self.age(now).total_seconds()),
            "deadline": self.deadline.isoformat() if self.deadline else None,
            "then": self.then,
            "overdue": self.overdue,
            "assignee": self.assignee,
            "requested_by": self.requested_by,
        }


def items(
    now: datetime,
    *,
    role: str = "",
    workflow: str = "",
    tenant: str = "",
    older_than: timedelta | None = None,
    kind: str = "",
) -> list[Item]:
    """What waits for a person now, oldest first, filtered: ``role`` the role that may act
    (a supervisor's inbox holds the operators' items too), ``workflow``, ``tenant`` (the run's
    input's ``tenant``), ``older_than`` asked longer ago than that, ``kind``."""
    found = [*_calls_and_waits(), *_four_eyes()]
    return sorted(
        (
            item
            for item in found
            if (not role or role_named(item.role) <= role_named(role))
            and (not workflow or item.workflow == workflow)
            and (not tenant or item.tenant == tenant)
            and (older_than is None or item.age(now) >= older_than)
            and (not kind or item.kind == kind)
        ),
        key=lambda item: (item.asked_at, item.workflow_id, item.step),
    )


def _calls_and_waits() -> list[Item]:
    waiting = StepExecution.objects.filter(state=StepState.WAITING, run__state=RunState.WAITING)
    timed_out = StepExecution.objects.filter(
        state=StepState.FAILED, run__state=RunState.NEEDS_REVIEW, last_error__startswith="no "
    )
    rows = [*waiting.select_related("run")[:LIMIT], *timed_out.select_related("run")[:LIMIT]]
    found = []
    for step in rows:
        try:
            spec = workflow_of(step.run).get_step(step.step_name)
        except LookupError:  # a version this deployment lacks: the run page says so
            continue
        if getattr(spec, "approval", None) is not None and awaits_decision(step):
            found.append(_call(step, spec))
        elif spec.wait is not None and not spec.wait.is_timer:
            found.append(_wait(step, spec))
    return found


def _call(step: StepExecution, spec: Any) -> Item:
    approval = step.approval or {}
    tool = parse_journal_name(step.step_name).tool or step.step_name
    escalated = bool(approval.get("escalated_at"))
    timed_out = step.state == StepState.FAILED
    then = "decided by nobody: the run is in review" if timed_out else spec.approval.on_timeout.text()
    return Item(
        **_where(step),
        kind="call",
        role=approval.get("role", "supervisor"),
        what=f"{tool} {json.dumps(step.intent or {}, sort_keys=True)}",
        asked_at=datetime.fromisoformat(approval["asked_at"]) if "asked_at" in approval else step.updated_at,
        deadline=None if timed_out else step.next_attempt_at,
        then="the run goes to review" if escalated and not timed_out else then,
        overdue=escalated or timed_out,
        assignee=approval.get("assignee", ""),
    )


def _wait(step: StepExecution, spec: Any) -> Item:
    timed_out, held = step.state == StepState.FAILED, step.approval or {}
    escalated = bool(held.get("escalated_at")) and not timed_out
    then = "the run goes to review" if escalated else spec.wait.on_timeout.text()
    return Item(
        **_where(step),
        kind="event",
        role=held.get("role", "operator"),  # recovery.permissions: send_event; escalated: its role
        what=f"event {spec.wait.event!r}",
        asked_at=step.first_attempt_at or step.updated_at,
        deadline=None if timed_out else step.next_attempt_at,
        then="no event came: the run is in review" if timed_out else then,
        overdue=timed_out or escalated,
        assignee=held.get("assignee", ""),
    )


def _four_eyes() -> list[Item]:
    requests = ApprovalRequest.objects.filter(state=ApprovalState.PENDING).select_related("run", "requested_by")
    return [
        Item(
            kind="four_eyes",
            workflow_id=request.run.workflow_id,
            workflow=request.run.workflow_name,
            tenant=str((request.run.input or {}).get("tenant", "")),
            step=request.step_name,
            role="supervisor",
            what=f"{request.action} requested: {request.reason}",
            asked_at=request.requested_at,
            deadline=None,
            then="it waits for a second supervisor",
            overdue=False,
            assignee="",
            requested_by=request.requested_by.get_username(),
        )
        for request in requests.order_by("requested_at")[:LIMIT]
    ]


def _where(step: StepExecution) -> dict[str, str]:
    """The run and step an item is about, and the run input's tenant."""
    run = step.run
    tenant = str((run.input or {}).get("tenant", ""))
    return {"workflow_id": run.workflow_id, "workflow": run.workflow_name, "tenant": tenant, "step": step.step_name}
