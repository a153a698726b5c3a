"""Four-eyes: an action requested by one supervisor and approved (or rejected) by another; the
grant performs the action in the grant's transaction."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, transaction

from recovery import clock, permissions, text
from recovery.actions import ACTIONS
from recovery.errors import InvalidTransition, RunChanged
from recovery.models import ApprovalRequest, ApprovalState, WorkflowRun
from recovery.redaction import redact_text
from recovery.states import AuditAction

from . import offers
from ._core import _audit, _locked_run_by_id, _snap, require_reason, run_version
from .acting import LABELS, needs_approval
from .operator import checked_evidence
from .perform import perform
from .restarts import planned
from .versions import planned_move


def _perform(request: ApprovalRequest, *, actor: AbstractBaseUser, reason: str, expect: str | None, now: datetime):
    return perform(
        request.action,
        workflow_id=request.run.workflow_id,
        actor=actor,
        reason=reason,
        step_name=request.step_name or None,
        expect=expect,
        now=now,
        approval=request,
        **(request.options or {}),
    )


def _would_run(request: ApprovalRequest, *, actor: AbstractBaseUser, now: datetime) -> None:
    """A request is made only for an action that would run now: the action's offer for the
    requester (the run's state and steps, who may compensate what: offers.why_not), and what it
    is asked with — the evidence's shape, the version the run would move to — checked as its
    transition checks them. Its InvalidTransition is the requester's answer; nothing is run."""
    refused = offers.role_refusal(request.action, actor)
    if refused is not None:
        raise refused
    situation = offers.require(request.action, request.run, now, step_name=request.step_name or None, actor=actor)
    options = request.options or {}
    if ACTIONS[request.action].evidence:
        checked_evidence(options.get("evidence"))
    if ACTIONS[request.action].version:
        planned_move(request.run, situation.steps, options.get("version"), options.get("effects_stand", False))
    if ACTIONS[request.action].correction:
        edited, value = options.get("correction") or (None, None)
        planned(situation, request.step_name, edited=edited, value=value, effects_stand=options.get("effects_stand"))


def _approval_snap(request: ApprovalRequest) -> dict[str, Any]:
    snap = {"id": request.pk, "action": request.action, "state": request.state}
    if request.step_name:
        snap["step"] = request.step_name
    if request.remote_ref:
        snap["remote_ref"] = request.remote_ref
    if request.options:
        snap.update({k: v for k, v in request.options.items() if k != "evidence"})
        if "evidence" in request.options:
            snap["checked"] = request.options["evidence"].get("checked", "")
    return snap


def approval_request(
    *,
    workflow_id: str,
    action: str,
    actor: AbstractBaseUser,
    reason: str,
    step_name: str | None = None,
    evidence: dict[str, Any] | None = None,
    version: int | None = None,
    effects_stand: bool = False,
    correction: tuple[str, Any] | None = None,
    expect: str | None = None,
    now: datetime | None = None,
) -> ApprovalRequest:
    """Ask for ``action`` on a run whose workflow puts it behind four eyes. The action must be
    one the run allows now (and the actor's own role); nothing changes on the run until
    another supervisor approves. One pending request per action and step."""
    reason = require_reason(reason)
    if actor is None or not getattr(actor, "is_authenticated", False):
        raise InvalidTransition("only a person can request an action")
    if action not in LABELS:
        raise InvalidTransition(f"{action!r} does not need approval")
    now = now or clock.now()
    with transaction.atomic():
        run = _locked_run_by_id(workflow_id, expect)
        if not needs_approval(run, action):
            raise InvalidTransition(f"{LABELS[action]} needs no approval on {run.workflow_name} runs: do it directly")
        request = ApprovalRequest(
            run=run,
            action=action,
            step_name=step_name or "",
            remote_ref=redact_text((evidence or {}).get("remote_ref", "")),
            options=_options(action, version, effects_stand, evidence, correction),
            reason=redact_text(reason),
            state=ApprovalState.PENDING,
            requested_by=actor,
            requested_at=now,
        )
        _would_run(request, actor=actor, now=now)
        try:
            with transaction.atomic():
                request.save()
        except IntegrityError:
            raise InvalidTransition(f"a request to {LABELS[action]} is already waiting for approval") from None
        _approval_audit(run, request, AuditAction.APPROVAL_REQUEST, actor=actor, reason=reason, now=now)
        return request


def _options(
    action: str,
    version: int | None,
    effects_stand: bool,
    evidence: dict[str, Any] | None,
    correction: tuple[str, Any] | None = None,
) -> dict[str, Any] | None:
    """What else the requested action is performed with (recovery.actions): a move's version,
    the evidence of "it succeeded" as it was checked when the request was made, a restart's
    correction."""
    if ACTIONS[action].correction:
        if correction is None:
            raise InvalidTransition(f"{action} needs the corrected input or the step's corrected intent (JSON)")
        return {"correction": list(correction), "effects_stand": bool(effects_stand)}
    if correction is not None:
        raise InvalidTransition(f"{action} takes no corrected input")
    if ACTIONS[action].evidence:
        return {"evidence": evidence} if evidence is not None else None
    if evidence is not None:
        raise InvalidTransition(f"{action} takes no evidence")
    if not ACTIONS[action].version:
        if version is not None:
            raise InvalidTransition(f"{action} takes no version")
        return None
    return {"version": version, "effects_stand": bool(effects_stand)}


def _locked_request(request_id: int | str) -> tuple[WorkflowRun, ApprovalRequest]:
    try:
        pk = int(request_id)
    except (TypeError, ValueError):
        raise InvalidTransition(f"no approval request {request_id!r}") from None
    run_pk = ApprovalRequest.objects.filter(pk=pk).values_list("run_id", flat=True).first()
    if run_pk is None:
        raise InvalidTransition(f"no approval request {request_id!r}")
    run = WorkflowRun.objects.select_for_update().get(pk=run_pk)  # lock order: run, then its rows
    request = ApprovalRequest.objects.select_for_update().select_related("requested_by").get(pk=pk)
    request.run = run
    if request.state != ApprovalState.PENDING:
        raise InvalidTransition(f"approval request {pk} is already {request.state}")
    return run, request


def approval_grant(
    *,
    request_id: int | str,
    actor: AbstractBaseUser,
    reason: str,
    expect: str | None = None,
    now: datetime | None = None,
) -> WorkflowRun:
    """A second supervisor approves, with a reason like every operator action: the approval is
    audited, then the action runs, in one transaction (if the action is no longer valid,
    neither happens and the request waits). Nobody approves their own request."""
    now = now or clock.now()
    if actor is None or not permissions.can(actor, "approve"):
        raise InvalidTransition("only a supervisor can approve")
    reason = require_reason(reason)
    with transaction.atomic():
        run, request = _locked_request(request_id)
        if request.requested_by_id == actor.pk:
            raise InvalidTransition("you cannot approve your own request: another supervisor must")
        if expect is not None and expect != run_version(run):
            raise RunChanged(f"run {run.workflow_id} changed since you loaded it (it is now {run.state}); reload")
        _decide(request, ApprovalState.APPROVED, actor=actor, reason=reason, now=now)
        requester = request.requested_by.get_username()
        _approval_audit(
            run,
            request,
            AuditAction.APPROVAL_GRANT,
            actor=actor,
            reason=request.decision_reason,
            now=now,
            requested_by=requester,
        )
        who = f"requested by {requester}, approved by {actor.get_username()}"
        return _perform(request, actor=actor, reason=_performed_reason(request.reason, who), expect=None, now=now)


def _performed_reason(requested: str, who: str, *, max_length: int = 2000) -> str:
    """The reason the approved action runs with: the request's, then who asked and who
    approved, within a reason's bounds even for a request stored before they were checked
    (control characters shown as escapes, the request's words cut to fit)."""
    suffix = f" ({who})"
    requested = text.printable(requested, multiline=True)
    room = max_length - len(suffix)
    if len(requested) > room:
        requested = requested[: room - 1] + "…"
    return requested + suffix


def approval_reject(
    *, request_id: int | str, actor: AbstractBaseUser, reason: str, now: datetime | None = None
) -> ApprovalRequest:
    """Turn a pending request down (a supervisor) or withdraw it (its requester). The run
    does not change."""
    reason = require_reason(reason)
    now = now or clock.now()
    with transaction.atomic():
        run, request = _locked_request(request_id)
        if actor is None or (request.requested_by_id != actor.pk and not permissions.can(actor, "approve")):
            raise InvalidTransition("only a supervisor, or the requester, can turn a request down")
        _decide(request, ApprovalState.REJECTED, actor=actor, reason=reason, now=now)
        _approval_audit(run, request, AuditAction.APPROVAL_REJECT, actor=actor, reason=reason, now=now)
        return request


def approval_decide(
    decision: str,
    *,
    request_id: int | str | None,
    workflow_id: str,
    actor: AbstractBaseUser,
    reason: str,
    expect: str | None = None,
    now: datetime | None = None,
) -> ApprovalRequest:
    """``approve`` or ``reject`` request ``request_id`` of run ``workflow_id``: the run page's
    and ``recover``'s way (a request of another run is refused). Returns the request, decided."""
    if decision not in ("approve", "reject"):
        raise InvalidTransition(f"unknown decision {decision!r}: approve or reject")
    text = str(request_id or "")
    pk = int(text) if text.isdigit() and len(text) < 19 else None
    request = ApprovalRequest.objects.filter(pk=pk, run__workflow_id=workflow_id).first() if pk else None
    if request is None:
        raise InvalidTransition(f"no approval request {request_id!r} on this run")
    if decision == "reject":
        approval_reject(request_id=request.pk, actor=actor, reason=reason, now=now)
    else:
        approval_grant(request_id=request.pk, actor=actor, reason=reason, expect=expect, now=now)
    return ApprovalRequest.objects.select_related("run").get(pk=request.pk)


def _decide(request: ApprovalRequest, state: ApprovalState, *, actor: AbstractBaseUser, reason: str, now: datetime):
    request.state = state
    request.decided_by = actor
    request.decided_at = now
    request.decision_reason = redact_text(reason)  # require_reason's: stripped, checked
    request.save(update_fields=["state", "decided_by", "decided_at", "decision_reason"])


def _approval_audit(
    run: WorkflowRun,
    request: ApprovalRequest,
    action: str,
    *,
    actor: AbstractBaseUser,
    reason: str,
    now: datetime,
    **extra: Any,
) -> None:
    """The audit event of a step of four-eyes: the run does not change; the request does."""
    approval = {**_approval_snap(request), **extra}
    _audit(
        run,
        action,
        actor=actor,
        step_name=request.step_name,
        reason=reason,
        before=_snap(run),
        after={**_snap(run), "approval": approval},
        now=now,
    )
