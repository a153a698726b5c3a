"""What every operator transition shares, opened and closed in one place: ``acting`` checks the
reason, locks the run (the page's version too), checks the four-eyes rule and the action's
offer (which locks the steps), takes the state before; the body changes the run and its steps
through the ``Act``; on the way out one audit event records the state after, and the executor
is woken if the run became due. ``@operator_transition`` makes a transition of a body alone
(registered with ``@performs``, recovery.engine.transitions.performers)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction

from recovery import clock
from recovery.actions import ACTIONS, FOUR_EYES_ACTIONS
from recovery.engine import dispatch
from recovery.errors import ApprovalRequired
from recovery.models import ApprovalRequest, ApprovalState, RunState, StepExecution, WorkflowRun
from recovery.workflow import workflow_of

from . import offers
from ._core import (
    RUN_LEASE_FIELDS,
    _abandon_running_steps,
    _actor_fields,
    _audit,
    _locked_run_by_id,
    _release_into,
    _save_run,
    _save_step,
    _snap,
    require_reason,
)
from .performers import Rule, performs


@dataclass
class Act:
    """An operator's transition under way: the locked run, its steps as the offer judged them
    (``situation``, locked), and what the audit event will say (``audit_as``, ``before``,
    ``after`` or ``extra`` facts added to the state after)."""

    run: WorkflowRun
    situation: offers.Situation
    actor: AbstractBaseUser | None
    reason: str
    now: datetime
    step_name: str
    audit_as: str
    before: dict[str, Any]
    after: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    wake: bool = False  # the run became due: the executor is told once the transaction commits
    # When a run it releases (``release``) becomes due: None at once; later for a release in waves
    # (recovery.engine.waves: a recovering receiver is not flooded).
    wake_at: datetime | None = None

    @property
    def step(self) -> StepExecution | None:
        """The step the action names (locked), if it names one."""
        return self.situation.step(self.step_name) if self.step_name else None

    @property
    def who(self) -> str:
        return _actor_fields(self.actor)["actor"]

    def abandon_running(self) -> list[str]:
        """Record a step left ``running`` by an executor that lost the run as unknown (the offer
        judged it so already); the state before is taken again, as the operator acts on it."""
        names = _abandon_running_steps(self.run, self.now, self.actor)
        for step in self.situation.steps:
            if step.step_name in names:
                step.refresh_from_db()
        self.before = _snap(self.run, self.step)
        return names

    def save_step(self, step: StepExecution, fields: list[str]) -> None:
        _save_step(step, fields, self.now, self.actor)

    def save_run(self, fields: list[str]) -> None:
        _save_run(self.run, fields, self.now, self.actor)

    def release(self, state: RunState, status: str, *, fence: bool = False, fields: tuple[str, ...] = ()) -> None:
        """The run leaves the operator's hands in ``state`` with ``status`` as its reason; due
        again (the executor woken) unless it is stopped for good or waits for a person.
        ``fence``: an executor still holding a lease can write nothing more."""
        due = state in (RunState.PENDING, RunState.COMPENSATING)  # it goes on by itself: forward, or undoing
        later = self.wake_at if due and self.wake_at and self.wake_at > self.now else None
        _release_into(self.run, state, wake_at=later, reason=status)
        if fence:
            self.run.lease_generation += 1
        self.save_run([*RUN_LEASE_FIELDS, "status_reason", *fields])
        self.wake = self.wake or (due and later is None)  # later: the sweeper's
        if later is not None:
            self.extra["due_at"] = later.isoformat()


@contextmanager
def acting(
    action: str,
    *,
    workflow_id: str,
    actor: AbstractBaseUser | None,
    reason: str,
    expect: str | None,
    now: datetime | None,
    step_name: str | None = None,
    approval: ApprovalRequest | None = None,
    audit_as: str | None = None,
    wake_at: datetime | None = None,
) -> Iterator[Act]:
    """Open and close the operator transition performing ``action`` (recovery.actions): in one
    transaction, refused before anything changes if the reason, the page's version (``expect``),
    the four-eyes rule (``approval``) or the action's offer says no."""
    reason = require_reason(reason)
    now = now or clock.now()
    with transaction.atomic():
        run = _locked_run_by_id(workflow_id, expect)
        _four_eyes(run, action, step_name or "", approval)
        situation = offers.require(action, run, now, step_name=step_name, actor=actor)
        act = Act(
            run=run,
            situation=situation,
            actor=actor,
            reason=reason,
            now=now,
            step_name=step_name or "",
            audit_as=audit_as or action,
            before={},
            wake_at=wake_at,
        )
        act.before = _snap(run, act.step)
        yield act
        after = act.after if act.after is not None else {**_snap(run, act.step), **act.extra}
        _audit(
            run,
            act.audit_as,
            actor=actor,
            step_name=act.step_name,
            reason=reason,
            before=act.before,
            after=after,
            now=now,
        )
        if act.wake:
            dispatch.enqueue_run(run.pk)


def operator_transition(
    action: str, *, offered: Rule, audit_as: str | None = None
) -> Callable[[Callable[..., None]], Callable[..., WorkflowRun]]:
    """The transition performing ``action`` (``@performs``) from its body alone: the body gets the
    ``Act`` (and the action's own arguments: evidence, hours…) inside ``acting``. Callers use the
    transition as any other: ``run_pause(workflow_id=…, actor=…, reason=…)``, plus ``step_name``
    for a step's action, ``approval`` for a four-eyes one and ``wake_at`` for a run released in a
    wave (due then, not at once); it returns the run."""

    def register(body: Callable[..., None]) -> Callable[..., WorkflowRun]:
        @functools.wraps(body)
        def transition(
            *,
            workflow_id: str,
            actor: AbstractBaseUser | None,
            reason: str,
            expect: str | None = None,
            now: datetime | None = None,
            step_name: str | None = None,
            approval: ApprovalRequest | None = None,
            wake_at: datetime | None = None,
            **arguments: Any,
        ) -> WorkflowRun:
            opened = {"workflow_id": workflow_id, "actor": actor, "reason": reason, "expect": expect, "now": now}
            step = {"step_name": step_name, "approval": approval, "audit_as": audit_as, "wake_at": wake_at}
            with acting(action, **step, **opened) as act:
                body(act, **arguments)
                return act.run

        return performs(action, offered=offered)(transition)

    return register


# --- four-eyes: an action, requested by one person, approved by another ------------------

# How a request for each four-eyes action names it (recovery.actions).
LABELS = {name: ACTIONS[name].label for name in FOUR_EYES_ACTIONS}


def needs_approval(run: WorkflowRun, action: str) -> bool:
    """Whether the run's workflow puts ``action`` behind a second supervisor (``four_eyes``)."""
    try:
        return action in workflow_of(run).four_eyes
    except LookupError:
        return False


def _four_eyes(run: WorkflowRun, action: str, step_name: str, approval: ApprovalRequest | None) -> None:
    """Refuse ``action`` unless the workflow lets it run directly or ``approval`` is its
    granted request (approval_grant performs the action with it, in the grant's transaction)."""
    if action not in FOUR_EYES_ACTIONS or not needs_approval(run, action):
        return
    if approval is not None and (approval.run_id, approval.action, approval.step_name) == (run.pk, action, step_name):
        if approval.state == ApprovalState.APPROVED:
            return
    raise ApprovalRequired(
        f"{LABELS[action]} on {run.workflow_name} runs needs a second supervisor's approval: request it on the "
        "run's page (or manage.py approval request)"
    )
