"""Pausing a whole workflow, or one step of it (issue 37): a supervisor stops every run of it at
once during an incident, with a reason, and releases them later.

While a pause is in force (a ``WorkflowPause`` row not released): new events are accepted and
their runs kept pending (``leases.claimable`` does not take them; a start does not claim what it
starts); a run under way stops before its next attempt — of any step, or of the paused step
only — once the call in flight is recorded, and waits as ``paused``, held by that pause
(``WorkflowRun.workflow_pause``). The executor reads nothing for this on its way: the write
of a new attempt carries the condition that no such pause is in force (``storage.Unpaused``)
and misses if one is; the executor then decides again under the run's lock, where the draft
reads the pauses in force (``Draft.workflow_pause``), and writes the run's pause instead.

Unpausing releases the pause and the runs it holds (transitions.releases): at once, in waves, or
first a canary of a few while the pause stays in force. A step whose effect commits in
our own database with its outcome (``local=True``) makes no attempt to stop before: pausing one
is refused, and a paused workflow's local steps run up to its next call."""

from __future__ import annotations

from datetime import datetime

from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, transaction

from recovery import clock, permissions
from recovery.contract import PauseAfter
from recovery.errors import InvalidTransition, NotPermitted, PauseConflict
from recovery.models import AuditEvent, WorkflowPause, WorkflowRun
from recovery.redaction import redact_text
from recovery.registry import all_versions
from recovery.states import AuditAction, pause_scope

from ._core import _actor_fields, require_reason

# A failed attempt of a step, in its audit trail: failed (then retried, or not), or its outcome unknown.
FAILED_ATTEMPTS = [AuditAction.STEP_FAIL.value, AuditAction.STEP_UNKNOWN.value]


def in_force(workflow: str | None = None) -> list[WorkflowPause]:
    """The pauses in force (of ``workflow``, or of every workflow), oldest first."""
    pauses = WorkflowPause.objects.filter(released_at__isnull=True)
    if workflow is not None:
        pauses = pauses.filter(workflow_name=workflow)
    return list(pauses.order_by("paused_at", "pk"))


def workflow_pause(
    *, workflow: str, step_name: str = "", actor: AbstractBaseUser | str, reason: str, now: datetime | None = None
) -> WorkflowPause:
    """Pause ``workflow`` (or its step ``step_name``): no new attempt begins where it applies
    until it is unpaused. Refused (InvalidTransition, nothing written) for a workflow or step
    this deployment does not know, a local step, and what is paused already."""
    reason = require_reason(reason)
    _require_supervisor(actor, "pause a workflow")
    _check_scope(workflow, step_name)
    who = _actor_fields(actor)["actor"]
    try:
        with transaction.atomic():
            return WorkflowPause.objects.create(
                workflow_name=workflow,
                step_name=step_name,
                paused_by=who,
                reason=redact_text(reason),
                paused_at=now or clock.now(),
            )
    except IntegrityError:  # one_pause_in_force: someone paused it first
        raise PauseConflict(_already(workflow, step_name)) from None


AUTO_PAUSE = "auto-pause"  # who paused a step by itself (a step's ``pause_after`` policy)
RECENT_FAILURES = 1000  # failures read back at most, newest first, to count one kind's


def workflow_pause_if_failing(
    *, run: WorkflowRun, step_name: str, kind: str, error: str, policy: PauseAfter, now: datetime | None = None
) -> WorkflowPause | None:
    """After a failed attempt of ``step_name`` (``kind``) in ``run``, recorded: if attempts of that
    step across the workflow's runs failed with that kind ``policy.failures`` times within
    ``policy.within``, pause the step for the whole workflow (by AUTO_PAUSE, its alert raised on
    ``run`` by the next sweep). None if it does not, or a pause of the step or the workflow is in
    force already. Counted from the audit trail (the failures' own events); an executor lost
    mid-call is not the receiver's failure and does not count."""
    now = now or clock.now()
    workflow = run.workflow_name
    in_force = WorkflowPause.objects.filter(workflow_name=workflow, step_name__in=["", step_name], released_at=None)
    if in_force.exists():
        return None
    failures = AuditEvent.objects.filter(
        at__gte=now - policy.within, action__in=FAILED_ATTEMPTS, step_name=step_name, run__workflow_name=workflow
    )
    afters = failures.order_by("-at").values_list("after", flat=True)[:RECENT_FAILURES]
    failed = sum(1 for after in afters if _receivers(after) and after.get("error_kind") == kind)
    if failed < policy.failures:
        return None
    reason = f"{policy.text(failed, kind, step_name)}: the receiver keeps failing (the last: {error})"
    try:
        with transaction.atomic():
            return WorkflowPause.objects.create(
                workflow_name=workflow,
                step_name=step_name,
                paused_by=AUTO_PAUSE,
                reason=redact_text(reason)[:2000],
                paused_at=now,
                automatic=True,
                trigger_run=run,
            )
    except IntegrityError:  # another executor's failure paused it first
        return None


def _receivers(after: object) -> bool:
    """Whether a failed attempt's audit ``after`` is the receiver's failure: not an executor lost
    in the middle of the call (a crash, a kill, a deploy's restart), which says nothing of it."""
    return isinstance(after, dict) and not after.get("executor_lost")


def _require_supervisor(actor: AbstractBaseUser | str, doing: str) -> None:
    if isinstance(actor, str) or permissions.can(actor, "pause_workflow"):
        return  # a system's label (an alert policy, the API's token) was checked where it came in
    role = permissions.role_of(actor).name.lower()
    raise NotPermitted(f"{actor.get_username()} ({role}) may not {doing}: that needs the supervisor role")


def _check_scope(workflow: str, step_name: str) -> None:
    versions = [wf for wf in all_versions() if wf.name == workflow]
    if not versions:
        raise InvalidTransition(f"no workflow {workflow!r} is deployed here")
    if not step_name:
        return
    specs = [spec for wf in versions for spec in wf.steps if spec.name == step_name]
    if not specs:
        names = sorted({spec.name for wf in versions for spec in wf.steps})
        raise InvalidTransition(f"workflow {workflow} has no step {step_name!r} (its steps: {', '.join(names)})")
    if all(spec.local for spec in specs):
        raise InvalidTransition(
            f"step {step_name} of {workflow} is local: its effect commits with its outcome and no attempt of it "
            "waits to begin; pause the step after it, or the whole workflow"
        )
    if all(spec.is_wait for spec in specs):
        raise InvalidTransition(
            f"step {step_name} of {workflow} is a wait: it calls nothing, and its runs hold no worker while they "
            "wait; pause the step after it, or the whole workflow"
        )


def _already(workflow: str, step_name: str) -> str:
    pause = WorkflowPause.objects.filter(workflow_name=workflow, step_name=step_name, released_at=None).first()
    scope = pause_scope(workflow, step_name)
    if pause is None:
        return f"{scope} is paused already"
    return f"{scope} is paused already, by {pause.paused_by} at {clock.time_of_day(pause.paused_at)}: {pause.reason}"
