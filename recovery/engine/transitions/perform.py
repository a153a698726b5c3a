"""An operator action by its name (recovery.actions): the one entry point the console, bulk,
``manage.py recover`` and an approved four-eyes request go through, to the transition that
performs it (``@performs``, recovery.engine.transitions.performers)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.contrib.auth.models import AbstractBaseUser

from recovery.actions import ACTIONS, StepArg
from recovery.engine import metrics
from recovery.errors import InvalidTransition
from recovery.models import ApprovalRequest, WorkflowRun
from recovery.permissions import role_of

from . import offers
from .performers import performer


def perform(
    action: str,
    *,
    workflow_id: str,
    actor: AbstractBaseUser | str | None,
    reason: str,
    step_name: str | None = None,
    evidence: dict[str, Any] | None = None,
    decision: dict[str, Any] | None = None,
    expect: str | None = None,
    now: datetime | None = None,
    approval: ApprovalRequest | None = None,
    hours: float | None = None,
    version: int | None = None,
    effects_stand: bool = False,
    wake_at: datetime | None = None,
    correction: tuple[str, Any] | None = None,
    key: str | None = None,
) -> WorkflowRun:
    """Perform ``action`` through its transition, which checks the run's state, the reason,
    the page's version (``expect``) and the four-eyes rule. ``correction``: a restart's
    ("input" or "intent", the corrected JSON). ``key``: a tool call's decision's, as its sender
    keys it (recorded with it). A person's role is checked here
    for every surface (NotPermitted); the executor and systems (``actor`` None) are not people.
    A system's label (``"api:monitor"``) acts as a system: its API checked what its token may do.
    Raises InvalidTransition for an unknown action or a missing step, as the transitions do
    for everything else."""
    spec = ACTIONS.get(action)
    if spec is None:
        raise InvalidTransition(f"unknown action {action!r}")
    refused = offers.role_refusal(action, actor)
    if refused is not None:
        raise refused
    if spec.step == StepArg.REQUIRED and not step_name:
        raise InvalidTransition(f"{action} needs a step")
    performed_by = performer(action)
    arguments = {"workflow_id": workflow_id, "actor": actor, "reason": reason, "expect": expect, "now": now}
    arguments.update(performed_by.options)
    if spec.step != StepArg.NONE:
        arguments["step_name"] = step_name or None
    if spec.evidence:
        arguments["evidence"] = evidence  # checked at the receiver first: recovery.engine.evidence
    elif evidence is not None:
        raise InvalidTransition(f"{action} takes no evidence")
    if spec.decision:
        if decision is None:
            raise InvalidTransition(f"{action} needs the new decision (JSON)")
        arguments["decision"] = decision
    if spec.duration:
        arguments["hours"] = hours
    elif hours is not None:
        raise InvalidTransition(f"{action} takes no duration")
    if spec.version:
        arguments.update(version=version, effects_stand=effects_stand)
    elif version is not None:
        raise InvalidTransition(f"{action} takes no version")
    if spec.correction:
        if correction is None:
            raise InvalidTransition(f"{action} needs the corrected input or the step's corrected intent (JSON)")
        edited, value = correction
        arguments.update(edited=edited, value=value, effects_stand=effects_stand)
    elif correction is not None:
        raise InvalidTransition(f"{action} takes no corrected input")
    if spec.keyed:
        arguments["key"] = key or ""
    elif key:
        raise InvalidTransition(f"{action} takes no idempotency key")
    if spec.waves:
        arguments["wake_at"] = wake_at  # a run released in a wave: due then (transitions.waves)
    elif wake_at is not None:
        raise InvalidTransition(f"{action} makes no run due: it has no wave to be released in")
    if approval is not None:
        arguments["approval"] = approval
    run = performed_by.transition(**arguments)
    person = actor is not None and not isinstance(actor, str)
    metrics.operator_action(action, role_of(actor).name.lower() if person else "system")
    return run
