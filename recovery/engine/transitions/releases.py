"""Releasing a workflow's pause (issue 37), so that a receiver coming back is not flooded.

A supervisor may first release a **canary**: the oldest few runs the pause holds (or keeps
pending) go on while the pause stays in force for every other run — each canary names the pause
(``WorkflowRun.workflow_pause``) and passes it: the claim, the write of a new attempt and the
locked draft all let it by. Their outcomes show on the dashboard. Then the pause is released and
the rest go on, at once or **in waves** (transitions.waves): each run due at its wave's time, with
jitter. Every run released is audited (``unpause``) with who, why, whether it is a canary and
when it is due."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction

from recovery import clock
from recovery.engine import dispatch
from recovery.errors import InvalidTransition, PauseConflict
from recovery.models import RunState, WorkflowPause, WorkflowRun
from recovery.redaction import redact_text
from recovery.states import pause_scope

from ._core import RUN_LEASE_FIELDS, _actor_fields, _audit, _release_into, _save_run, _snap, require_reason
from .pauses import PAUSE_FIELDS, resumed_state
from .waves import Waves
from .workflow_pauses import _require_supervisor

MAX_CANARY = 100


def workflow_unpause(
    *,
    workflow: str,
    step_name: str = "",
    actor: AbstractBaseUser | str,
    reason: str,
    now: datetime | None = None,
    canary: int = 0,
    waves: Waves = Waves(),
) -> dict[str, Any]:
    """Release the pause in force of ``workflow`` (or of its step ``step_name``) and the runs it
    holds — and, a whole workflow's, the runs it kept pending — at once or in ``waves``. With
    ``canary``: only that many of them, the oldest, while the pause stays in force. Returns
    ``{"pause", "released": [workflow ids], "due": {workflow id: when, for a later wave},
    "canary": bool}``."""
    reason = require_reason(reason)
    _require_supervisor(actor, "unpause a workflow")
    if not 0 <= canary <= MAX_CANARY:
        raise InvalidTransition(f"a canary is 1 to {MAX_CANARY} runs (got {canary})")
    now = now or clock.now()
    who = _actor_fields(actor)["actor"]
    with transaction.atomic():
        pause = (
            WorkflowPause.objects.select_for_update()
            .filter(workflow_name=workflow, step_name=step_name, released_at__isnull=True)
            .first()
        )
        if pause is None:
            raise PauseConflict(f"{pause_scope(workflow, step_name)} is not paused")
        if not canary:
            pause.released_at, pause.released_by, pause.release_reason = now, who, redact_text(reason)
            pause.save(update_fields=["released_at", "released_by", "release_reason"])
    runs = waiting_for(pause)
    if canary:
        runs, due = runs[:canary], [None] * min(canary, len(runs))
        if not runs:
            raise InvalidTransition(f"{pause.scope} holds no run to release as a canary")
        said = f"canary of {pause.scope}: {reason}"
    else:
        due = waves.due_times(len(runs), now)
        said = f"{pause.scope} unpaused: {reason}"
    released, later = [], {}
    for run_pk, wake_at in zip(runs, due, strict=True):
        run = _release(run_pk, pause, actor=actor, reason=said, now=now, wake_at=wake_at, canary=bool(canary))
        if run is not None:
            released.append(run.workflow_id)
            if wake_at is not None:
                later[run.workflow_id] = wake_at
    return {"pause": pause, "released": released, "due": later, "canary": bool(canary)}


def waiting_for(pause: WorkflowPause) -> list[int]:
    """The runs ``pause`` holds (paused by it), oldest first, then — a whole workflow's pause — the
    runs it keeps pending; those released from it as canaries already left out."""
    held = WorkflowRun.objects.filter(workflow_pause=pause, state=RunState.PAUSED).order_by("pk")
    runs = list(held.values_list("pk", flat=True))
    if not pause.step_name:
        kept = WorkflowRun.objects.filter(workflow_name=pause.workflow_name, state=RunState.PENDING)
        runs += kept.exclude(workflow_pause=pause).order_by("pk").values_list("pk", flat=True)
    return runs


def _release(
    run_pk: int,
    pause: WorkflowPause,
    *,
    actor: AbstractBaseUser | str,
    reason: str,
    now: datetime,
    wake_at: datetime | None,
    canary: bool,
) -> WorkflowRun | None:
    """One run ``pause`` held (or kept pending) goes on: due at once or at ``wake_at``; a canary
    keeps naming the pause, which it passes. None if the run moved meanwhile (terminated, say)."""
    user = None if isinstance(actor, str) else actor
    with transaction.atomic():
        run = WorkflowRun.objects.select_for_update().filter(pk=run_pk).first()
        if run is None:
            return None
        before = _snap(run)
        if run.state == RunState.PAUSED and run.workflow_pause_id == pause.pk:
            run.paused_at, run.paused_by, run.pause_reason = None, None, None
            run.workflow_pause_id = pause.pk if canary else None
            target = resumed_state(run)  # forward, or compensating if it was paused undoing its effects
            _release_into(run, target, wake_at=wake_at, reason=f"unpaused by {_actor_fields(actor)['actor']}")
            fields = [*RUN_LEASE_FIELDS, "status_reason", *PAUSE_FIELDS, "workflow_pause_id"]
        elif run.state == RunState.PENDING and not pause.step_name and run.workflow_name == pause.workflow_name:
            run.next_wake_at, fields = wake_at, ["next_wake_at"]  # kept pending: due now, or in its wave
            if canary:
                run.workflow_pause_id, fields = pause.pk, [*fields, "workflow_pause_id"]
        else:
            return None
        _save_run(run, fields, now, user)
        after = {**_snap(run), "workflow_pause": pause.scope}
        if canary:
            after["canary"] = True
        if wake_at is not None:
            after["due_at"] = wake_at.isoformat()
        _audit(run, "unpause", actor=actor, reason=reason, before=before, after=after, now=now)
        if wake_at is None:
            dispatch.enqueue_run(run.pk)
    return run
